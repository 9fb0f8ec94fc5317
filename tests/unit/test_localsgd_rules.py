"""Local SGD, adaptive local SGD and gradient merge without processes: the schedules (the
adaptive rule on a scripted sequence of learning rates and losses) and the plan's verdicts."""
from __future__ import annotations

import math

import pytest

from fleetx import DistributedStrategy
from fleetx.strategy.algorithms.adaptive_localsgd import (AdaptiveInterval,
                                                          AdaptiveLocalSGDStrategy, next_interval)
from fleetx.strategy.algorithms.amp import AmpStrategy
from fleetx.strategy.algorithms.data_parallel import DataParallelStrategy
from fleetx.strategy.algorithms.gradient_merge import GradientMergeStrategy, MergeState
from fleetx.strategy.algorithms.lamb import LambStrategy
from fleetx.strategy.algorithms.lars import LarsStrategy
from fleetx.strategy.algorithms.localsgd import LocalSGDState, LocalSGDStrategy
from fleetx.strategy.api import Mode, OptimizerInfo, PlanInput, StrategyError, WorldInfo
from fleetx.strategy.planner import make_plan

MINE = [DataParallelStrategy, LocalSGDStrategy, AdaptiveLocalSGDStrategy, GradientMergeStrategy,
        AmpStrategy, LarsStrategy, LambStrategy]
TWO = WorldInfo(world_size=2, local_world_size=2)


def plan(world=TWO, optimizer="SGD", **switches):
    s = DistributedStrategy()
    for key, value in switches.items():
        setattr(s, key, value)
    return make_plan(PlanInput(s, world, optimizer=OptimizerInfo(optimizer, (("momentum", 0.9),))),
                     MINE)


# -- the adaptive rule -----------------------------------------------------------------------------
def test_next_interval_formula_and_bounds():
    assert next_interval(0.1, 2.0, 0.1, 2.0, 1) == 1
    assert next_interval(0.1, 2.0, 0.1, 2.0, 10) == math.ceil(math.sqrt(10)) == 4
    assert next_interval(0.1, 2.0, 0.025, 2.0, 1) == 2       # lr / 4 -> sqrt(4)
    assert next_interval(0.1, 2.0, 0.1, 0.5, 4) == 1         # loss / 4 -> sqrt(1)
    assert next_interval(0.1, 2.0, 0.001, 2.0, 1) == 10      # sqrt(100)
    assert next_interval(0.1, 2.0, 1e-6, 2.0, 1) == 16       # clipped above
    assert next_interval(0.1, 2.0, 0.1, 1e-9, 1) == 1        # clipped below
    assert next_interval(0.1, 2.0, 0.0, 2.0, 1) == 16        # lr reached zero
    assert next_interval(0.1, 2.0, 0.1, -1.0, 1) == 1        # nonsense loss: sync often


def test_adaptive_schedule_on_a_scripted_sequence():
    """(lr, mean loss) of every step; the schedule decides which steps average and the k after."""
    s = AdaptiveInterval(init_k_steps=2, begin_step=2)
    script = {1: (0.1, 4.0), 2: (0.1, 4.0), 3: (0.1, 3.0), 4: (0.05, 3.0), 5: (0.05, 3.0),
              6: (0.02, 2.0), 7: (0.02, 2.0), 8: (0.02, 2.0), 9: (0.01, 2.0)}
    averaged, intervals = [], {}
    for step in range(1, 10):
        due = s.advance()
        if due:
            averaged.append(step)
        if s.needs_loss():
            s.observe(*script[step])
            intervals[step] = s.k_steps
        assert s.in_warmup() is (step < 2)
    # step 1 fixes lr0=0.1, loss0=4; step 2 ends the warm-up: k = ceil(sqrt(1 * 2)) = 2;
    # step 4: k = ceil(sqrt(0.1*3/(0.05*4)*2)) = ceil(sqrt(3)) = 2; step 6: ceil(sqrt(5)) = 3;
    # step 9: ceil(sqrt(0.1*2/(0.01*4)*2)) = ceil(sqrt(10)) = 4.
    assert averaged == [4, 6, 9]
    assert intervals == {1: 2, 2: 2, 4: 2, 6: 3, 9: 4}
    assert (s.lr0, s.loss0, s.syncs, s.last_sync) == (0.1, 4.0, 3, 9)
    restored = AdaptiveInterval(init_k_steps=2, begin_step=2)
    restored.load_state_dict(s.state_dict())
    assert restored == s


