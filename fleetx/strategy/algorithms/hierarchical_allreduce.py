"""Hierarchical all-reduce (``strategy.use_hierarchical_allreduce``).

Ranks are grouped into nodes of ``hierarchical_allreduce_inter_nranks`` consecutive ranks (the
launcher numbers ranks node by node). A gradient sum then travels in three steps:

1. reduce inside each node to its first rank, the *leader* (fast local links);
2. all-reduce among the leaders, one per node (the only traffic between nodes);
3. broadcast inside each node from the leader.

Only ``1 / ranks_per_node`` of the ranks use the slow inter-node network, each with the whole
bucket, instead of every rank joining one ring that crosses nodes. The sum is the same as a flat
all-reduce up to the order of float additions.

With ``hierarchical_allreduce_inter_nranks`` left at 1 the node size is the launcher's
processes per node. With a single node there is nothing to gain and the strategy is skipped.

The three steps of one bucket depend on each other, so each channel runs them on its own worker
thread, bucket after bucket in DDP's launch order (the same order on every rank, which keeps the
collectives matched); backward goes on meanwhile, and with ``nccl_comm_num`` > 1 the channels'
threads run side by side.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
from torch.futures import Future

from fleetx.comm.hooks import AllReducePath, Traffic
from fleetx.strategy.algorithms.data_parallel import DataParallelStrategy, refuse_split_model
from fleetx.strategy.api import (Mode, PlanInput, Strategy, TrainingContext, Verdict,
                                 WorldInfo, register)

__all__ = ["HierarchicalAllReduceStrategy", "HierarchicalAllReduce", "ranks_per_node"]


def ranks_per_node(inter_nranks: int, world: WorldInfo) -> int:
    """Node size: ``hierarchical_allreduce_inter_nranks``, or the launcher's when it is 1."""
    return inter_nranks if inter_nranks > 1 else world.local_world_size


class _Channel:
    """The groups of one channel as seen from this rank, and the thread that drives them."""

    def __init__(self, intra: Any, leaders: Any, leader: int, is_leader: bool) -> None:
        self.intra, self.leaders, self.leader, self.is_leader = intra, leaders, leader, is_leader
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fleetx-hier")


class HierarchicalAllReduce(AllReducePath):
    """Reduce in the node, all-reduce among node leaders, broadcast in the node.

    Args:
        per_node: ranks per node (consecutive ranks share a node).
    """

    def __init__(self, per_node: int) -> None:
        if per_node < 1:
            raise ValueError(f"per_node must be >= 1, got {per_node}")
        self.per_node = per_node
        self.channels: list[_Channel] = []

    def connect(self, group: Any, channels: int) -> None:
        ranks = dist.get_process_group_ranks(group)
        if len(ranks) % self.per_node:
            raise ValueError(f"{self.per_node} ranks per node do not divide the "
                             f"{len(ranks)} ranks")
        nodes = [ranks[i:i + self.per_node] for i in range(0, len(ranks), self.per_node)]
        me = dist.get_rank()
        mine = next(n for n in nodes if me in n)
        self.channels = []
        for _ in range(channels):
            # new_group is collective over the world: every rank creates every node's group.
            intra = {tuple(n): dist.new_group(n) for n in nodes}[tuple(mine)]
            leaders = dist.new_group([n[0] for n in nodes])
            self.channels.append(_Channel(intra, leaders, mine[0], me == mine[0]))

    def all_reduce(self, tensor: torch.Tensor, channel: int, traffic: Traffic) -> Future:
        fut: Future = Future()
        ch = self.channels[channel]
        ch.worker.submit(self._reduce, tensor, ch, channel, traffic, fut)
        return fut

    def _reduce(self, tensor: torch.Tensor, ch: _Channel, channel: int, traffic: Traffic,
                fut: Future) -> None:
        try:
            if tensor.is_cuda:  # this thread's device and stream, not device 0's
                torch.cuda.set_device(tensor.device)
            traffic.record("reduce", tensor, self.per_node, channel)
            dist.reduce(tensor, dst=ch.leader, group=ch.intra)
            if ch.is_leader:
                n = dist.get_world_size(ch.leaders)
                traffic.record("all_reduce", tensor, n, channel)
                dist.all_reduce(tensor, group=ch.leaders)
            traffic.record("broadcast", tensor, self.per_node, channel)
            dist.broadcast(tensor, src=ch.leader, group=ch.intra)
            if tensor.is_cuda:  # NCCL returns before the GPU is done; DDP reads on its stream
                torch.cuda.current_stream().synchronize()
        except Exception as exc:  # handed to DDP, which raises it in backward
            fut.set_exception(exc)
        else:
            fut.set_result(tensor)

    def describe(self) -> str:
        return f"hierarchical all-reduce ({self.per_node} ranks per node)"


@register
class HierarchicalAllReduceStrategy(Strategy):
    """AllReducePath gradient sums through node leaders.

    Example:
        >>> from fleetx.strategy.distributed_strategy import DistributedStrategy
        >>> s = DistributedStrategy(); s.use_hierarchical_allreduce = True
        >>> s.hierarchical_allreduce_inter_nranks = 2
        >>> world = WorldInfo(world_size=4, local_world_size=4)
        >>> HierarchicalAllReduceStrategy(s).can_apply(PlanInput(s, world)).reason
        '2 nodes of 2 ranks: reduce in node, all-reduce among 2 leaders, broadcast in node'
    """

    name = "use_hierarchical_allreduce"
    heal_fallback = ("its groups of nodes are built once, over every rank")
    requires = (DataParallelStrategy,)

    def can_apply(self, plan_input: PlanInput) -> Verdict:
        world, s = plan_input.world, plan_input.strategy
        if world.mode is not Mode.COLLECTIVE:
            return Verdict.fail("works in collective mode only (gradients all-reduced)")
        if world.world_size <= 1:
            return Verdict.skip("one process: no gradient is communicated", warn=True)
        split = refuse_split_model(plan_input, "it builds node and leader groups of "
                                   "hierarchical_allreduce_inter_nranks consecutive ranks of "
                                   "the world")
        if split is not None:
            return split
        per_node = ranks_per_node(s.hierarchical_allreduce_inter_nranks, world)
        if world.world_size % per_node:
            return Verdict.fail(f"{per_node} ranks per node (hierarchical_allreduce_inter_nranks)"
                                f" do not divide the {world.world_size} processes")
        nodes = world.world_size // per_node
        if nodes == 1:
            return Verdict.skip(f"one node of {per_node} ranks: a flat all-reduce is already "
                                f"node-local", warn=True)
        if per_node == 1:
            return Verdict.skip("one rank per node: the hierarchy would be the flat all-reduce",
                                warn=True)
        return Verdict.ok(f"{nodes} nodes of {per_node} ranks: reduce in node, all-reduce "
                          f"among {nodes} leaders, broadcast in node")

    def apply(self, ctx: TrainingContext) -> None:
        per_node = ranks_per_node(self.strategy.hierarchical_allreduce_inter_nranks, ctx.world)
        ctx.comm_hooks.append((None, HierarchicalAllReduce(per_node)))
