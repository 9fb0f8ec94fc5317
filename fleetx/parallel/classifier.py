"""A classification head whose classes are split over the model-parallel group (Paddle's PLSC).

Face recognition and other huge-label problems have millions of classes: the ``[C, D]`` head
weight, its gradient and its optimizer state outgrow one device long before the backbone does.
:class:`ShardedClassifier` keeps rows ``[r*C/mp, (r+1)*C/mp)`` of the weight on rank ``r`` of
the model-parallel group and computes the loss from this rank's ``[N, C/mp]`` logits with
:func:`~fleetx.parallel.cross_entropy.parallel_cross_entropy`: three numbers per sample cross
the group, whatever ``C`` is. The full ``[N, C]`` logits never exist anywhere.

Margins (PLSC's ``MarginLoss``, i.e. Paddle's ``margin_cross_entropy`` with ``m1 = 1``): for
``"arcface"`` and ``"cosface"`` the features and the weight rows are L2-normalised, so a logit
is ``s * cos(theta)``; the target class's cosine becomes ``cos(theta + m)`` (ArcFace, Deng et
al. 2019) or ``cos(theta) - m`` (CosFace, Wang et al. 2018) before the softmax. Only the rank
that owns a sample's class changes that logit; the others have nothing to change.
``"softmax"`` is the plain linear head (no normalisation, no margin).
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from fleetx.parallel.cross_entropy import parallel_cross_entropy
from fleetx.parallel.mp_ops import (ModelParallelGroup, copy_to_group, resolve_group,
                                    shard_range)

__all__ = ["ShardedClassifier", "MARGINS", "DEFAULT_MARGIN_M", "DEFAULT_SCALE"]

MARGINS = ("softmax", "arcface", "cosface")
# PLSC's defaults (plsc/loss/marginloss.py, the MarginLoss docstring and its configs):
# ArcFace m2 = 0.5, CosFace m3 = 0.4, s = 64 for both.
DEFAULT_MARGIN_M = {"softmax": 0.0, "arcface": 0.5, "cosface": 0.4}
DEFAULT_SCALE = {"softmax": 1.0, "arcface": 64.0, "cosface": 64.0}
# Rows drawn per generator call at initialisation: bounds the memory a rank needs beyond its
# shard, and fixes the draw sequence so every mp degree gets the same full weight.
_INIT_CHUNK_ROWS = 4096


def _check_config(margin: str, in_features: int, num_classes: int, scale: Optional[float],
                  margin_m: Optional[float]) -> tuple[float, float]:
    """The effective ``(scale, margin_m)``; raises on a bad name or value."""
    who = "ShardedClassifier"
    if margin not in MARGINS:
        raise ValueError(f"{who}: margin={margin!r} is not one of "
                         f"{', '.join(repr(m) for m in MARGINS)}")
    for name, value in (("in_features", in_features), ("num_classes", num_classes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{who}: {name}={value!r} must be a positive int")
    if margin == "softmax" and margin_m not in (None, 0, 0.0):
        raise ValueError(f"{who}: margin_m={margin_m!r} has no meaning for margin='softmax' "
                         "(choose margin='arcface' or 'cosface', or leave margin_m unset)")
    scale = DEFAULT_SCALE[margin] if scale is None else float(scale)
    margin_m = DEFAULT_MARGIN_M[margin] if margin_m is None else float(margin_m)
    if not scale > 0:
        raise ValueError(f"{who}: scale={scale!r} must be > 0")
    if not 0 <= margin_m < math.pi:
        raise ValueError(f"{who}: margin_m={margin_m!r} must be in [0, pi)")
    return scale, margin_m


def _draw_shard(rows: tuple[int, int], in_features: int, num_classes: int,
                dtype: Optional[torch.dtype]) -> torch.Tensor:
    """Rows ``[start, end)`` of a ``normal(0, sqrt(2 / (in + C)))`` weight (PLSC's Xavier
    normal), drawn chunk by chunk from a generator seeded by one draw from torch's default
    generator: every rank keeps only its rows, and every mp degree gets the same full weight."""
    seed = int(torch.randint(0, 2 ** 62, (1,)).item())
    generator = torch.Generator().manual_seed(seed)
    std = math.sqrt(2.0 / (in_features + num_classes))
    start, end = rows
    shard = torch.empty(end - start, in_features, dtype=dtype)
    for first in range(0, end, _INIT_CHUNK_ROWS):
        last = min(first + _INIT_CHUNK_ROWS, num_classes)
        chunk = torch.randn(last - first, in_features, generator=generator) * std
        lo, hi = max(first, start), min(last, end)
        if lo < hi:
            shard[lo - start:hi - start] = chunk[lo - first:hi - first]
    return shard


def _arcface(cos: torch.Tensor, m: float) -> torch.Tensor:
    """``cos(theta + m)`` as ``cos*cos(m) - sin*sin(m)``: no ``acos`` (whose derivative is
    infinite at +-1). ``1 - cos^2`` is clamped at the dtype's eps before the square root, so
    ``sin`` and its gradient stay finite when a feature lies on its class centre. As in PLSC,
    no "easy margin" and no threshold: the formula holds for every angle."""
    sin = (1.0 - cos * cos).clamp_min(torch.finfo(cos.dtype).eps).sqrt()
    return cos * math.cos(m) - sin * math.sin(m)


class ShardedClassifier(nn.Module):
    """A class-sharded classification head with a softmax, ArcFace or CosFace loss (PLSC).

    ``forward(features, labels)`` returns the per-sample loss ``[N]`` (take ``.mean()``), the
    same on every rank of the group; ``predict(features)`` returns the global class ids of the
    largest logits ``[N]``, found without gathering the logits. ``features`` ``[N, in_features]``
    are the same on every rank of the group (as every model-parallel input is); their gradient
    is summed over the group, so the backbone below receives the whole gradient.

    Args:
        in_features: size of each feature vector.
        num_classes: number of classes; a multiple of the model-parallel degree.
        margin: ``"softmax"`` (plain linear logits), ``"arcface"`` (target logit
            ``s*cos(theta + m)``) or ``"cosface"`` (``s*(cos(theta) - m)``).
        scale: ``s``; default 64.0 for the margins (PLSC's), 1.0 for softmax.
        margin_m: ``m``; default 0.5 for arcface and 0.4 for cosface (PLSC's
            ``MarginLoss``/``margin_cross_entropy`` defaults); must stay unset for softmax.
        mp_group: (fleetx extension) the ``torch.distributed`` process group the classes are
            split over; default: the model-parallel group of the topology ``fleet.init`` built.
        dtype: the weight's dtype (default: torch's default dtype).

    Raises:
        ValueError: an unknown ``margin`` (the valid names are listed), ``num_classes`` not
            divisible by the group's size, a non-positive size or scale, ``margin_m`` outside
            ``[0, pi)`` or given for softmax.
        NoHybridGroupError: no ``mp_group`` and no hybrid topology (``fleet.init`` not called).

    Example:
        >>> torch.manual_seed(0)  # the same on every rank
        >>> head = ShardedClassifier(128, 1_000_000, margin="arcface")
        >>> loss = head(backbone(images), labels).mean()
        >>> accuracy = (head.predict(backbone(images)) == labels).float().mean()
    """

    def __init__(self, in_features: int, num_classes: int, margin: str = "softmax",
                 scale: Optional[float] = None, margin_m: Optional[float] = None, *,
                 mp_group: Any = None, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        rows = self._setup(in_features, num_classes, margin, scale, margin_m, mp_group)
        self.weight = nn.Parameter(_draw_shard(rows, in_features, num_classes, dtype))

    def _setup(self, in_features: int, num_classes: int, margin: str, scale: Optional[float],
               margin_m: Optional[float], mp_group: Any) -> tuple[int, int]:
        """Checks the arguments and joins the group; returns this rank's class rows."""
        self.scale, self.margin_m = _check_config(margin, in_features, num_classes, scale,
                                                  margin_m)
        self.margin, self.in_features, self.num_classes = margin, in_features, num_classes
        self._mp: ModelParallelGroup = resolve_group(mp_group, type(self).__name__)
        self._start, self._end = shard_range(num_classes, self._mp, "num_classes",
                                             type(self).__name__)
        return self._start, self._end

    @classmethod
    def from_weight(cls, weight: torch.Tensor, margin: str = "softmax",
                    scale: Optional[float] = None, margin_m: Optional[float] = None, *,
                    mp_group: Any = None) -> "ShardedClassifier":
        """This rank's shard of a full ``[num_classes, in_features]`` weight (copied).

        Raises:
            ValueError: as the constructor, for ``weight``'s shape.
        """
        if weight.dim() != 2:
            raise ValueError(f"ShardedClassifier.from_weight: weight of shape "
                             f"{tuple(weight.shape)}; expected [num_classes, in_features]")
        head = cls.__new__(cls)
        nn.Module.__init__(head)  # draws nothing: the shard is copied from ``weight``
        start, end = head._setup(weight.shape[1], weight.shape[0], margin, scale, margin_m,
                                 mp_group)
        head.weight = nn.Parameter(weight.detach()[start:end].clone())
        return head

    @property
    def class_range(self) -> tuple[int, int]:
        """``[start, end)``: the global class ids whose weight rows this rank holds."""
        return self._start, self._end

    def local_logits(self, features: torch.Tensor) -> torch.Tensor:
        """This rank's ``[N, C/mp]`` logits without margin: ``x W^T`` for softmax, ``cos(theta)``
        of the normalised vectors (clamped to [-1, 1]) for the margins, times ``scale``."""
        self._check_features(features)
        x = copy_to_group(features, self._mp)
        if self.margin == "softmax":
            return F.linear(x, self.weight) * self.scale
        cos = F.linear(F.normalize(x, dim=-1), F.normalize(self.weight, dim=-1))
        return cos.clamp(-1.0, 1.0) * self.scale

    def forward(self, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.local_logits(features)
        if self.margin != "softmax":
            logits = self._with_margin(logits, labels)
        return parallel_cross_entropy(logits, labels, self._mp)

    def _with_margin(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The logits with the target class's cosine replaced, on the rank that owns it."""
        label = labels.reshape(-1).long()
        here = (label >= self._start) & (label < self._end)
        index = (label - self._start).masked_fill(~here, 0).unsqueeze(-1)
        picked = logits.gather(-1, index).squeeze(-1)
        cos = picked / self.scale
        if self.margin == "arcface":
            target = _arcface(cos, self.margin_m)
        else:
            target = cos - self.margin_m
        # scatter (not add): the owner's target logit is exactly s*margin(cos), bit for bit
        new = torch.where(here, target * self.scale, picked)
        return logits.scatter(-1, index, new.unsqueeze(-1))

    @torch.no_grad()
    def predict(self, features: torch.Tensor) -> torch.Tensor:
        """The global class id of each sample's largest logit ``[N]`` (int64), the same on every
        rank; ties go to the smallest id, as ``torch.argmax``. Each rank finds its local
        maximum; one all-reduce (max) of the values and one (min) of the ids of the ranks that
        hold the maximum replace gathering the ``[N, C]`` logits."""
        values, index = self.local_logits(features).max(dim=-1)
        best, ids = values.clone(), index + self._start
        if self._mp.world_size > 1:
            dist.all_reduce(best, op=dist.ReduceOp.MAX, group=self._mp.group)
            ids = torch.where(values == best, ids, torch.full_like(ids, self.num_classes))
            dist.all_reduce(ids, op=dist.ReduceOp.MIN, group=self._mp.group)
        return ids

    def _check_features(self, features: torch.Tensor) -> None:
        if features.dim() != 2 or features.shape[1] != self.in_features:
            raise ValueError(f"ShardedClassifier: features of shape {tuple(features.shape)}; "
                             f"expected [N, {self.in_features}]")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, num_classes={self.num_classes}, "
                f"margin={self.margin!r}, scale={self.scale}, margin_m={self.margin_m}, "
                f"classes=[{self._start}, {self._end}) on mp={self._mp.rank}/"
                f"{self._mp.world_size}")
