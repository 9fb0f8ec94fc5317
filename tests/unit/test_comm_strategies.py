"""Verdicts and installed stages of the communication strategies, and the build / execution
option mapping (no processes)."""
from __future__ import annotations

import doctest
import importlib

import pytest
import torch
from torch import nn

from fleetx.comm.hooks import Channels
from fleetx.strategy.algorithms.build_execution import (BuildStrategyOptions,
                                                        ExecutionStrategyOptions, changed_fields)
from fleetx.strategy.algorithms.comm_groups import CommGroupsStrategy
from fleetx.strategy.algorithms.data_parallel import DataParallelStrategy
from fleetx.strategy.algorithms.fp16_allreduce import Fp16AllReduceStrategy, Fp16Codec
from fleetx.strategy.algorithms.hierarchical_allreduce import (
    HierarchicalAllReduceStrategy, HierarchicalAllReduce, ranks_per_node)
from fleetx.strategy.algorithms.sync_batch_norm import SyncBatchNormStrategy
from fleetx.strategy.api import (Mode, OptimizerInfo, PlanInput, TrainingContext, WorldInfo)
from fleetx.strategy.distributed_strategy import DistributedStrategy
from fleetx.strategy.planner import make_plan

MODULES = ["dgc", "fp16_allreduce", "hierarchical_allreduce", "comm_groups",
           "build_execution", "sync_batch_norm"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(f"fleetx.strategy.algorithms.{name}")
    failures, _ = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert failures == 0


def strategy(**flags):
    s = DistributedStrategy()
    for key, value in flags.items():
        setattr(s, key, value)
    return s


def judge(cls, world, **flags):
    s = strategy(**flags)
    return cls(s).can_apply(PlanInput(s, world))


TWO = WorldInfo(world_size=2, local_world_size=2)


@pytest.mark.parametrize("cls,flags", [
    (Fp16AllReduceStrategy, {"fp16_allreduce": True}),
    (HierarchicalAllReduceStrategy, {"use_hierarchical_allreduce": True}),
    (CommGroupsStrategy, {"nccl_comm_num": 2}),
    (SyncBatchNormStrategy, {"sync_batch_norm": True}),
])
def test_one_process_is_a_warned_skip(cls, flags):
    v = judge(cls, WorldInfo(), **flags)
    assert (v.apply, v.warn, v.error) == (False, True, False)
    v = judge(cls, WorldInfo(world_size=2, mode=Mode.PS), **flags)
    assert v.error and "collective mode only" in v.reason


def test_fp16_allreduce_installs_the_cast():
    assert judge(Fp16AllReduceStrategy, TWO, fp16_allreduce=True).apply
    ctx = TrainingContext(TWO, strategy(fp16_allreduce=True))
    Fp16AllReduceStrategy(ctx.strategy).apply(ctx)
    assert [type(stage) for _, stage in ctx.comm_hooks] == [Fp16Codec]


# -- hierarchical ----------------------------------------------------------------------------
def test_node_size_comes_from_inter_nranks_or_the_launcher():
    assert ranks_per_node(4, WorldInfo(local_world_size=8)) == 4
    assert ranks_per_node(1, WorldInfo(local_world_size=8)) == 8


def test_hierarchical_verdicts():
    def reason(world, inter):
        v = judge(HierarchicalAllReduceStrategy, world, use_hierarchical_allreduce=True,
                  hierarchical_allreduce_inter_nranks=inter)
        return v.apply, v.warn, v.error, v.reason
    four = WorldInfo(world_size=4, local_world_size=4)
    assert reason(four, 1) == (False, True, False, "one node of 4 ranks: a flat all-reduce is "
                                                   "already node-local")
    assert reason(four, 4) == reason(four, 1)
    assert reason(four, 3) == (False, False, True, "3 ranks per node "
                               "(hierarchical_allreduce_inter_nranks) do not divide the 4 "
                               "processes")
    assert reason(WorldInfo(world_size=8, local_world_size=1), 1)[:2] == (False, True)
    assert reason(WorldInfo(world_size=16, local_world_size=8, nnodes=2), 1) == (
        True, False, False, "2 nodes of 8 ranks: reduce in node, all-reduce among 2 leaders, "
                            "broadcast in node")


def test_hierarchical_installs_a_topology():
    world = WorldInfo(world_size=4, local_world_size=2, nnodes=2)
    ctx = TrainingContext(world, strategy(use_hierarchical_allreduce=True))
    HierarchicalAllReduceStrategy(ctx.strategy).apply(ctx)
    (_, topo), = ctx.comm_hooks
    assert isinstance(topo, HierarchicalAllReduce) and topo.per_node == 2
    with pytest.raises(ValueError, match="per_node must be >= 1"):
        HierarchicalAllReduce(0)


# -- nccl_comm_num ---------------------------------------------------------------------------
def test_nccl_comm_num_is_on_above_one():
    assert not CommGroupsStrategy.enabled(strategy())
    assert CommGroupsStrategy.enabled(strategy(nccl_comm_num=2))
    ctx = TrainingContext(TWO, strategy(nccl_comm_num=3))
    CommGroupsStrategy(ctx.strategy).apply(ctx)
    assert ctx.comm_hooks == [(None, Channels(3))]


def test_all_communication_strategies_in_one_plan():
    s = strategy(fp16_allreduce=True, use_hierarchical_allreduce=True, nccl_comm_num=2,
                 hierarchical_allreduce_inter_nranks=2)
    plan = make_plan(PlanInput(s, WorldInfo(world_size=4, local_world_size=4)))
    assert plan.applied == ("data_parallel", "fp16_allreduce", "use_hierarchical_allreduce",
                            "nccl_comm_num")


# -- sync batch norm -------------------------------------------------------------------------
def test_sync_batch_norm_converts_before_ddp_on_gpu():
    gpu = WorldInfo(world_size=2, device="cuda")
    v = judge(SyncBatchNormStrategy, gpu, sync_batch_norm=True)
    # its wrapper runs before DDP's
    assert v.apply and DataParallelStrategy in SyncBatchNormStrategy.runs_before
    ctx = TrainingContext(gpu, strategy(sync_batch_norm=True))
    SyncBatchNormStrategy(ctx.strategy).apply(ctx)
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2))
    weight = model[1].weight
    converted = ctx.model_wrappers[0](model)
    assert isinstance(converted[1], nn.SyncBatchNorm) and converted[1].weight is weight


