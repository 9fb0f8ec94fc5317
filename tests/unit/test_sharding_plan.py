"""The plan says truthfully what sharding does: the stage, the degree and the engine; stages 2
and 3 take the model from DistributedDataParallel; conflicts and one-process runs."""
from __future__ import annotations

import pytest

from fleetx.strategy.api import PlanInput, StrategyError, WorldInfo
from fleetx.strategy.distributed_strategy import DistributedStrategy
from fleetx.strategy.planner import make_plan


def _plan(world_size: int, **configs):
    s = DistributedStrategy()
    s.sharding = True
    s.sharding_configs = configs
    return make_plan(PlanInput(s, WorldInfo(world_size=world_size)))


def _reason(plan, name: str) -> str:
    return next(e.reason for e in plan.entries if e.name == name)


def test_stage1_keeps_data_parallel_and_names_zero():
    plan = _plan(2, stage=1)
    assert plan.applied[:1] == ("data_parallel",) and "sharding" in plan.applied
    assert _reason(plan, "sharding") == (
        "stage 1: optimizer state sharded over 2 ranks (one sharding group of 2); engine: "
        "ZeroRedundancyOptimizer, model under DistributedDataParallel")


@pytest.mark.parametrize("stage", [2, 3])
def test_stages_2_and_3_use_fsdp2_instead_of_data_parallel(stage):
    plan = _plan(4, stage=stage, sharding_degree=2, hybrid_dp=True)
    assert "data_parallel" not in plan.applied and "sharding" in plan.applied
    assert _reason(plan, "data_parallel") == (
        f"sharding stage {stage} synchronises gradients itself (FSDP2 reduce-scatter): no "
        f"DistributedDataParallel")
    what = "optimizer state and gradients" if stage == 2 else (
        "optimizer state, gradients and parameters")
    assert _reason(plan, "sharding") == (
        f"stage {stage}: {what} sharded over 2 ranks (2 sharding groups of 2, replicated over "
        f"data-parallel groups of 2); engine: FSDP2 fully_shard(reshard_after_forward="
        f"{stage == 3}), no DistributedDataParallel; units: chosen when the model is given to "
        f"fleet.distributed_model")


def test_one_process_has_nothing_to_shard():
    plan = _plan(1, stage=3)
    assert plan.applied == ()
    entry = next(e for e in plan.entries if e.name == "sharding")
    assert entry.warn and entry.reason == ("sharding degree 1 on 1 process(es): nothing to "
                                           "shard (stage 3 asked)")


def test_sharding_and_dgc_conflict():
    s = DistributedStrategy()
    s.sharding, s.dgc = True, True
    with pytest.raises(StrategyError, match="sharding: cannot be combined with dgc"):
        make_plan(PlanInput(s, WorldInfo(world_size=2)))
