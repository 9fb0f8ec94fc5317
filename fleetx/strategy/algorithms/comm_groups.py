"""Several communication groups for gradients (``strategy.nccl_comm_num`` > 1).

Paddle opens ``nccl_comm_num`` NCCL communicators (each with its own stream) and spreads the
fused gradient all-reduces over them, so several are in flight at once: on multi-node jobs one
ring rarely fills the network. Here each *channel* is a process group of its own (the first is
the data-parallel group); DDP's gradient buckets go to them round-robin by bucket index, each as
an asynchronous collective, and DDP waits for all of them at the end of backward. With a
hierarchical topology every channel gets its own node and leader groups.

Sums are exactly those of one group: the same tensors are reduced by the same algorithm, only on
different groups.
"""
from __future__ import annotations

from typing import Any

from fleetx.comm.hooks import Channels
from fleetx.strategy.algorithms.data_parallel import DataParallelStrategy, refuse_split_model
from fleetx.strategy.algorithms.hierarchical_allreduce import HierarchicalAllReduceStrategy
from fleetx.strategy.api import Mode, PlanInput, Strategy, TrainingContext, Verdict, register

__all__ = ["CommGroupsStrategy"]


@register
class CommGroupsStrategy(Strategy):
    """Spread gradient buckets over ``nccl_comm_num`` process groups.

    Example:
        >>> from fleetx.strategy.api import WorldInfo
        >>> from fleetx.strategy.distributed_strategy import DistributedStrategy
        >>> s = DistributedStrategy(); s.nccl_comm_num = 2
        >>> CommGroupsStrategy.enabled(s)
        True
        >>> CommGroupsStrategy(s).can_apply(PlanInput(s, WorldInfo(world_size=2))).reason
        'gradient buckets round-robin over 2 process groups, in flight together'
    """

    name = "nccl_comm_num"
    heal_fallback = ("its extra communicators are built once, over every rank")
    requires = (DataParallelStrategy,)
    # Every channel gets its own copy of the topology's groups (node and leader groups).
    runs_after = (HierarchicalAllReduceStrategy,)

    @classmethod
    def enabled(cls, strategy: Any) -> bool:
        # 1, the default, is the plain single group
        return getattr(strategy, "nccl_comm_num", 1) > 1

    def can_apply(self, plan_input: PlanInput) -> Verdict:
        world, n = plan_input.world, plan_input.strategy.nccl_comm_num
        if world.mode is not Mode.COLLECTIVE:
            return Verdict.fail("works in collective mode only (gradients all-reduced)")
        if world.world_size <= 1:
            return Verdict.skip("one process: no gradient is communicated", warn=True)
        split = refuse_split_model(plan_input, f"it builds {n - 1} more process group(s) as "
                                   f"if the world were one data-parallel group")
        if split is not None:
            return split
        return Verdict.ok(f"gradient buckets round-robin over {n} process groups, "
                          f"in flight together")

    def apply(self, ctx: TrainingContext) -> None:
        ctx.comm_hooks.append((None, Channels(self.strategy.nccl_comm_num)))