# -- build / execution strategy --------------------------------------------------------------
def test_only_changed_fields_count():
    s = strategy()
    assert changed_fields(s.build_strategy) == []
    assert not BuildStrategyOptions.enabled(s) and not ExecutionStrategyOptions.enabled(s)
    s.build_strategy = {"enable_backward_optimizer_op_deps": False}
    assert changed_fields(s.build_strategy) == ["enable_backward_optimizer_op_deps"]
    assert BuildStrategyOptions.enabled(s)


def test_fuse_all_optimizer_ops_maps_to_foreach():
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = strategy(build_strategy={"fuse_all_optimizer_ops": True, "fuse_bn_act_ops": True})
    v = BuildStrategyOptions(s).can_apply(PlanInput(s, WorldInfo(),
                                                    optimizer=OptimizerInfo.of(opt)))
    assert v.apply and v.reason == ("fuse_all_optimizer_ops -> foreach=True on SGD; no effect "
                                    "in PyTorch: fuse_bn_act_ops (kernel fusion: use "
                                    "torch.compile)")
    ctx = TrainingContext(WorldInfo(), s, opt, model)
    BuildStrategyOptions(s).apply(ctx)
    assert all(g["foreach"] is True for g in opt.param_groups)


def test_fuse_all_optimizer_ops_without_foreach_is_a_no_op():
    s = strategy(build_strategy={"fuse_all_optimizer_ops": True})
    v = BuildStrategyOptions(s).can_apply(
        PlanInput(s, WorldInfo(), optimizer=OptimizerInfo("Mine", (("lr", 0.1),))))
    assert not v.apply and v.reason == ("accepted; no effect in PyTorch: fuse_all_optimizer_ops "
                                        "(nothing to act on with this optimizer)")


def test_sequential_execution_is_already_so():
    s = strategy(build_strategy={"enable_sequential_execution": True})
    v = BuildStrategyOptions(s).can_apply(PlanInput(s, WorldInfo()))
    assert not v.apply and ("enable_sequential_execution (eager PyTorch already runs operations "
                            "in program order)") in v.reason


def test_num_threads_sets_torch_threads():
    before = torch.get_num_threads()
    try:
        s = strategy(execution_strategy={"num_threads": 3, "use_thread_barrier": True})
        v = ExecutionStrategyOptions(s).can_apply(PlanInput(s, WorldInfo()))
        assert v.reason == ("num_threads -> torch.set_num_threads(3); no effect in PyTorch: "
                            "use_thread_barrier (no static-graph executor)")
        ExecutionStrategyOptions(s).apply(TrainingContext(WorldInfo(), s))
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_no_op_fields_show_in_the_printed_plan():
    s = strategy(build_strategy={"enable_inplace": True},
                 execution_strategy={"num_iteration_per_drop_scope": 1})
    text = str(make_plan(PlanInput(s, WorldInfo())))
    assert "build_strategy" in text and "no effect in PyTorch: enable_inplace" in text
    assert "no effect in PyTorch: num_iteration_per_drop_scope" in text
