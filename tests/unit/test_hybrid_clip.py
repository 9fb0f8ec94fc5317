"""Global-norm clipping and data parallelism within a hybrid topology, on one process.

``fleetx.parallel.clip.clip_grad_norm_`` without a hybrid group (and ``fleet.distributed_optimizer
(opt).clip_grad_norm_`` under a one-process ``fleet.init``) equals
``torch.nn.utils.clip_grad_norm_``: norms and clipped gradients, for the 2-, 1- and inf-norms; bad
norm types are refused with the reason (clipping under amp: tests/unit/test_recipe_clip.py). The
data-parallel verdicts of hybrid layouts are pure planning: DDP over the data-parallel group, or
none with dp_degree 1.
The multi-process sums are tested in tests/distributed/test_hybrid.py.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from fleetx import DistributedStrategy
from fleetx.fleet import Fleet
from fleetx.parallel.clip import clip_grad_norm_
from fleetx.strategy.api import PlanInput, WorldInfo
from fleetx.strategy.planner import make_plan


def _model_with_grads(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(1))
    (model(x) ** 2).sum().backward()
    return model


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_clip_without_a_hybrid_group_equals_torch(norm_type):
    want, got = _model_with_grads(), _model_with_grads()
    ref = nn.utils.clip_grad_norm_(want.parameters(), 0.1, norm_type)
    norm = clip_grad_norm_(got.parameters(), 0.1, norm_type, modules=[got], hcg=None)
    assert ref > 0.1  # the clipping acts
    assert torch.allclose(norm, ref, rtol=1e-6, atol=0)
    for a, b in zip(want.parameters(), got.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-6, atol=1e-9)


def test_a_large_max_norm_leaves_the_gradients():
    model = _model_with_grads()
    before = [p.grad.clone() for p in model.parameters()]
    clip_grad_norm_(model.parameters(), 1e9)
    assert all(torch.equal(a, p.grad) for a, p in zip(before, model.parameters()))


@pytest.mark.parametrize("bad", [0, -1.0, float("nan")])
def test_bad_norm_types_are_refused(bad):
    with pytest.raises(ValueError, match=f"norm_type={bad!r}: use a positive number or inf"):
        clip_grad_norm_(_model_with_grads().parameters(), 1.0, bad)


def test_a_nonfinite_norm_raises_when_asked():
    model = _model_with_grads()
    next(model.parameters()).grad[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="not finite"):
        clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)


@pytest.fixture
def one_process(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PADDLE_TRAINER_ENDPOINTS",
                 "PADDLE_TRAINER_ID", "PADDLE_PSERVERS_IP_PORT_LIST", "FLEETX_DRY_RUN"):
        monkeypatch.delenv(name, raising=False)

    def make(**switches) -> Fleet:
        s = DistributedStrategy()
        for key, value in switches.items():
            setattr(s, key, value)
        f = Fleet()
        f.init(is_collective=True, strategy=s)
        return f
    return make


def test_distributed_optimizer_clips_like_torch(one_process):
    f = one_process()
    want = _model_with_grads()
    model = _model_with_grads()
    wrapped = f.distributed_model(model)
    opt = f.distributed_optimizer(torch.optim.SGD(wrapped.parameters(), lr=0.1))
    ref = nn.utils.clip_grad_norm_(want.parameters(), 0.2)
    assert torch.allclose(opt.clip_grad_norm_(0.2), ref, rtol=1e-6, atol=0)
    for a, b in zip(want.parameters(), model.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-6, atol=1e-9)


def _data_parallel_reason(world: int, **hybrid) -> tuple:
    s = DistributedStrategy()
    s.hybrid_configs = hybrid
    plan = make_plan(PlanInput(s, WorldInfo(world_size=world)))
    entry = next(e for e in plan.entries if e.name == "data_parallel")
    return "data_parallel" in plan.applied, entry.reason


def test_data_parallel_runs_over_the_data_parallel_group_of_a_hybrid_layout():
    applied, reason = _data_parallel_reason(4, dp_degree=2, mp_degree=2)
    assert applied and reason.startswith(
        "gradients averaged over the data-parallel group (dp_degree=2 of 4 processes, "
        "mp_degree=2 x pp_degree=1)")
    applied, reason = _data_parallel_reason(4, mp_degree=2, pp_degree=2)
    assert not applied and reason == ("dp_degree=1: every process holds another part of the "
                                      "model (mp_degree=2 x pp_degree=2); nothing is replicated")
    applied, reason = _data_parallel_reason(2)  # no hybrid degrees: the world, as before
    assert applied and "over 2 processes" in reason


def test_clip_on_a_gradient_merge_micro_step_does_nothing_until_the_update(one_process):
    """The same loop (backward, clip, step) with k_steps=2: the first micro-step's partial,
    unsynchronised gradients are left alone (None), the second clips the merged average as
    torch clips the same average."""
    f = one_process(gradient_merge=True, gradient_merge_configs={"k_steps": 2, "avg": True})
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    want = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    want.load_state_dict(model.state_dict())
    wrapped = f.distributed_model(model)
    opt = f.distributed_optimizer(torch.optim.SGD(wrapped.parameters(), lr=0.1))
    xs = torch.randn(2, 5, 6, generator=torch.Generator().manual_seed(1))
    opt.backward((wrapped(xs[0]) ** 2).sum())
    before = [p.grad.clone() for p in model.parameters()]
    assert opt.clip_grad_norm_(0.2) is None
    assert all(torch.equal(a, p.grad) for a, p in zip(before, model.parameters()))
    assert opt.step() is False
    opt.zero_grad()  # kept: still accumulating
    opt.backward((wrapped(xs[1]) ** 2).sum())
    for x in xs:
        ((want(x) ** 2).sum() / 2).backward()
    ref = nn.utils.clip_grad_norm_(want.parameters(), 0.2)
    norm = opt.clip_grad_norm_(0.2)
    assert ref > 0.2 and torch.allclose(norm, ref, rtol=1e-6, atol=0)
    for a, b in zip(want.parameters(), model.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-6, atol=1e-9)
    assert opt.step() is True
