"""``SparseEmbedding`` and ``SparseEmbeddingBag``: embeddings whose rows live in a
parameter-server table.

Thin adapters. ``forward(ids)`` asks the backend for the rows of the unique ids, makes them one
leaf tensor, and builds the output from it (``index_select`` for an embedding, ``embedding_bag``
for a bag); autograd then sums the gradient of every occurrence of an id into that leaf's row,
which is exactly the de-duplicated gradient the servers want. After ``backward()``,
:meth:`SparseEmbedding.pop_gradients` hands over ``(ids, grads)`` per lookup. The modules hold no
``nn.Parameter``: their rows are not the local optimizer's business.

The backend (anything with ``lookup(table, ids) -> rows`` where rows has ``ids``, ``values``,
``inverse``) is bound by the training layer: the parameter-server client in distributed runs,
or a local table (:class:`fleetx.ps_torch.layout.LocalSparseBackend`) in one process. A backend that
also has ``defer(table, ids, create)`` batches lookups: the module registers its ids and returns
a :class:`~fleetx.nn.deferred.DeferredRows`, and the rows of every lookup registered before the
first use of any of them arrive in one request per server.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch
from torch import nn
from torch.autograd.function import once_differentiable
from torch.nn import functional as F

from fleetx.nn.deferred import DeferredRows
from fleetx.ps import kernels
from fleetx.ps.api import AccessorConfig, InitConfig, RuleConfig, ShowClickEntry

__all__ = ["SparseEmbedding", "SparseEmbeddingBag"]


class SparseEmbedding(nn.Module):
    """Embedding rows for any int64 id, created on first touch on the servers.

    Args:
        embedding_dim: row width.
        name: the table's name (default: the module's path in the model, set when the model is
            laid out for the parameter server).
        init: how a new row is initialised (default ``N(0, 1)``, as ``nn.Embedding``); the
            value depends only on ``(init.seed, id)``.
        rule: the server-side update rule; default: taken from the optimizer.
        num_embeddings: bound the ids to ``[0, num_embeddings)`` (set by :meth:`from_embedding`).
        padding_idx: rows of this id get no gradient (as in ``nn.Embedding``).
        entry: how ids get rows, Paddle's ``sparse_embedding(entry=...)``:
            :class:`~fleetx.ps.api.CountFilterEntry` (after ``n`` training lookups),
            :class:`~fleetx.ps.api.ProbabilityEntry` (with probability ``p`` per lookup), or
            :class:`~fleetx.ps.api.ShowClickEntry` (every id, with show/click statistics fed
            by ``forward(ids, show=..., click=...)``). Default: every id on first touch.
        accessor: when rows are decayed and deleted at ``fleet.shrink()``
            (:class:`~fleetx.ps.api.AccessorConfig`); default: never (no per-row statistics).

    Raises:
        fleetx.ps.PSConfigError: ``entry`` or ``accessor`` is not one of those types.

    Example:
        >>> emb = SparseEmbedding(16, name="user", entry=CountFilterEntry(3),
        ...                       accessor=AccessorConfig(delete_after_unseen_days=7))
        >>> emb.bind(backend)                       # doctest: +SKIP
        >>> out = emb(torch.tensor([[3, 2 ** 40]]))  # doctest: +SKIP
    """

    #: Marks the module as sparse for the planner (as ``nn.Embedding(sparse=True)``).
    sparse = True

    def __init__(self, embedding_dim: int, *, name: Optional[str] = None,
                 init: Optional[InitConfig] = None, rule: Optional[RuleConfig] = None,
                 num_embeddings: Optional[int] = None, padding_idx: Optional[int] = None,
                 entry: Any = None, accessor: Optional[AccessorConfig] = None) -> None:
        super().__init__()
        self.embedding_dim = embedding_dim
        self.table_name = name
        self.init = init or InitConfig("normal", mean=0.0, std=1.0)
        self.rule = rule
        self.num_embeddings = num_embeddings
        self.padding_idx = padding_idx
        self.entry, self.accessor = entry, accessor
        self.initial_weight: Optional[torch.Tensor] = None  # from_embedding: worker 0 assigns it
        self.param_group: Optional[int] = None  # from_embedding: the weight's optimizer group
        self._backend: Any = None
        self._pending: list[tuple[np.ndarray, torch.Tensor]] = []

    @classmethod
    def from_embedding(cls, emb: nn.Module, name: Optional[str] = None) -> "SparseEmbedding":
        """A bounded table that starts from ``emb``'s own weights (``nn.Embedding``).

        Raises:
            ValueError: ``emb`` uses max_norm or scale_grad_by_freq (no server equivalent).
        """
        if emb.max_norm is not None or emb.scale_grad_by_freq:
            raise ValueError(f"{type(emb).__name__} with max_norm or scale_grad_by_freq cannot "
                             f"move to the parameter server")
        out = cls(emb.embedding_dim, name=name, num_embeddings=emb.num_embeddings,
                  padding_idx=emb.padding_idx, **cls._options_of(emb))
        out.initial_weight = emb.weight.detach().cpu().clone()
        return out

    @staticmethod
    def _options_of(emb: nn.Module) -> dict:
        return {}

    def bind(self, backend: Any) -> None:
        """Serve lookups from ``backend`` (``lookup(table, ids)``)."""
        self._backend = backend

    def forward(self, ids: torch.Tensor, show: Optional[torch.Tensor] = None,
                click: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Rows of ``ids`` (any shape). ``show`` / ``click``: for a table with a
        :class:`~fleetx.ps.api.ShowClickEntry`, each occurrence's show and click (tensors that
        broadcast to ``ids``' shape, e.g. ``(batch, 1)``: one value per sample), required in
        training lookups and summed per id into the rows' statistics.

        Raises:
            ValueError: show/click missing in a training lookup of a show/click table, or given
                to another table.
        """
        counts = self._show_click(ids, show, click, lambda v: v.expand(ids.shape))
        return self._lookup(ids, tuple(ids.shape) + (self.embedding_dim,),
                            lambda rows, leaf: self._expand(rows, leaf, ids), counts)

    def _show_click(self, ids: torch.Tensor, show, click, spread) -> Optional[np.ndarray]:
        """``(len(ids.view(-1)), 2)`` float32 show and click per occurrence, or None."""
        wanted = isinstance(self.entry, ShowClickEntry)
        if show is None and click is None:
            if wanted and self.training and torch.is_grad_enabled():
                raise ValueError(f"table {self.table_name!r} keeps show/click statistics "
                                 f"(entry=ShowClickEntry): pass show= and click= to its training "
                                 f"lookups, e.g. emb(ids, show=torch.ones(batch, 1), "
                                 f"click=label.view(-1, 1))")
            return None
        if not wanted:
            raise ValueError(f"table {self.table_name!r} has no ShowClickEntry: show= and click= "
                             "are only taken by tables built with entry=ShowClickEntry(...)")
        if show is None or click is None:
            raise ValueError(f"table {self.table_name!r}: pass both show= and click=")
        pair = [spread(torch.as_tensor(v, dtype=torch.float32).detach().cpu()).reshape(-1)
                for v in (show, click)]
        return torch.stack(pair, 1).numpy()

    def _lookup(self, ids: torch.Tensor, out_shape: tuple, build: Any,
                counts: Optional[np.ndarray] = None) -> torch.Tensor:
        """Fetch the rows of ``ids`` and ``build(rows, leaf)`` the output, now or (with a
        batching backend) at its first use; ``counts``: show and click per occurrence."""
        if self._backend is None or self.table_name is None:
            raise RuntimeError(f"SparseEmbedding {self.table_name!r} is not bound to a table; lay "
                               "the model out with fleetx.ps_torch.layout.ModelLayout and bind a backend")
        if ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"{type(self).__name__} expects integer ids, got {ids.dtype}")
        flat = ids.detach().reshape(-1).cpu().numpy().astype(np.int64, copy=False)
        track = self.training and torch.is_grad_enabled()
        backend, table = self._backend, self.table_name

        def produce() -> torch.Tensor:
            rows = backend.lookup(table, flat, create=track)
            leaf = torch.from_numpy(np.ascontiguousarray(rows.values, np.float32))
            with torch.set_grad_enabled(track):
                if track:
                    leaf.requires_grad_(True)
                    per_id = None if counts is None else np.stack(
                        [np.bincount(rows.inverse, counts[:, c], len(rows.ids))
                         for c in (0, 1)], 1).astype(np.float32)
                    self._pending.append((rows.ids, leaf, per_id))
                return build(rows, leaf).to(ids.device)

        if hasattr(backend, "defer"):
            backend.defer(table, flat, create=track)
            return DeferredRows(out_shape, torch.float32, ids.device, produce)
        return produce()

    def _expand(self, rows: Any, leaf: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        inverse = np.asarray(rows.inverse, np.int64)
        return _Occurrences.apply(leaf, inverse).view(*ids.shape, self.embedding_dim)

    def pop_gradients(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """``(unique ids, their summed gradients)`` of every lookup since the last call; for a
        show/click table each row is followed by the id's show and click sums."""
        out = []
        for ids, leaf, counts in self._pending:
            if leaf.grad is None:
                continue
            grad = leaf.grad.numpy()
            if self.padding_idx is not None:
                grad = np.where((ids == self.padding_idx)[:, None], 0.0, grad).astype(np.float32)
            if counts is not None:
                grad = np.hstack([grad, counts]).astype(np.float32)
            out.append((ids, grad))
        self._pending.clear()
        return out

    def clear_gradients(self) -> None:
        """Forget the gradients of past lookups (``zero_grad``)."""
        self._pending.clear()

    def extra_repr(self) -> str:
        bound = f", num_embeddings={self.num_embeddings}" if self.num_embeddings else ""
        return f"{self.embedding_dim}, name={self.table_name!r}{bound}"


class _Occurrences(torch.autograd.Function):
    """``leaf[inverse]``: one row per occurrence. Its backward sums the gradient of every
    occurrence into its id's row in one pass (the C segment sum of :mod:`fleetx.ps.kernels`),
    where ``index_select``'s backward sorts the indices first."""

    @staticmethod
    def forward(ctx: Any, leaf: torch.Tensor, inverse: np.ndarray) -> torch.Tensor:
        ctx.inverse, ctx.rows = inverse, leaf.shape[0]
        return leaf.index_select(0, torch.from_numpy(inverse))

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        dim = grad.shape[-1]
        if grad.dtype == torch.float32 and grad.device.type == "cpu":
            summed = kernels.segment_sum(ctx.inverse, grad.contiguous().view(-1, dim).numpy(),
                                         ctx.rows)
            return torch.from_numpy(summed), None
        out = torch.zeros(ctx.rows, dim, dtype=grad.dtype, device=grad.device)
        return out.index_add_(0, torch.from_numpy(ctx.inverse).to(grad.device),
                              grad.reshape(-1, dim)), None


class SparseEmbeddingBag(SparseEmbedding):
    """Sums, means or maxima of bags of rows, as ``nn.EmbeddingBag``, with the rows on the
    parameter server.

    Args:
        embedding_dim: row width.
        mode: ``"sum"``, ``"mean"`` or ``"max"``.
        include_last_offset: as ``nn.EmbeddingBag``.
        **kwargs: as :class:`SparseEmbedding` (name, init, rule, num_embeddings, padding_idx).

    Example:
        >>> bag = SparseEmbeddingBag(8, mode="sum", name="tags")
        >>> out = bag(torch.tensor([[1, 2], [7, 7]]))   # doctest: +SKIP  (2, 8)
    """

    def __init__(self, embedding_dim: int, *, mode: str = "mean",
                 include_last_offset: bool = False, **kwargs: Any) -> None:
        super().__init__(embedding_dim, **kwargs)
        if mode not in ("sum", "mean", "max"):
            raise ValueError(f"mode={mode!r}: expected 'sum', 'mean' or 'max'")
        self.mode, self.include_last_offset = mode, include_last_offset

    @staticmethod
    def _options_of(emb: nn.Module) -> dict:
        return {"mode": emb.mode, "include_last_offset": emb.include_last_offset}

    def forward(self, ids: torch.Tensor, offsets: Optional[torch.Tensor] = None,
                per_sample_weights: Optional[torch.Tensor] = None,
                show: Optional[torch.Tensor] = None,
                click: Optional[torch.Tensor] = None) -> torch.Tensor:
        """As ``nn.EmbeddingBag``; ``show`` / ``click`` (show/click tables): one value per bag
        (shape ``(bags,)`` or ``(bags, 1)``), counted for every id of the bag."""
        if ids.dim() == 2:
            bags = ids.shape[0]
        elif offsets is None:
            raise ValueError("SparseEmbeddingBag: 1-D ids need offsets")
        else:
            bags = offsets.shape[0] - (1 if self.include_last_offset else 0)
        counts = self._show_click(ids, show, click,
                                  lambda v: self._per_id(v.reshape(-1), ids, offsets))
        return self._lookup(ids, (bags, self.embedding_dim),
                            lambda rows, leaf: self._bag(rows, leaf, ids, offsets,
                                                         per_sample_weights), counts)

    def _per_id(self, per_bag: torch.Tensor, ids: torch.Tensor,
                offsets: Optional[torch.Tensor]) -> torch.Tensor:
        """A value per bag, repeated for every id of its bag."""
        if ids.dim() == 2:
            return per_bag.view(-1, 1).expand(ids.shape)
        starts = offsets.cpu()[:len(per_bag)]
        ends = torch.cat([starts[1:], torch.tensor([ids.numel()])])
        return per_bag.repeat_interleave(ends - starts)

    def _bag(self, rows: Any, leaf: torch.Tensor, ids: torch.Tensor,
             offsets: Optional[torch.Tensor], weights: Optional[torch.Tensor]) -> torch.Tensor:
        index = torch.from_numpy(np.asarray(rows.inverse, np.int64)).view(ids.shape)
        padding = None
        if self.padding_idx is not None:  # the padding id's position among the unique ids
            hit = np.flatnonzero(rows.ids == self.padding_idx)
            padding = int(hit[0]) if len(hit) else None
        return F.embedding_bag(index, leaf, None if offsets is None else offsets.cpu(),
                               mode=self.mode, include_last_offset=self.include_last_offset,
                               per_sample_weights=None if weights is None else weights.cpu(),
                               padding_idx=padding)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, mode={self.mode!r}"
