"""Tensor-parallel layers (Paddle's ``fleet.meta_parallel`` layers, Megatron-LM's splits).

Each layer keeps one rank's shard of an ``nn.Linear`` / ``nn.Embedding`` as its plain local
``weight`` / ``bias`` tensors, in PyTorch's layout, and communicates over the model-parallel
group with the autograd collectives of :mod:`fleetx.parallel.mp_ops`:

* :class:`ColumnParallelLinear`: rank ``r`` holds rows ``[r*out/mp, (r+1)*out/mp)`` of the full
  ``[out, in]`` weight and the same slice of the bias; its output is this rank's slice of the
  features, gathered to the full output when ``gather_output``;
* :class:`RowParallelLinear`: rank ``r`` holds the matching columns ``[r*in/mp, (r+1)*in/mp)``;
  the partial products are summed over the group, then the (full, replicated) bias is added
  once;
* :class:`VocabParallelEmbedding`: rank ``r`` holds rows ``[r*num/mp, (r+1)*num/mp)`` of the
  table; ids outside its rows look up zeros and the sum over the group is the full lookup.

Initialisation: each constructor draws the full, unsplit ``nn.Linear(in, out)`` /
``nn.Embedding(num, dim)`` initialisation from torch's default generator (the very calls the
unsplit layer makes, in the same order) and keeps its shard. So with the same
``torch.manual_seed(s)`` on every rank of the group, the shards put together are the weights
the unsplit layer gets after ``torch.manual_seed(s)``, and the generator ends in the same
state. The full tensor exists on each rank for the duration of the constructor. (Paddle draws
each shard from the per-rank model-parallel generator and starts biases at zero instead.)
``from_linear`` / ``from_embedding`` copy the shard of an existing unsplit layer and draw
nothing.

How a layer is split (the contract a consolidator such as ``fleet.export_model`` reads): every
layer has ``split_dims``, a dict from each parameter name to the dimension of the full tensor
it is split along (``None``: the parameter is whole on every rank), ``full_shapes`` (the same
names to the unsplit shapes), ``model_parallel_group`` (the process group), ``world_size`` and
``rank``. Rank ``r`` of the group holds chunk ``r`` of ``world_size`` equal, contiguous chunks
along that dimension, so the full tensor is the group's shards concatenated in group-rank order
(:meth:`~_ShardedModule.gathered` does it). The state dict keys are those of the unsplit
``nn.Linear`` / ``nn.Embedding`` (``weight``, ``bias``), so a model whose layers were replaced
keeps the plain model's keys:

======================== ============ ============
layer                    ``weight``   ``bias``
======================== ============ ============
ColumnParallelLinear     0            0
RowParallelLinear        1            ``None``
VocabParallelEmbedding   0            (none)
======================== ============ ============

:func:`sharded_parameters` lists the parameters that are shards (Paddle marks them
``is_distributed``, a name ``torch.Tensor`` already uses for a method); the row-parallel bias,
replicated on every rank, is not one of them.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn
from torch.nn import functional as F

import torch.distributed as dist

from fleetx.parallel.mp_ops import (ModelParallelGroup, copy_to_group, gather_from_group,
                                    reduce_from_group, resolve_group, shard_range,
                                    split_to_group)

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "sharded_parameters"]


def _parameter(t: torch.Tensor) -> nn.Parameter:
    # clone(): the shard must own its memory, not keep the full tensor alive through a view
    return nn.Parameter(t.detach().clone())


class _ShardedModule(nn.Module):
    """What the three layers share: the group, and which of their parameters are shards."""

    #: the names of the parameters that hold one rank's shard (the others are replicated)
    sharded_names: tuple = ()
    #: parameter name -> the dimension of the full tensor it is split along (None: whole)
    split_dims: dict = {}

    def _join(self, mp_group: Any) -> ModelParallelGroup:
        self._mp = resolve_group(mp_group, type(self).__name__)
        return self._mp

    @property
    def model_parallel_group(self) -> Any:
        """The ``torch.distributed`` process group the layer is split over."""
        return self._mp.group

    @property
    def world_size(self) -> int:
        """The model-parallel degree: how many shards the layer has."""
        return self._mp.world_size

    @property
    def rank(self) -> int:
        """This rank's index in the model-parallel group: which shard it holds."""
        return self._mp.rank

    @property
    def full_shapes(self) -> dict:
        """Parameter name -> the shape of the unsplit tensor (the plain layer's)."""
        shapes = {}
        for name, dim in self.split_dims.items():
            p = getattr(self, name)
            if p is not None:
                shape = list(p.shape)
                if dim is not None:
                    shape[dim] *= self.world_size
                shapes[name] = torch.Size(shape)
        return shapes

    def gathered(self, name: str) -> torch.Tensor:
        """The full, unsplit tensor of parameter ``name`` (detached): the group's shards
        concatenated along ``split_dims[name]``. A collective: every rank of the group calls it.

        Raises:
            KeyError: ``name`` is not one of ``split_dims``.
        """
        if name not in self.split_dims:
            raise KeyError(f"{type(self).__name__} has no parameter {name!r}; it has "
                           f"{sorted(self.split_dims)}")
        local, dim = getattr(self, name).detach(), self.split_dims[name]
        if dim is None or self.world_size == 1:
            return local.clone()
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local.contiguous(), group=self.model_parallel_group)
        return torch.cat(parts, dim=dim)


