"""Recompute keeps its contract on one process:

* gradients equal those of the same model without recompute (1e-6) on a deep MLP with dropout,
  through ``fleet.distributed_model`` with ``strategy.recompute``: the RNG state is preserved,
  so dropout draws the same mask when a block is recomputed;
* each named block's forward runs twice per training step (forward, then recomputation in
  backward), once in eval / no-grad forwards, and unnamed blocks once;
* the bytes saved for backward (counted with ``torch.autograd.graph.saved_tensors_hooks``, distinct
  storages, parameters left out) fall by at least 50 % with every block named;
* a name that matches no module is an error naming it and the closest names;
* the functional form ``fleet.utils.recompute(function, *args, **kwargs)``, beside ``fleet.util``.
"""
from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

from fleetx import DistributedStrategy, fleet as fleet_module
from fleetx.fleet import Fleet, UtilBase
from fleetx.strategy.algorithms.recompute import checkpoint_modules
from fleetx.strategy.api import ModelInfo, PlanInput, StrategyError, WorldInfo
from fleetx.strategy.measured import SavedForBackward
from fleetx.strategy.planner import make_plan

DEPTH, WIDTH, BATCH = 8, 32, 64


class Block(nn.Module):
    """A residual MLP block with dropout; counts its forward calls."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1, self.act = nn.Linear(width, 4 * width), nn.GELU()
        self.drop, self.fc2 = nn.Dropout(0.3), nn.Linear(4 * width, width)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x + self.fc2(self.drop(self.act(self.fc1(x))))


def deep_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(WIDTH) for _ in range(DEPTH)], nn.Linear(WIDTH, 1))


ALL_BLOCKS = [str(i) for i in range(DEPTH)]


@pytest.fixture
def fleet(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PADDLE_TRAINER_ENDPOINTS",
                 "PADDLE_TRAINER_ID", "PADDLE_PSERVERS_IP_PORT_LIST", "FLEETX_DRY_RUN"):
        monkeypatch.delenv(name, raising=False)
    return Fleet()


def _strategy(names) -> DistributedStrategy:
    s = DistributedStrategy()
    s.recompute = True
    s.recompute_configs = {"checkpoints": list(names)}
    return s


def _grads(model: nn.Module, x: torch.Tensor, seed: int = 7) -> dict:
    torch.manual_seed(seed)  # the dropout masks of the forward
    model(x).pow(2).mean().backward()
    plain = getattr(model, "module", model)  # the plain model's names, not the wrapper's
    return {n: p.grad.clone() for n, p in plain.named_parameters()}


def test_gradients_equal_no_recompute_through_the_strategy(fleet):
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(1))
    plain = deep_mlp()
    expected = _grads(plain, x)
    fleet.init(is_collective=True, strategy=_strategy(ALL_BLOCKS[::2]))
    model = fleet.distributed_model(deep_mlp())
    got = _grads(model, x)
    assert "recompute" in fleet.applied_strategies()
    assert got.keys() == expected.keys()
    for name, g in expected.items():
        assert torch.allclose(got[name], g, rtol=0, atol=1e-6), name
    # the dropout really dropped (else equal masks would prove nothing)
    assert (plain[0].drop(torch.ones(1000)) == 0).any()


def test_rng_is_preserved_and_disabling_it_changes_the_gradients():
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(1))
    expected = _grads(deep_mlp(), x)
    loose = deep_mlp()
    for i in range(DEPTH):  # checkpointed without restoring the RNG: other masks in backward
        block = loose[i]
        block.forward = (lambda b: lambda t: fleet_module.utils.recompute(
            type(b).forward.__get__(b), t, preserve_rng_state=False))(block)
    got = _grads(loose, x)
    assert max((got[n] - g).abs().max().item() for n, g in expected.items()) > 1e-3


def test_the_plan_names_the_recomputed_modules(fleet):
    fleet.init(is_collective=True, strategy=_strategy(["0", "3"]))
    fleet.distributed_model(deep_mlp())
    plan = fleet.explain(file=io.StringIO())
    line = next(line for line in str(plan).splitlines() if "recompute" in line)
    assert "applied" in line and "2 module(s): 0, 3" in line and "non-reentrant" in line
    assert not any(e.warn and "recompute" in e.reason for e in plan.entries)


def test_a_named_block_runs_twice_per_step_and_once_without_grad(fleet):
    fleet.init(is_collective=True, strategy=_strategy(["2", "5"]))
    model = fleet.distributed_model(deep_mlp())
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.01))
    x = torch.randn(BATCH, WIDTH)
    for _ in range(3):
        opt.minimize(model(x).pow(2).mean())
        opt.clear_grad()
    calls = [model.module[i].calls for i in range(DEPTH)]
    assert calls == [3, 3, 6, 3, 3, 6, 3, 3]
    with torch.no_grad():
        model(x)
    model.eval()
    model(x)
    assert [model.module[i].calls for i in (0, 2, 5)] == [5, 8, 8]


def _saved_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes of the distinct storages saved for backward during one forward, parameters aside."""
    with SavedForBackward(model.parameters()) as saved:
        loss = model(x).pow(2).mean()
    loss.backward()
    return saved.bytes


