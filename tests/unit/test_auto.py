"""strategy.auto: the pure parts (candidates, the choice rule, the planner deferring to auto) and
one-process searches on a real model.

The one-process search reads the candidates' memory figures from a first search, then sets a
budget (FLEETX_AUTO_MEMORY_MB) between the plain plan's peak and recompute's: the plain plan no
longer fits, recompute does and wins; training then equals a run with that plan set by hand
(the search runs on copies and restores the RNG, so dropout masks are unchanged).
"""
from __future__ import annotations

import io
import math

import pytest
import torch
from torch import nn

from fleetx.env import EnvError
from fleetx.fleet.fleet import Fleet
from fleetx.strategy.algorithms.auto import (BUDGET_VARIABLE, NOISE, Measurement, candidates,
                                             choose, repeated_blocks)
from fleetx.strategy.api import ModelInfo, PlanInput, StrategyError, WorldInfo
from fleetx.strategy.distributed_strategy import DistributedStrategy
from fleetx.strategy.planner import make_plan

MIB = 1024 * 1024
WIDTH, DEPTH, BATCH = 32, 6, 64


def _auto() -> DistributedStrategy:
    s = DistributedStrategy()
    s.auto = True
    return s


def _mlp() -> nn.Module:
    torch.manual_seed(3)
    blocks = [nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Dropout(0.2),
                            nn.Linear(4 * WIDTH, WIDTH)) for _ in range(DEPTH)]
    return nn.Sequential(nn.Sequential(*blocks), nn.Linear(WIDTH, 1))


def test_repeated_blocks_are_the_children_of_the_largest_container():
    info = ModelInfo.of(_mlp())
    assert repeated_blocks(info) == tuple(f"0.{i}" for i in range(DEPTH))
    assert repeated_blocks(ModelInfo.of(nn.Linear(2, 2))) == ()
    assert repeated_blocks(ModelInfo(module_names=("", "a", "a.0", "b"))) == ()


def test_candidates_search_the_unset_switches_only():
    model = ModelInfo.of(_mlp())
    one = WorldInfo()
    names = [c.name for c in candidates(_auto(), PlanInput(_auto(), one, model, planner=make_plan))]
    assert names == ["plain", "recompute", "amp", "amp + recompute"]
    fixed = _auto()
    fixed.amp = False  # set by the user: kept in every candidate
    found = candidates(fixed, PlanInput(fixed, one, model, planner=make_plan))
    assert [c.name for c in found] == ["plain", "recompute"]
    assert all(c.strategy.amp is False and c.strategy.auto is False for c in found)
    assert found[1].strategy.recompute_configs["checkpoints"] == [f"0.{i}" for i in range(DEPTH)]
    two = WorldInfo(world_size=2)
    names = [c.name for c in candidates(fixed, PlanInput(fixed, two, model, planner=make_plan))]
    assert names[0] == "data parallel" and "recompute" in names
    sharding = [n for n in names if n.startswith("sharding")]
    from fleetx.strategy.fields import TopLevelConfig
    from fleetx.strategy.algorithms.sharding import ShardingConfig
    offered = not TopLevelConfig.specs()["sharding"].no_effect and "stage" in ShardingConfig.specs()
    assert sharding == (["sharding stage 1", "sharding stage 2", "sharding stage 3"]
                        if offered else [])


def test_candidates_are_planned_by_the_planner_the_input_carries():
    # the planner hands itself to every can_apply; auto plans its candidates with it
    seen = []

    def planner(plan_input):
        seen.append(plan_input.strategy.recompute)
        return make_plan(plan_input)
    model = ModelInfo.of(_mlp())
    found = candidates(_auto(), PlanInput(_auto(), WorldInfo(), model, planner=planner))
    assert len(seen) == len(found) == 4 and sorted(seen) == [False, False, True, True]
    with pytest.raises(StrategyError, match="PlanInput.planner, which make_plan sets"):
        candidates(_auto(), PlanInput(_auto(), WorldInfo(), model))


def test_the_plan_defers_every_other_strategy_to_auto():
    plan = make_plan(PlanInput(_auto(), WorldInfo(world_size=2), ModelInfo.of(_mlp())))
    assert plan.applied == ("auto",)
    dp = next(e for e in plan.entries if e.name == "data_parallel")
    assert not dp.applied and "deferred: auto chooses the plan" in dp.reason
    assert "measures 2" not in str(plan) and "'data parallel'" in str(plan)


def _m(seconds: float, mib: float) -> Measurement:
    return Measurement(seconds, int(mib * MIB), 0)


def test_choose_takes_the_fastest_plan_that_fits():
    names = ["plain", "amp", "recompute"]
    report = choose(names, [_m(1.0, 10), _m(0.5, 12), _m(2.0, 4)], 11 * MIB)
    assert report.winner_name == "plain"  # amp is faster but needs 12 MiB
    assert "need more memory" in report.reason
    report = choose(names, [_m(1.0, 10), _m(0.5, 12), _m(2.0, 4)], 20 * MIB)
    assert report.winner_name == "amp" and report.reason.startswith("fastest")
    text = str(report)
    assert "* amp" in text and "budget 20.0 MiB per rank" in text and "recompute" in text


