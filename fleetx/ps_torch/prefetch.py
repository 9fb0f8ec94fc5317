"""Rows pulled ahead of the lookups that use them: the next batch's rows while this one trains.

Why: without it a training forward asks for its rows at its first lookup and waits a round trip
(the profile in ``docs/benchmarks.md``: 6-15% of an async worker's step). With ``fleet.prefetch``
the rows of batch ``i + 1`` are requested while batch ``i`` trains, and the lookups of batch
``i + 1`` find them arrived.

* :class:`PrefetchQueue` (one per worker, inside :class:`~fleetx.ps_torch.layout.
  RemoteSparseBackend`) holds requested pulls in order. A training forward's batched pull
  :meth:`~PrefetchQueue.take` s the oldest entry whose ids for a table are exactly the ids the
  forward looks up (the same values in the same order); older entries are dropped, and tables
  that do not match are pulled as before. Matching is by value, so a wrong guess costs a round
  trip, never a wrong row.
* :class:`PrefetchLoader` is what ``fleet.prefetch(batches, ids_of)`` returns: it iterates the
  user's batches one ahead and requests each batch's rows when it yields the one before.

When the rows are read, per mode:

* **async**: at once, while the current batch trains: the rows of batch ``i + 1`` may miss the
  update of step ``i`` (which is queued, not yet applied). Async training already reads rows
  that lag the in-flight pushes; the lag stays one step.
* **sync**: the exact-equivalence contract needs rows read after the previous step's update.
  A request for the batch after the current one (``after_step``) is held and sent when the next
  step has returned (all servers applied it), so it overlaps what runs between ``minimize`` and
  the next forward (data loading, metrics), never the step itself; an entry sent before the last
  step is never used. Results stay exact.
* **GEO**: the servers are asked only for ids not yet held locally; the rows are read from the
  local tables when the forward uses them, so they are as fresh as without prefetch.

Example:
    >>> for ids, x, y in fleet.prefetch(loader, lambda b: {model.emb: b[0]}):  # doctest: +SKIP
    ...     opt.minimize(loss_fn(model(ids, x), y))
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional

import numpy as np
import torch

from fleetx.ps.api import PSConfigError

__all__ = ["PrefetchQueue", "PrefetchLoader", "prefetch_groups", "table_ids"]

log = logging.getLogger("fleetx.ps")

#: entries kept at most; older ones are dropped (a loader one ahead needs two)
_DEPTH = 4


class _Entry:
    __slots__ = ("ids", "create", "handle", "sent_at")

    def __init__(self, ids: dict, create: bool) -> None:
        self.ids, self.create = ids, create
        self.handle: Any = None   # None: held until the next step (sync)
        self.sent_at = -1          # the step count when it was sent


class PrefetchQueue:
    """Pulls requested ahead, matched to the lookups that use them.

    Args:
        pull: ``pull(ids: {table: flat int64 ids}, create) -> handle`` whose ``wait()`` gives a
            result with ``.sparse[table]`` rows (a communicator's ``pull_sparse``).
        exact_after_step: sync mode: an entry is usable only if sent after the last step, and
            ``after_step`` requests wait for the next step before they are sent.

    Example:
        >>> q = PrefetchQueue(comm.pull_sparse, exact_after_step=False)   # doctest: +SKIP
        >>> q.add({"emb": ids}, create=True)
        >>> rows = q.take({"emb": ids}, create=True)["emb"]
    """

    def __init__(self, pull: Callable[..., Any], exact_after_step: bool) -> None:
        self._pull, self._exact = pull, exact_after_step
        self._entries: list[_Entry] = []
        self._steps = 0
        self.hits = self.misses = 0
        self._warned = False

    def add(self, ids: Mapping[str, np.ndarray], create: bool = True,
            after_step: bool = False) -> None:
        """Request the rows of ``ids`` (``{table: ids}``, any shape) for a later lookup.

        ``after_step``: they are for the forward after the next step (a loader one batch
        ahead); in sync mode the request is sent once that step returned.
        """
        entry = _Entry({n: np.ascontiguousarray(i, np.int64).reshape(-1) for n, i in ids.items()},
                       create)
        if not (after_step and self._exact):
            self._send(entry)
        self._entries.append(entry)
        del self._entries[:-_DEPTH]

    def take(self, wanted: Mapping[str, np.ndarray], create: bool) -> dict:
        """Rows for the tables of ``wanted`` (``{table: flat int64 ids}``) that an entry
        requested with exactly these ids; that entry and older ones leave the queue. Tables
        without such an entry are absent from the result (pull them)."""
        candidates = [e for e in self._entries if e.create == create]
        for entry in candidates:
            names = [n for n, ids in wanted.items() if n in entry.ids
                     and _same(entry.ids[n], ids)]
            if not names:
                continue
            del self._entries[:self._entries.index(entry) + 1]
            if entry.handle is None or (self._exact and entry.sent_at < self._steps):
                return {}  # held, or sent before the last step's update: pull anew
            self.hits += 1
            sparse = entry.handle.wait().sparse
            return {n: sparse[n] for n in names}
        if candidates:
            self._missed(wanted)
        return {}

    def stepped(self) -> None:
        """A step returned. In sync mode every entry sent before it is stale (dropped) and the
        held ones are sent now."""
        self._steps += 1
        if self._exact:
            self._entries = [e for e in self._entries if e.handle is None]
            for e in self._entries:
                self._send(e)

    def clear(self) -> None:
        """Forget every entry."""
        self._entries = []

    def _send(self, entry: _Entry) -> None:
        entry.handle = self._pull(entry.ids, create=entry.create)
        entry.sent_at = self._steps

    def _missed(self, wanted: Mapping[str, np.ndarray]) -> None:
        self.misses += 1
        if not self._warned and self.misses >= 3 and self.misses > self.hits:
            self._warned = True
            log.warning("fleet.prefetch: the prefetched rows did not match the ids the forward "
                        "looked up in %s (%d misses, %d hits); ids_of(batch) must give, per "
                        "table, the ids of the batch the forward uses, in lookup order",
                        sorted(wanted), self.misses, self.hits)


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a is b or (a.shape == b.shape and np.array_equal(a, b))


_END = object()


class PrefetchLoader:
    """Iterates ``batches`` one ahead: yielding batch ``i`` it requests the rows of batch
    ``i + 1`` (``request(ids_of(batch), after_step)``).

    Args:
        batches: any iterable of batches.
        ids_of: ``batch -> {table: ids}`` as ``request`` accepts it.
        request: ``(ids, after_step) -> None``.
    """

    def __init__(self, batches: Iterable, ids_of: Callable[[Any], Mapping],
                 request: Callable[[Mapping, bool], None]) -> None:
        if not callable(ids_of):
            raise TypeError(f"fleet.prefetch(batches, ids_of): ids_of must be a function of a "
                            f"batch returning {{embedding module or table name: ids}}, got "
                            f"{type(ids_of).__name__}")
        self.batches, self.ids_of, self.request = batches, ids_of, request

    def __iter__(self) -> Iterator:
        it = iter(self.batches)
        upcoming: Optional[Any] = next(it, _END)
        if upcoming is _END:
            return
        self.request(self.ids_of(upcoming), False)
        while True:
            current, upcoming = upcoming, next(it, _END)
            if upcoming is not _END:
                self.request(self.ids_of(upcoming), True)
            yield current
            if upcoming is _END:
                return

    def __len__(self) -> int:
        return len(self.batches)  # type: ignore[arg-type]


def table_ids(layout: Any, ids: Any) -> dict[str, np.ndarray]:
    """``{table name: flat int64 ids}`` from what ``ids_of`` returned: keys are sparse
    embedding modules of the model or their table names; values tensors or arrays, or lists of
    them (concatenated in order, as the batched pull of one forward concatenates the lookups).

    Raises:
        PSConfigError: not a mapping, or a key that is not one of the model's sparse tables.
    """
    if not isinstance(ids, Mapping):
        raise PSConfigError(f"fleet.prefetch: ids_of(batch) must return a dict {{embedding "
                            f"module or table name: ids}}, got {type(ids).__name__}")
    modules = {id(m): n for n, m in layout.sparse.items()}
    out = {}
    for key, value in ids.items():
        name = key if isinstance(key, str) else modules.get(id(key))
        if name not in layout.sparse:
            raise PSConfigError(f"fleet.prefetch: {key!r} is not a sparse table of the model; "
                                f"its tables are {sorted(layout.sparse)} (give the embedding "
                                f"module or its table name)")
        arrays = value if isinstance(value, (list, tuple)) else [value]
        flat = [_flat_ids(a) for a in arrays]
        out[name] = flat[0] if len(flat) == 1 else np.concatenate(flat)
    return out


def prefetch_groups(modules: Mapping[str, Any], ids: Mapping[str, np.ndarray]) -> dict:
    """``{create: {table: ids}}``: each table's request made as its lookup will be made.

    A table's forward creates rows (and counts sightings) when its module trains with autograd
    on (``module.training and torch.is_grad_enabled()``, read now: a loader one ahead runs
    inside the loop's own mode), so an evaluation loop's prefetch neither creates rows nor counts
    sightings. A training request for a table with an admission entry is not sent: a prefetch
    that its forward did not match would count the same sighting a second time, so such a table
    is pulled by its forward as without prefetch.
    """
    grad = torch.is_grad_enabled()
    out: dict[bool, dict[str, np.ndarray]] = {}
    for name, flat in ids.items():
        module = modules[name]
        create = bool(module.training and grad)
        if create and getattr(module, "entry", None) is not None:
            continue
        out.setdefault(create, {})[name] = flat
    return out


def _flat_ids(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):  # a tensor: the same conversion as the embedding's lookup
        value = value.detach().reshape(-1).cpu().numpy()
    return np.asarray(value).reshape(-1).astype(np.int64, copy=False)