def sharded_parameters(model: nn.Module) -> list:
    """The parameters of ``model`` that hold one rank's shard of a tensor-parallel layer (their
    squared norms add up over the model-parallel group; every other parameter is replicated).
    """
    return [p for m in model.modules() if isinstance(m, _ShardedModule)
            for name in m.sharded_names if (p := getattr(m, name)) is not None]


class ColumnParallelLinear(_ShardedModule):
    """A linear layer whose output features are split over the model-parallel group.

    Args:
        in_features: size of each input sample.
        out_features: size of each (full) output sample; a multiple of the group's size.
        has_bias: learn an additive bias (sharded like the output features).
        gather_output: all-gather the output slices into the full ``[..., out_features]``
            output; ``False`` returns this rank's ``[..., out_features / mp]`` slice (to feed a
            ``RowParallelLinear(input_is_parallel=True)`` or a ``ParallelCrossEntropy``).
        mp_group: (fleetx extension) the ``torch.distributed`` process group to split over;
            default: the model-parallel group of the topology ``fleet.init`` built.
        device, dtype: as for ``nn.Linear``.

    Raises:
        ValueError: ``out_features`` is not divisible by the group's size.
        NoHybridGroupError: no ``mp_group`` and no hybrid topology (``fleet.init`` not called).

    Example:
        >>> torch.manual_seed(0)  # the same on every rank
        >>> fc = ColumnParallelLinear(16, 64, gather_output=False)
        >>> fc.weight.shape  # on 2 ranks
        torch.Size([32, 16])
    """

    sharded_names = ("weight", "bias")
    split_dims = {"weight": 0, "bias": 0}

    def __init__(self, in_features: int, out_features: int, has_bias: bool = True,
                 gather_output: bool = True, *, mp_group: Any = None,
                 device: Any = None, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        group = self._join(mp_group)
        self._start, self._end = shard_range(out_features, group, "out_features",
                                             type(self).__name__)
        self.in_features, self.out_features = in_features, out_features
        self.output_size_per_partition = self._end - self._start
        self.gather_output = gather_output
        self._take(nn.Linear(in_features, out_features, bias=has_bias, device=device,
                             dtype=dtype))

    @classmethod
    def from_linear(cls, linear: nn.Linear, gather_output: bool = True, *,
                    mp_group: Any = None) -> "ColumnParallelLinear":
        """This rank's column-parallel shard of an unsplit ``linear`` (copied; draws nothing).

        Raises:
            ValueError: ``linear.out_features`` is not divisible by the group's size.
        """
        layer = torch.nn.utils.skip_init(
            cls, linear.in_features, linear.out_features, linear.bias is not None,
            gather_output, mp_group=mp_group, device=linear.weight.device,
            dtype=linear.weight.dtype)
        layer._take(linear)
        return layer

    def _take(self, full: nn.Linear) -> None:
        rows = slice(self._start, self._end)
        self.weight = _parameter(full.weight[rows])
        if full.bias is None:
            self.register_parameter("bias", None)
        else:
            self.bias = _parameter(full.bias[rows])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(copy_to_group(x, self._mp), self.weight, self.bias)
        return gather_from_group(y, self._mp) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"(rows {self._start}:{self._end} here), bias={self.bias is not None}, "
                f"gather_output={self.gather_output}, mp={self.rank}/{self.world_size}")