def test_saved_bytes_fall_by_more_than_half_with_every_block_named():
    x = torch.randn(BATCH, WIDTH)
    plain = _saved_bytes(deep_mlp(), x)
    recomputed = _saved_bytes(checkpoint_modules(deep_mlp(), ALL_BLOCKS), x)
    ratio = recomputed / plain
    print(f"saved for backward: {plain} -> {recomputed} bytes ({ratio:.1%})")
    assert ratio <= 0.5
    # what remains: each block's input (kept) and the head's input, BATCH x WIDTH floats each,
    # and the input of the loss's pow (BATCH x 1)
    assert recomputed == (DEPTH + 1) * BATCH * WIDTH * 4 + BATCH * 4


def test_an_unknown_name_is_an_error_naming_it_and_the_closest(fleet):
    fleet.init(is_collective=True, strategy=_strategy(["0", "blocks.1"]))
    model = fleet.distributed_model(deep_mlp())
    with pytest.raises(StrategyError) as err:  # planned with the model known
        fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    text = str(err.value)
    assert "recompute_configs['checkpoints'] names no module 'blocks.1' (closest: '1', " in text
    assert "modules of the model (model.named_modules()): 0, 0.fc1, 0.act" in text
    with pytest.raises(ValueError) as err:  # wrapping checks too, for a plan made without it
        checkpoint_modules(Block(4), ["fc9"])
    assert str(err.value) == ("recompute_configs['checkpoints'] names no module 'fc9' (closest: "
                              "'fc2', 'fc1', 'act'); an entry is a qualified name, a glob of "
                              "names ('blocks.*') or a class name; modules of the model "
                              "(model.named_modules()): fc1, act, drop, fc2; classes: Linear, "
                              "GELU, Dropout")


def test_the_planner_checks_names_only_when_it_knows_the_model():
    s = _strategy(["nope"])
    unknown = make_plan(PlanInput(s, WorldInfo()))  # no model yet: checked when wrapping
    assert "recompute" in unknown.applied
    with pytest.raises(StrategyError, match="names no module 'nope'"):
        make_plan(PlanInput(s, WorldInfo(), ModelInfo.of(deep_mlp())))


def test_empty_checkpoints_skip_with_a_warning_and_offload_is_declared_without_effect():
    s = _strategy([])
    s.recompute_configs = {"enable_offload": True, "checkpoint_shape": [4, 32]}
    plan = make_plan(PlanInput(s, WorldInfo()))
    entry = next(e for e in plan.entries if e.name == "recompute")
    assert not entry.applied and entry.warn and "checkpoints'] is empty" in entry.reason
    notice = next(e for e in plan.entries if e.name == "no_effect").reason
    assert "recompute_configs.enable_offload (offload is not implemented: on CPU" in notice
    assert "recompute_configs.checkpoint_shape (module inputs are kept" in notice


def test_wrapping_twice_recomputes_once_and_copies_stay_independent():
    model = checkpoint_modules(checkpoint_modules(deep_mlp(), ["1"]), ["1"])
    x = torch.randn(4, WIDTH)
    model(x).sum().backward()
    assert model[1].calls == 2
    twin = copy.deepcopy(model)
    twin(x).sum().backward()
    assert (model[1].calls, twin[1].calls) == (2, 4)
    assert twin.state_dict().keys() == deep_mlp().state_dict().keys()


def test_functional_form_equals_the_plain_call_and_rejects_other_keywords():
    block = deep_mlp()[0]
    x = torch.randn(BATCH, WIDTH, requires_grad=True)
    torch.manual_seed(3)
    fleet_module.utils.recompute(block, x).sum().backward()
    got = (x.grad.clone(), block.fc1.weight.grad.clone())
    assert block.calls == 2
    x.grad, block.fc1.weight.grad = None, None
    torch.manual_seed(3)
    block(x).sum().backward()
    assert torch.allclose(got[0], x.grad, atol=1e-6)
    assert torch.allclose(got[1], block.fc1.weight.grad, atol=1e-6)
    with pytest.raises(ValueError, match="Unexpected keyword arguments: use_reentrant"):
        fleet_module.utils.recompute(block, x, use_reentrant=True)


def test_fleet_utils_module_and_fleet_util_instance_both_exist():
    import fleetx.fleet.utils as utils_module
    assert fleet_module.utils is utils_module
    assert isinstance(fleet_module.util, UtilBase)
