"""Strategies that communicate over the whole world, or build process groups of their own, are
not aware of the hybrid topology: with tensor or pipeline degrees above 1 the planner refuses
them, naming the strategy and the degrees (the world's ranks hold different shards or stages,
only the data-parallel group holds replicas)."""
from __future__ import annotations

import pytest

from fleetx.strategy.api import OptimizerInfo, PlanInput, StrategyError, WorldInfo
from fleetx.strategy.distributed_strategy import DistributedStrategy
from fleetx.strategy.planner import make_plan

MOMENTUM = OptimizerInfo("SGD", (("lr", 0.1), ("momentum", 0.9)))

# (switch, value, the strategy's name in the plan, how it communicates)
WORLD_WIDE = [
    ("localsgd", True, "localsgd", "averages the parameters over every process of the world"),
    ("adaptive_localsgd", True, "adaptive_localsgd",
     "averages the parameters over every process of the world"),
    ("dgc", True, "dgc", "average over every process of the world"),
    ("use_hierarchical_allreduce", True, "use_hierarchical_allreduce",
     "builds node and leader groups"),
    ("nccl_comm_num", 2, "nccl_comm_num", "builds 1 more process group(s)"),
]


def _strategy(switch: str, value, degrees: dict) -> DistributedStrategy:
    s = DistributedStrategy()
    setattr(s, switch, value)
    if degrees:
        s.hybrid_configs = degrees
    return s


def _plan(s: DistributedStrategy, world_size: int):
    world = WorldInfo(world_size=world_size, local_world_size=2,
                      nnodes=max(world_size // 2, 1))
    return make_plan(PlanInput(s, world, optimizer=MOMENTUM))


@pytest.mark.parametrize("switch, value, name, how", WORLD_WIDE,
                         ids=[w[0] for w in WORLD_WIDE])
@pytest.mark.parametrize("degrees, world_size, text", [
    ({"mp_degree": 2}, 2, "mp_degree=2, pp_degree=1 (dp_degree=1)"),
    ({"pp_degree": 2}, 2, "mp_degree=1, pp_degree=2 (dp_degree=1)"),
    ({"mp_degree": 2, "dp_degree": 2}, 4, "mp_degree=2, pp_degree=1 (dp_degree=2)"),
], ids=["mp2", "pp2", "dp2xmp2"])
def test_refused_when_the_model_is_split(switch, value, name, how, degrees, world_size, text):
    s = _strategy(switch, value, degrees)
    with pytest.raises(StrategyError) as err:
        _plan(s, world_size)
    message = str(err.value)
    assert f"{name}: {text}: it" in message and how in message
    assert "turn it off, or set hybrid_configs mp_degree and pp_degree to 1" in message


@pytest.mark.parametrize("switch, value, name, how", WORLD_WIDE,
                         ids=[w[0] for w in WORLD_WIDE])
def test_the_same_strategy_plans_without_split_degrees(switch, value, name, how):
    """The control: on 4 processes of 2 nodes with no tensor or pipeline degree, it applies."""
    assert name in _plan(_strategy(switch, value, {}), 4).applied