def test_choose_prefers_the_simpler_plan_within_the_noise():
    names = ["plain", "amp"]
    close = 1.0 / (1 + NOISE / 2)
    report = choose(names, [_m(1.0, 1), _m(close, 1)], 10 * MIB, sizes=[0, 1])
    assert report.winner_name == "plain" and "simplest" in report.reason
    far = 1.0 / (1 + 2 * NOISE)
    assert choose(names, [_m(1.0, 1), _m(far, 1)], 10 * MIB, sizes=[0, 1]).winner_name == "amp"
    noisy = [Measurement(1.0, MIB, 0, spread=0.3), Measurement(far, MIB, 0, spread=0.1)]
    assert choose(names, noisy, 10 * MIB, sizes=[0, 1]).winner_name == "plain"


def test_choose_without_a_fitting_plan_takes_the_smallest_and_names_failures():
    report = choose(["a", "b"], [_m(1.0, 10), _m(2.0, 6)], 1 * MIB)
    assert report.winner_name == "b" and report.reason.startswith("no plan fits")
    oom = Measurement(math.inf, 0, 0, "out of memory: CUDA")
    with pytest.raises(StrategyError, match="a: out of memory: CUDA"):
        choose(["a"], [oom], MIB)
    with pytest.raises(ValueError, match="2 names and 1 measurements"):
        choose(["a", "b"], [_m(1, 1)], MIB)


def _train(strategy: DistributedStrategy, steps: int = 3) -> tuple[Fleet, dict, str]:
    f = Fleet()
    f.init(is_collective=True, strategy=strategy)
    model = f.distributed_model(_mlp())
    opt = f.distributed_optimizer(torch.optim.Adam(model.parameters(), lr=1e-2))
    g = torch.Generator().manual_seed(4)
    torch.manual_seed(5)
    for _ in range(steps):
        x, y = torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, 1, generator=g)
        opt.minimize(nn.functional.mse_loss(model(x), y))
    out = io.StringIO()
    f.explain(file=out)
    return f, {k: v.clone() for k, v in model.state_dict().items()}, out.getvalue()


def test_a_budget_the_plain_plan_exceeds_gets_recompute(one_process, monkeypatch):
    s = _auto()
    s.amp = False  # bfloat16 on CPU would change the numbers compared below
    monkeypatch.setenv(BUDGET_VARIABLE, "100000")
    f, _, text = _train(s, steps=1)
    report = f._search
    assert "budget 100000.0 MiB" in text  # the winner here depends on timings: not checked
    assert report.names == ("plain", "recompute")
    plain, recompute = report.measurements
    assert recompute.saved_bytes < plain.saved_bytes  # recompute keeps only block inputs
    assert recompute.state_bytes == plain.state_bytes > 0
    between = (plain.peak_bytes + recompute.peak_bytes) / 2 / MIB
    monkeypatch.setenv(BUDGET_VARIABLE, f"{between:.6f}")
    f, state, text = _train(s)
    assert f._search.winner_name == "recompute" and "the only plan that fits" in text
    assert f.applied_strategies() == ("recompute",)
    assert "recompute" in text and "fits" in text and "peak MiB" in text
    by_hand = DistributedStrategy()
    by_hand.recompute = True
    by_hand.recompute_configs = {"checkpoints": [f"0.{i}" for i in range(DEPTH)]}
    _, expected, _ = _train(by_hand)
    assert max((state[k] - v).abs().max().item() for k, v in expected.items()) <= 1e-6
    assert max((state[k] - v).abs().max().item() for k, v in _mlp().state_dict().items()) > 1e-3


def test_auto_needs_the_optimizer_before_the_first_forward(one_process):
    f = Fleet()
    f.init(is_collective=True, strategy=_auto())
    model = f.distributed_model(_mlp())
    with pytest.raises(StrategyError, match="call fleet.distributed_optimizer"):
        model(torch.randn(2, WIDTH))
    with torch.no_grad():  # a forward that trains nothing measures nothing
        f2 = Fleet()
        f2.init(is_collective=True, strategy=_auto())
        assert f2.distributed_model(_mlp())(torch.randn(2, WIDTH)).shape == (2, 1)


def test_a_budget_that_is_not_a_positive_number_is_an_error_naming_it(one_process, monkeypatch):
    monkeypatch.setenv(BUDGET_VARIABLE, "-5")
    f = Fleet()
    f.init(is_collective=True, strategy=_auto())
    model = f.distributed_model(_mlp())
    opt = f.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(EnvError, match=f"{BUDGET_VARIABLE}=-5 must be a positive"):
        opt.minimize(model(torch.randn(2, WIDTH)).sum())
