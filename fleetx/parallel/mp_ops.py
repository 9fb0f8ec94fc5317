"""The model-parallel collectives as autograd functions, and the group a layer talks to.

Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) needs four conjugate pairs of collectives
over the model-parallel group; each is the backward of its partner:

* :func:`copy_to_group`: identity forward, all-reduce (sum) backward: a replicated input
  entering a column-split matrix; each rank's input gradient is partial and the sum is whole;
* :func:`reduce_from_group`: all-reduce (sum) forward, identity backward: partial outputs of a
  row-split matrix become whole; everything after it is replicated, so every rank already
  holds the whole output gradient;
* :func:`gather_from_group`: all-gather along the last dimension forward, keep this rank's
  slice backward;
* :func:`split_to_group`: keep this rank's slice of the last dimension forward, all-gather
  backward.

All of them are no-ops on a group of one rank. They run on ``torch.distributed`` (gloo on
CPU, NCCL on GPUs); every rank of the group must call them in the same order, as with any
collective.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fleetx.parallel.api import NoHybridGroupError, ParallelError
from fleetx.parallel.hcg import get_hcg

__all__ = ["ModelParallelGroup", "resolve_group", "shard_range", "copy_to_group",
           "reduce_from_group", "gather_from_group", "split_to_group", "max_over_group"]


class ModelParallelGroup:
    """A model-parallel process group with this rank's position in it.

    Args:
        group: the ``torch.distributed`` process group; None only for a one-process job
            without ``torch.distributed`` (rank 0 of 1: every collective is a no-op).

    Raises:
        ParallelError: ``group`` is given but ``torch.distributed`` is not initialised.
    """

    def __init__(self, group: Any) -> None:
        initialised = dist.is_available() and dist.is_initialized()
        if group is not None and not initialised:
            raise ParallelError("a model-parallel process group needs torch.distributed "
                                "initialised: call fleet.init(is_collective=True, strategy=...) "
                                "or torch.distributed.init_process_group first")
        self.group = group
        self.rank = dist.get_rank(group) if initialised else 0
        self.world_size = dist.get_world_size(group) if initialised else 1

    def __deepcopy__(self, memo: dict) -> "ModelParallelGroup":
        # A process group is a handle to the job's communicator, not data: a deep copy of a
        # model (e.g. to measure a candidate plan) keeps talking to the same group.
        return self

    def __repr__(self) -> str:
        return f"ModelParallelGroup(rank={self.rank}, world_size={self.world_size})"


def resolve_group(mp_group: Any, who: str) -> ModelParallelGroup:
    """The group a tensor-parallel layer uses: ``mp_group`` when given, else the hybrid
    topology's model-parallel group (built by ``fleet.init``).

    Args:
        mp_group: a ``torch.distributed`` process group, or None.
        who: the layer's class name, for the error message.

    Raises:
        NoHybridGroupError: ``mp_group`` is None and ``fleet.init`` built no hybrid topology.
    """
    if mp_group is not None:
        return ModelParallelGroup(mp_group)
    hcg = get_hcg()
    if hcg is None:
        raise NoHybridGroupError(
            f"{who} has no model-parallel group: call fleet.init(is_collective=True, "
            "strategy=s) with s.hybrid_configs = {'mp_degree': N, ...} before building it, "
            "or pass mp_group=<a torch.distributed process group>")
    return ModelParallelGroup(hcg.get_model_parallel_group())


def _all_reduce(x: torch.Tensor, group: ModelParallelGroup) -> torch.Tensor:
    out = x.contiguous().clone()
    dist.all_reduce(out, group=group.group)
    return out


def _gather_last(x: torch.Tensor, group: ModelParallelGroup) -> torch.Tensor:
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format)
             for _ in range(group.world_size)]
    dist.all_gather(parts, x.contiguous(), group=group.group)
    return torch.cat(parts, dim=-1)


def _split_last(x: torch.Tensor, group: ModelParallelGroup) -> torch.Tensor:
    size = x.shape[-1]
    if size % group.world_size:
        raise ValueError(f"the last dimension ({size}) is not divisible by the model-parallel "
                         f"degree ({group.world_size})")
    # contiguous(): the slice is a view into the whole tensor; a later collective needs it dense
    return x.chunk(group.world_size, dim=-1)[group.rank].contiguous()


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ModelParallelGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _all_reduce(grad, ctx.group), None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ModelParallelGroup) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return grad, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ModelParallelGroup) -> torch.Tensor:
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _split_last(grad, ctx.group), None


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ModelParallelGroup) -> torch.Tensor:
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _gather_last(grad, ctx.group), None


def copy_to_group(x: torch.Tensor, group: ModelParallelGroup) -> torch.Tensor:
    """Identity forward; backward sums the gradient over the group."""
    return x if group.world_size == 1 else _Copy.apply(x, group)


def reduce_from_group(x: torch.Tensor, group: ModelParallelGroup) -> torch.Tensor:
    """Sum over the group forward; identity backward."""
    return x if group.world_size == 1 else _Reduce.apply(x, group)


def gather_from_group(x: torch.Tensor, group: ModelParallelGroup) -> torch.Tensor:
    """Concatenate the ranks' tensors along the last dimension (in group-rank order) forward;
    backward keeps this rank's slice."""
    return x if group.world_size == 1 else _Gather.apply(x, group)


def split_to_group(x: torch.Tensor, group: ModelParallelGroup) -> torch.Tensor:
    """Keep this rank's slice of the last dimension forward; backward all-gathers.

    Raises:
        ValueError: the last dimension is not divisible by the group's size.
    """
    return x if group.world_size == 1 else _Split.apply(x, group)


def max_over_group(x: torch.Tensor, group: ModelParallelGroup) -> torch.Tensor:
    """The elementwise maximum over the group, without gradient (a constant shift)."""
    out = x.detach().contiguous().clone()
    if group.world_size > 1:
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group.group)
    return out


def shard_range(total: int, group: ModelParallelGroup, what: str,
                who: str) -> tuple[int, int]:
    """``[start, end)`` of this rank's equal share of ``total`` rows.

    Raises:
        ValueError: ``total`` is not divisible by the group's size (naming both numbers).
    """
    if total % group.world_size:
        raise ValueError(f"{who}: {what}={total} is not divisible by the model-parallel degree "
                         f"{group.world_size}; choose a multiple of {group.world_size}")
    per = total // group.world_size
    return group.rank * per, (group.rank + 1) * per