def test_localsgd_schedule_counts_from_one_like_paddle():
    s = LocalSGDState(k_steps=3, begin_step=2)
    warm, due = [], []
    for step in range(1, 12):
        warm.append(s.in_warmup())
        if s.advance():
            due.append(step)
    assert warm[:3] == [True, True, False] and not any(warm[2:])
    assert due == [5, 8, 11] and s.syncs == 3


def test_merge_state_boundaries():
    s = MergeState(k_steps=3)
    seen = []
    for _ in range(6):
        seen.append(s.at_boundary())
        s.advance()
        seen.append(s.merged())
    assert seen == [False, False, False, False, True, True] * 2


# -- verdicts --------------------------------------------------------------------------------------
def test_localsgd_plans():
    p = plan(localsgd=True, localsgd_configs={"k_steps": 4, "begin_step": 10})
    assert p.applied == ("data_parallel", "localsgd")
    assert "gradient all-reduce for steps 1..10, then local steps and a parameter average every 4" \
        in str(p)
    assert "k_steps=1: every step synchronises" in str(plan(localsgd=True))
    one = plan(world=WorldInfo(), localsgd=True)
    assert [e.name for e in one.warnings] == ["localsgd"]
    assert "WARNING skipped   one process: no parameters to average" in str(one)


@pytest.mark.parametrize("switches, optimizer, message", [
    ({"localsgd": True}, "Adam", "localsgd: needs the inner optimizer to be SGD or Momentum "
                                 r"\(torch.optim.SGD\), got Adam"),
    ({"adaptive_localsgd": True}, "AdamW", "adaptive_localsgd: needs the inner optimizer"),
    ({"localsgd": True, "adaptive_localsgd": True}, "SGD",
     "adaptive_localsgd: cannot be combined with localsgd"),
    ({"localsgd": True, "gradient_merge": True, "gradient_merge_configs": {"k_steps": 2}}, "SGD",
     "gradient_merge: cannot be combined with localsgd"),
])
def test_localsgd_preconditions(switches, optimizer, message):
    with pytest.raises(StrategyError, match=message):
        plan(optimizer=optimizer, **switches)


def test_ps_mode_is_refused():
    ps = WorldInfo(world_size=2, mode=Mode.PS)
    for switch in ("amp", "gradient_merge", "lars", "localsgd"):
        with pytest.raises(StrategyError, match=f"{switch}: runs in collective mode only"):
            plan(world=ps, **{switch: True})


def test_gradient_merge_plans():
    assert [e.name for e in plan(gradient_merge=True).warnings] == ["gradient_merge"]
    p = plan(gradient_merge=True, gradient_merge_configs={"k_steps": 4, "avg": False}, amp=True)
    assert p.applied == ("data_parallel", "gradient_merge", "amp")
    assert "4 micro-steps accumulated (summed) per optimizer step" in str(p)


def test_the_composition_matrix_pairs_plan():
    """Every pair docs/strategies.md lists as composing plans without an error."""
    gm = {"gradient_merge": True, "gradient_merge_configs": {"k_steps": 2}}
    pairs = [(dict(gm, amp=True), "SGD"), (dict(gm, lars=True), "SGD"),
             (dict(gm, lamb=True), "Adam"), ({"amp": True, "lars": True}, "SGD"),
             ({"amp": True, "lamb": True}, "Adam"), ({"amp": True, "localsgd": True}, "SGD"),
             ({"amp": True, "adaptive_localsgd": True}, "SGD"),
             ({"lars": True, "localsgd": True}, "SGD")]
    for switches, optimizer in pairs:
        names = {"data_parallel", *switches} - {"gradient_merge_configs"}
        assert set(plan(optimizer=optimizer, **switches).applied) == names


def test_gradient_merge_refuses_a_backward_outside_the_optimizer(monkeypatch):
    import torch
    from torch import nn

    from fleetx.fleet import Fleet
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PADDLE_TRAINER_ENDPOINTS"):
        monkeypatch.delenv(name, raising=False)
    s = DistributedStrategy()
    s.gradient_merge = True
    s.gradient_merge_configs = {"k_steps": 2}
    f = Fleet()
    f.init(is_collective=True, strategy=s)
    model = f.distributed_model(nn.Linear(3, 1))
    opt = f.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    model(torch.randn(4, 3)).sum().backward()
    opt.step()  # not a boundary: nothing to check yet
    model(torch.randn(4, 3)).sum().backward()
    with pytest.raises(RuntimeError,
                       match="gradient_merge: run the backward through the optimizer"):
        opt.step()
