"""Expected state bytes per rank (strategy/footprint.py), the plan line that prints them, and
``fleet.state_bytes()`` measured in one process against them."""
from __future__ import annotations

import doctest

import pytest
import torch
from torch import nn

from fleetx.fleet import Fleet, FleetError, memory
from fleetx.strategy import footprint, measured
from fleetx.strategy.api import ModelInfo, OptimizerInfo, WorldInfo
from fleetx.strategy.distributed_strategy import DistributedStrategy
from fleetx.strategy.footprint import Footprint
from fleetx.strategy.planner import plan_for


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 20), nn.ReLU(), nn.Linear(20, 5))


PARAM_BYTES = 4 * (12 * 20 + 20 + 20 * 5 + 5)  # four float32 parameters
N_PARAMS = 4


def test_doctests_pass():
    for module in (footprint, memory, measured):
        failures, _ = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert failures == 0, module.__name__


@pytest.mark.parametrize("make, kept", [
    (lambda p: torch.optim.SGD(p, lr=0.1), (0, 0)),
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), (1, 0)),
    (lambda p: torch.optim.Adam(p), (2, 1)),
    (lambda p: torch.optim.AdamW(p, amsgrad=True), (3, 1)),
    (lambda p: torch.optim.RMSprop(p, momentum=0.9, centered=True), (3, 1)),
    (lambda p: torch.optim.Adagrad(p), (1, 1)),
])
def test_state_tensors_match_what_torch_keeps_after_a_step(make, kept):
    model = mlp()
    opt = make(model.parameters())
    model(torch.randn(3, 12)).sum().backward()
    opt.step()
    full = sum(1 for s in opt.state.values() for t in s.values()
               if torch.is_tensor(t) and t.dim() > 0) // N_PARAMS
    scalars = sum(1 for s in opt.state.values() for t in s.values()
                  if torch.is_tensor(t) and t.dim() == 0) // N_PARAMS
    assert footprint.state_tensors(OptimizerInfo.of(opt)) == kept == (full, scalars)


def test_full_copy_figures():
    model = mlp()
    fp = Footprint.of(ModelInfo.of(model), OptimizerInfo.of(torch.optim.Adam(model.parameters())))
    assert (fp.parameters, fp.gradients) == (PARAM_BYTES, PARAM_BYTES)
    assert fp.optimizer == 2 * PARAM_BYTES + 4 * N_PARAMS and fp.scalars == 4 * N_PARAMS
    assert fp.total == 4 * PARAM_BYTES + 4 * N_PARAMS


def test_frozen_parameters_have_no_gradient_or_state():
    model = mlp()
    model[0].weight.requires_grad_(False)
    fp = Footprint.of(ModelInfo.of(model), OptimizerInfo("SGD", (("momentum", 0.9),)))
    frozen = 4 * 12 * 20
    assert (fp.parameters, fp.gradients, fp.optimizer) == (
        PARAM_BYTES, PARAM_BYTES - frozen, PARAM_BYTES - frozen)


