"""Softmax cross entropy over logits whose classes are split over the model-parallel group.

Rank ``r`` holds the logits of classes ``[r*C/mp, (r+1)*C/mp)`` (what a
``ColumnParallelLinear(gather_output=False)`` produces). The loss of a sample is
``log(sum_c exp(z_c)) - z_label``; both terms are sums over classes, so each rank sums its own
classes and one all-reduce of two numbers per sample (plus one of the per-sample maximum,
subtracted first so that ``exp`` cannot overflow) completes them. The ``[N, C]`` logits are never
gathered: the traffic is ``3 * N`` numbers whatever ``C`` is.

Autograd does the backward through the collectives of :mod:`fleetx.parallel.mp_ops`: the sums
are all-reduced forward and pass the gradient through unchanged backward (every rank computes
the same loss from them), and the maximum is a constant shift that the softmax ignores.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fleetx.parallel.mp_ops import (ModelParallelGroup, max_over_group, reduce_from_group,
                                    resolve_group)

__all__ = ["ParallelCrossEntropy", "parallel_cross_entropy"]


def _check_labels(logits: torch.Tensor, label: torch.Tensor, classes: int) -> torch.Tensor:
    """``label`` as int64 of shape ``logits.shape[:-1]``; raises on a bad shape, type or value."""
    batch = tuple(logits.shape[:-1])
    if tuple(label.shape) not in (batch, batch + (1,)):
        raise ValueError(f"ParallelCrossEntropy: labels of shape {tuple(label.shape)} do not "
                         f"match logits of shape {tuple(logits.shape)}; expected {batch} or "
                         f"{batch + (1,)}")
    if label.dtype == torch.bool or label.is_floating_point() or label.is_complex():
        raise TypeError(f"ParallelCrossEntropy: labels must be integer class ids, got "
                        f"{label.dtype}")
    label = label.reshape(batch).long()
    bad = (label < 0) | (label >= classes)
    if bool(bad.any()):
        raise ValueError(f"ParallelCrossEntropy: label {label[bad].flatten()[0].item()} is "
                         f"outside the classes [0, {classes}) (logits of {logits.shape[-1]} "
                         f"classes on each of the model-parallel ranks)")
    return label


def parallel_cross_entropy(logits: torch.Tensor, label: torch.Tensor,
                           group: ModelParallelGroup) -> torch.Tensor:
    """Per-sample softmax cross entropy of class-sharded ``logits``.

    Args:
        logits: ``[..., C / mp]``: this rank's slice of the classes, rank ``r`` holding classes
            ``[r*C/mp, (r+1)*C/mp)``.
        label: global class ids in ``[0, C)``, of shape ``[...]`` or ``[..., 1]``.
        group: the model-parallel group the classes are split over.

    Returns:
        The loss of each sample, of ``label``'s shape, in ``logits``' dtype; the same on every
        rank of the group.

    Raises:
        ValueError: ``label``'s shape does not match, or a label is outside ``[0, C)``.
        TypeError: ``label`` is not an integer tensor.
    """
    local = logits.shape[-1]
    label_ = _check_labels(logits, label, local * group.world_size)
    start = group.rank * local
    shifted = logits - max_over_group(logits.max(dim=-1, keepdim=True).values, group)
    here = (label_ >= start) & (label_ < start + local)
    index = (label_ - start).masked_fill(~here, 0).unsqueeze(-1)
    picked = shifted.gather(-1, index).squeeze(-1).masked_fill(~here, 0.0)
    # One all-reduce for both sums: [2, ...] = (sum of exp over my classes, my label's logit)
    sums = reduce_from_group(torch.stack([shifted.exp().sum(dim=-1), picked]), group)
    return (sums[0].log() - sums[1]).reshape(label.shape)


class ParallelCrossEntropy(nn.Module):
    """Paddle's ``ParallelCrossEntropy``: per-sample loss over class-sharded logits.

    ``forward(logits, label)``: see :func:`parallel_cross_entropy` (no reduction: take
    ``.mean()`` for the usual loss).

    Args:
        mp_group: (fleetx extension) the ``torch.distributed`` process group the classes are
            split over; default: the model-parallel group of the topology ``fleet.init`` built.

    Raises:
        NoHybridGroupError: no ``mp_group`` and no hybrid topology (``fleet.init`` not called).

    Example:
        >>> head = ColumnParallelLinear(768, 50304, has_bias=False, gather_output=False)
        >>> loss = ParallelCrossEntropy()(head(h), labels).mean()
    """

    def __init__(self, *, mp_group: Any = None) -> None:
        super().__init__()
        self._mp = resolve_group(mp_group, type(self).__name__)

    def forward(self, logits: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        return parallel_cross_entropy(logits, label, self._mp)

    def extra_repr(self) -> str:
        return f"mp={self._mp.rank}/{self._mp.world_size}"
