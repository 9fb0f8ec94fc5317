"""Gradient clipping by the global norm of a model split over the hybrid topology.

``torch.nn.utils.clip_grad_norm_`` sees one process's tensors. Under tensor, pipeline or
sharding parallelism each process holds a part of the model, so the norm of the whole model is
a sum over processes, taken with each piece of it counted exactly once:

* a tensor-parallel shard (:func:`~fleetx.parallel.layers.sharded_parameters`) on every rank of
  its model-parallel group (the shards are disjoint); any other parameter is the same on every
  model-parallel rank and counts on model-parallel rank 0 only;
* a pipeline stage's parameters on that stage; a weight tied across stages
  (``SharedLayerDesc``) on the first stage holding it only;
* a sharded parameter of sharding stages 2/3 (a ``DTensor``) by its local shard on every rank of
  its sharding group; a plain parameter under sharding on sharding rank 0 only;
* the data-parallel axis not at all: after the gradients are averaged every replica holds the
  same ones, and each replica computes the same norm.

The per-rank sums are all-reduced over the hybrid group's check group (every rank with this
rank's data-parallel index: one whole replica), then the gradients are scaled as torch does
(``max_norm / (norm + 1e-6)``, at most 1), so the result equals ``clip_grad_norm_`` on the unsplit
model.
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn

from fleetx.parallel.api import is_dtensor, local_part
from fleetx.parallel.hcg import HybridCommunicateGroup, get_hcg
from fleetx.parallel.layers import sharded_parameters
from fleetx.parallel.pipeline import PipelineLayer

__all__ = ["clip_grad_norm_", "counted_parameters"]


def counted_parameters(modules: Iterable[nn.Module], hcg: Optional[HybridCommunicateGroup]
                       ) -> tuple[set, set]:
    """Which parameters of ``modules`` are shards across ranks, and which are copies counted
    elsewhere.

    Returns:
        (ids of tensor-parallel shards, ids of tied copies held by a later pipeline stage).
    """
    shards, copies = set(), set()
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    for module in modules:
        shards.update(id(p) for p in sharded_parameters(module))
        for layer in module.modules():
            if isinstance(layer, PipelineLayer):
                for _group, first, tied, names in layer.shared_groups.values():
                    if first != rank:
                        copies.update(id(getattr(tied, n)) for n in names)
    return shards, copies


def _norm_type(norm_type: Any) -> float:
    value = float(norm_type)
    if not value > 0:  # nan too
        raise ValueError(f"norm_type={norm_type!r}: use a positive number or inf")
    return value


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0,
                    modules: Iterable[nn.Module] = (),
                    hcg: Optional[HybridCommunicateGroup] = None,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Clip the gradients of ``parameters`` by the global norm over every group (see the
    module), in place; return that norm.

    Args:
        parameters: this rank's parameters (those without a gradient are skipped).
        max_norm: the largest norm left unscaled.
        norm_type: the p of the p-norm; ``inf`` for the largest absolute value.
        modules: the models the parameters belong to, where tensor-parallel shards and tied
            pipeline weights are found.
        hcg: the hybrid group; by default the one ``fleet.init`` built (none: one process's
            norm, as torch computes it).
        error_if_nonfinite: raise when the norm is nan or inf.

    Returns:
        The total norm (a 0-d tensor in the gradients' dtype), the same on every rank.

    Raises:
        ValueError: ``norm_type`` is not positive.
        RuntimeError: ``error_if_nonfinite`` and the norm is not finite.

    Example:
        >>> norm = clip_grad_norm_(model.parameters(), 1.0, modules=[model])
    """
    p = _norm_type(norm_type)
    hcg = hcg if hcg is not None else get_hcg()
    params = list({id(t): t for t in parameters if t.grad is not None}.values())
    if not params:
        return torch.tensor(0.0)
    shards, copies = counted_parameters(modules, hcg)
    dtype, device = _local(params[0].grad).dtype, _local(params[0].grad).device
    total = torch.zeros((), dtype=torch.float64, device=device)
    for param in params:
        if not _counts_here(param, shards, copies, hcg):
            continue
        norm = torch.linalg.vector_norm(_local(param.grad).double(), p)
        total = torch.maximum(total, norm) if math.isinf(p) else total + norm ** p
    group = hcg.get_check_parallel_group() if hcg is not None else None
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(total, op=dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM,
                        group=group)
    norm = (total if math.isinf(p) else total ** (1.0 / p)).to(dtype)
    if error_if_nonfinite and not torch.isfinite(norm):
        raise RuntimeError(f"the total norm of order {p} of the gradients is {norm.item()}: "
                           f"not finite")
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    with torch.no_grad():
        for param in params:
            grad = param.grad
            if is_dtensor(grad):
                grad.to_local().mul_(coef.to(grad.device))
            else:
                grad.mul_(coef.to(grad.device))
    return norm


def _local(grad: torch.Tensor) -> torch.Tensor:
    return local_part(grad)


def _counts_here(param: torch.Tensor, shards: set, copies: set,
                 hcg: Optional[HybridCommunicateGroup]) -> bool:
    """Whether this rank adds ``param``'s gradient to the global norm (see the module)."""
    if id(param) in copies:
        return False
    if hcg is None:
        return True
    if id(param) not in shards and hcg.get_model_parallel_rank() != 0:
        return False
    if not is_dtensor(param.grad) and hcg.get_sharding_parallel_rank() != 0:
        return False
    return True