@pytest.mark.parametrize("stage, degree", [(1, 2), (2, 2), (3, 2), (1, 4), (2, 4), (3, 8)])
def test_each_stage_divides_its_share(stage, degree):
    base = Footprint(parameters=8000, gradients=8000, optimizer=16000 + 40, scalars=40)
    fp = base.sharded(stage, degree)
    assert fp.optimizer - fp.scalars == 16000 // degree
    # ZeRO (stage 1) gives each parameter's whole state to one rank; FSDP a shard of every one
    assert fp.scalars == (40 // degree if stage == 1 else 40)
    assert fp.gradients == (8000 if stage == 1 else 8000 // degree)
    assert fp.parameters == (8000 if stage == 1 else 8000 // degree)
    assert fp.parameters_in_step == (8000 + 8000 // degree if stage == 2 else None)
    assert f"sharding stage {stage} over {degree} ranks" in str(fp)


@pytest.mark.parametrize("stage, degree, message", [
    (0, 2, "sharding stage must be 1, 2 or 3, got 0"),
    (4, 2, "sharding stage must be 1, 2 or 3, got 4"),
    (1, 0, "sharding degree must be >= 1, got 0"),
])
def test_bad_stage_or_degree_is_named(stage, degree, message):
    with pytest.raises(ValueError, match=message):
        Footprint(1, 1, 1).sharded(stage, degree)


def test_unknown_optimizer_says_why():
    class Mine(torch.optim.SGD):
        pass

    model = mlp()
    fp = Footprint.of(ModelInfo.of(model), OptimizerInfo.of(Mine(model.parameters(), lr=1)))
    assert fp.optimizer is None and fp.total is None
    assert "optimizer unknown (Mine is not in footprint.STATE_TENSORS)" in str(fp)
    fp = Footprint.of(ModelInfo.of(model), OptimizerInfo())
    assert "optimizer unknown (no optimizer given yet)" in str(fp)


def test_plan_prints_the_figures_once_the_model_is_known():
    model = mlp()
    world = WorldInfo(world_size=2)
    plan = plan_for(DistributedStrategy(), world, model, torch.optim.Adam(model.parameters()))
    assert plan.footprint == Footprint.of(ModelInfo.of(model),
                                          OptimizerInfo.of(torch.optim.Adam(model.parameters())))
    assert (f"expected state per rank: parameters {PARAM_BYTES:,} B (1.4 KiB), gradients "
            f"{PARAM_BYTES:,} B (1.4 KiB), optimizer {2 * PARAM_BYTES + 16:,} B (2.9 KiB)"
            ) in str(plan)
    assert plan_for(DistributedStrategy(), world).footprint is None
    assert "expected state" not in str(plan_for(DistributedStrategy(), world))


def test_state_bytes_before_the_wrappers_is_an_error(one_process):
    fleet = Fleet()
    with pytest.raises(FleetError, match=r"call fleet.init\(\) before fleet.state_bytes\(\)"):
        fleet.state_bytes()
    fleet.init(is_collective=True)
    with pytest.raises(FleetError, match="measures the model and optimizer given to "
                                         "fleet.distributed_model / fleet.distributed_optimizer; "
                                         "call them first"):
        fleet.state_bytes()


def test_state_bytes_follows_one_step_and_matches_explain(one_process, capsys):
    fleet = Fleet()
    fleet.init(is_collective=True)
    model = fleet.distributed_model(mlp())
    opt = fleet.distributed_optimizer(torch.optim.Adam(model.parameters()))
    assert fleet.state_bytes() == {"parameters": PARAM_BYTES, "gradients": 0, "optimizer": 0}
    opt.backward(model(torch.randn(3, 12)).sum())
    assert fleet.state_bytes()["gradients"] == PARAM_BYTES
    opt.step()
    measured = fleet.state_bytes()
    expected = fleet.explain().footprint
    assert measured == {"parameters": expected.parameters, "gradients": expected.gradients,
                        "optimizer": expected.optimizer}
    opt.zero_grad()
    assert fleet.state_bytes()["gradients"] == 0


def test_a_storage_counts_once(one_process):
    """Tied weights are one storage; gradients that are views of one flat buffer count it."""
    a, b = nn.Linear(6, 6, bias=False), nn.Linear(6, 6, bias=False)
    b.weight = a.weight
    flat = torch.zeros(2 * 36)
    grads = flat.view(2, 6, 6)
    a.weight.grad = grads[0]
    extra = nn.Parameter(torch.ones(6, 6))
    extra.grad = grads[1]
    opt = torch.optim.SGD([a.weight, extra], lr=0.1, momentum=0.9)
    opt.state[extra]["momentum_buffer"] = extra.grad  # the same storage as a gradient
    assert memory.measure([nn.ModuleList([a, b])], opt) == {
        "parameters": 2 * 36 * 4, "gradients": 2 * 36 * 4, "optimizer": 0}