class RowParallelLinear(_ShardedModule):
    """A linear layer whose input features are split over the model-parallel group.

    Args:
        in_features: size of each (full) input sample; a multiple of the group's size.
        out_features: size of each output sample.
        has_bias: learn an additive bias (full on every rank, added once after the sum).
        input_is_parallel: the input is already this rank's ``[..., in_features / mp]`` slice
            (e.g. a ``ColumnParallelLinear(gather_output=False)`` output); ``False`` takes the
            full input and keeps this rank's slice.
        mp_group: (fleetx extension) as for :class:`ColumnParallelLinear`.
        device, dtype: as for ``nn.Linear``.

    Raises:
        ValueError: ``in_features`` is not divisible by the group's size.
        NoHybridGroupError: no ``mp_group`` and no hybrid topology (``fleet.init`` not called).

    Example:
        >>> mlp = nn.Sequential(ColumnParallelLinear(16, 64, gather_output=False), nn.GELU(),
        ...                     RowParallelLinear(64, 16, input_is_parallel=True))
    """

    sharded_names = ("weight",)
    split_dims = {"weight": 1, "bias": None}

    def __init__(self, in_features: int, out_features: int, has_bias: bool = True,
                 input_is_parallel: bool = False, *, mp_group: Any = None,
                 device: Any = None, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        group = self._join(mp_group)
        self._start, self._end = shard_range(in_features, group, "in_features",
                                             type(self).__name__)
        self.in_features, self.out_features = in_features, out_features
        self.input_size_per_partition = self._end - self._start
        self.input_is_parallel = input_is_parallel
        self._take(nn.Linear(in_features, out_features, bias=has_bias, device=device,
                             dtype=dtype))

    @classmethod
    def from_linear(cls, linear: nn.Linear, input_is_parallel: bool = False, *,
                    mp_group: Any = None) -> "RowParallelLinear":
        """This rank's row-parallel shard of an unsplit ``linear`` (copied; draws nothing).

        Raises:
            ValueError: ``linear.in_features`` is not divisible by the group's size.
        """
        layer = torch.nn.utils.skip_init(
            cls, linear.in_features, linear.out_features, linear.bias is not None,
            input_is_parallel, mp_group=mp_group, device=linear.weight.device,
            dtype=linear.weight.dtype)
        layer._take(linear)
        return layer

    def _take(self, full: nn.Linear) -> None:
        self.weight = _parameter(full.weight[:, self._start:self._end])
        if full.bias is None:
            self.register_parameter("bias", None)
        else:
            self.bias = _parameter(full.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = split_to_group(x, self._mp)
        elif x.shape[-1] != self.input_size_per_partition:
            raise ValueError(f"RowParallelLinear(input_is_parallel=True) expects this rank's "
                             f"slice of {self.input_size_per_partition} features, got input "
                             f"of shape {tuple(x.shape)}")
        y = reduce_from_group(F.linear(x, self.weight), self._mp)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (columns {self._start}:{self._end} here), "
                f"out_features={self.out_features}, bias={self.bias is not None}, "
                f"input_is_parallel={self.input_is_parallel}, "
                f"mp={self.rank}/{self.world_size}")


class VocabParallelEmbedding(_ShardedModule):
    """An embedding table whose rows (the vocabulary) are split over the model-parallel group.

    Args:
        num_embeddings: size of the (full) vocabulary; a multiple of the group's size.
        embedding_dim: size of each embedding vector.
        mp_group: (fleetx extension) as for :class:`ColumnParallelLinear`.
        padding_idx: as for ``nn.Embedding``: that row (held by one rank) gets no gradient.
        device, dtype: as for ``nn.Embedding``.

    Raises:
        ValueError: ``num_embeddings`` is not divisible by the group's size.
        NoHybridGroupError: no ``mp_group`` and no hybrid topology (``fleet.init`` not called).
        IndexError: (forward) an id outside ``[0, num_embeddings)``.

    Example:
        >>> emb = VocabParallelEmbedding(50304, 768)
        >>> h = emb(token_ids)  # [batch, seq, 768], full on every rank
    """

    sharded_names = ("weight",)
    split_dims = {"weight": 0}

    def __init__(self, num_embeddings: int, embedding_dim: int, *, mp_group: Any = None,
                 padding_idx: Optional[int] = None, device: Any = None,
                 dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        group = self._join(mp_group)
        self._start, self._end = shard_range(num_embeddings, group, "num_embeddings",
                                             type(self).__name__)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.vocab_start_index = self._start
        if padding_idx is not None and padding_idx < 0:
            padding_idx += num_embeddings
        self.padding_idx = padding_idx
        self._take(nn.Embedding(num_embeddings, embedding_dim, padding_idx=padding_idx,
                                device=device, dtype=dtype))

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, *,
                       mp_group: Any = None) -> "VocabParallelEmbedding":
        """This rank's shard of an unsplit ``embedding`` (copied; draws nothing).

        Raises:
            ValueError: ``embedding.num_embeddings`` is not divisible by the group's size.
        """
        layer = torch.nn.utils.skip_init(
            cls, embedding.num_embeddings, embedding.embedding_dim, mp_group=mp_group,
            padding_idx=embedding.padding_idx, device=embedding.weight.device,
            dtype=embedding.weight.dtype)
        layer._take(embedding)
        return layer

    def _take(self, full: nn.Embedding) -> None:
        self.weight = _parameter(full.weight[self._start:self._end])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_embeddings):
            bad = ids[(ids < 0) | (ids >= self.num_embeddings)].flatten()[0].item()
            raise IndexError(f"VocabParallelEmbedding: id {bad} is outside the vocabulary "
                             f"[0, {self.num_embeddings})")
        outside = (ids < self._start) | (ids >= self._end)
        local = (ids - self._start).masked_fill(outside, 0)
        # Rows this rank does not hold look up zeros (and get no gradient); the sum over the
        # group then holds each id's row exactly once.
        pad = self.padding_idx
        pad = pad - self._start if pad is not None and self._start <= pad < self._end else None
        out = F.embedding(local, self.weight, padding_idx=pad)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_group(out, self._mp)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim} (rows {self._start}:{self._end} "
                f"here), mp={self.rank}/{self.world_size}")
