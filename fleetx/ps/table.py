"""Tables: rows plus a rule.

* :class:`SparseTable` maps int64 ids to rows through an :class:`~fleetx.ps.index.IdIndex` and
  keeps a float32 slab ``(rows, dim + state)``: the weights, then the rule's state, side by side
  (one gather reads a whole row). Rows are dense (``0 .. len - 1``); removing rows moves the last
  ones into the holes. The slab, like the index's keys, is a :class:`~fleetx.ps.storage.RowArray`
  that grows without copying. A missing id gets a row on first touch, initialised from
  ``(seed, id)`` alone (:mod:`fleetx.ps.initializers`), unless the table has an admission entry
  (:mod:`fleetx.ps.growth`): then only admitted ids get rows, at their first update.
* :class:`DenseTable` is one server's slice of a flat dense vector: a single row of width
  ``numel``, so the same rules and kernels serve it.

Tables are not thread-safe: a server touches them from one handler thread only.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from fleetx.ps import kernels
from fleetx.ps.api import PSConfigError, DenseTableSpec, RequestError, SparseTableSpec
from fleetx.ps.changes import ChangeLog
from fleetx.ps.growth import Admission, RowStats
from fleetx.ps.index import IdIndex
from fleetx.ps.initializers import initial_rows
from fleetx.ps.rules import Rule
from fleetx.ps.storage import RowArray

__all__ = ["SparseTable", "DenseTable"]

_ROW0 = np.zeros(1, np.int64)


class SparseTable:
    """id -> row of ``dim`` weights plus the rule's state; rows are created on first touch
    (or, with an admission entry, once an id is admitted).

    Args:
        spec: the table's shape, rule configuration, initialiser and growth settings.
        rule: the update rule (decides the state columns).
        capacity: rows to make room for up front.
        max_rows: refuse to create rows beyond this many (0: no limit), so that no request
            can make a server allocate without bound.
    """

    def __init__(self, spec: SparseTableSpec, rule: Rule, capacity: int = 1024,
                 max_rows: int = 0) -> None:
        self.spec, self.rule, self.dim, self.max_rows = spec, rule, spec.dim, max_rows
        self.width = rule.width(spec.dim)
        self.index = IdIndex(capacity)
        self._slab = RowArray(self.width, np.float32, max(16, capacity))
        self.admission = Admission(spec) if spec.admission else None
        self.stats = RowStats(spec) if spec.accessor is not None else None
        self.changes = ChangeLog()
        self.passes = 0  # shrinks so far: the number of the current pass
        self.counters = {"created": 0, "removed": 0, "dropped_updates": 0}

    def __len__(self) -> int:
        return len(self.index)

    @property
    def nbytes(self) -> int:
        return sum(self.memory().values())

    def memory(self) -> dict:
        """Bytes held, by part: row values, index (slots and keys), statistics, pending ids,
        change marks."""
        n = len(self)
        return {"values": self._slab.nbytes(n), "index": self.index.nbytes,
                "stats": self.stats.nbytes(n) if self.stats else 0,
                "pending": self.admission.nbytes if self.admission else 0,
                "changes": self.changes.nbytes(n)}

    @property
    def slab(self) -> np.ndarray:
        """Rows in use: ``(len(self), width)`` (a view: valid until the table next grows)."""
        return self._slab.array[:len(self)]

    def pull(self, ids: np.ndarray, create: bool = True) -> np.ndarray:
        """Weights of ``ids`` as ``(n, dim)``. ``create=False`` leaves the table unchanged and
        returns, for absent ids, what their row would be initialised to. With an admission
        entry no pull creates a row: absent ids read as zeros, and a training pull
        (``create=True``) counts one sighting of each."""
        ids = self._check(ids)
        if create and self.admission is None:
            rows = self._rows(ids)  # before reading the slab: creating rows may grow it
            return kernels.gather(self._slab.array, rows, self.dim)
        rows = self.index.find(ids)
        missing = rows < 0
        out = kernels.gather(self._slab.array, np.where(missing, 0, rows), self.dim)
        if missing.any():
            if self.admission is not None:
                out[missing] = 0.0
                if create:
                    self.admission.sight(np.unique(ids[missing]), self.passes)
            else:
                out[missing] = initial_rows(ids[missing], self.dim, self.spec.init)
        return out

    def push(self, ids: np.ndarray, values: np.ndarray) -> None:
        """Apply the rule to the rows of ``ids`` (unique). ``values`` is ``(n, push_width)``:
        the gradients, then show and click for show/click tables. With an admission entry,
        admitted ids get their rows now and the updates of the others are dropped."""
        ids = self._check(ids)
        values = np.ascontiguousarray(values, np.float32).reshape(len(ids), self.spec.push_width)
        rows = self._rows(ids) if self.admission is None else self._admitted_rows(ids)
        if self.admission is not None and (rows < 0).any():
            keep = rows >= 0
            self.counters["dropped_updates"] += int((~keep).sum())
            rows, values = rows[keep], values[keep]
        grads = values if self.spec.push_width == self.dim else \
            np.ascontiguousarray(values[:, :self.dim])
        self.rule.apply(self._slab.array, rows, grads, self.dim)
        if self.stats is not None:
            self.stats.touched(rows, self.passes, values[:, self.dim:] if self.spec.show_click
                               else None)
        self.changes.mark(rows)

    def assign(self, ids: np.ndarray, values: np.ndarray) -> None:
        """Set the weights of ``ids`` (creating their rows) and reset their optimizer state."""
        ids = self._check(ids)
        rows = self._rows(ids)
        slab = self._slab.array
        slab[rows, :self.dim] = np.asarray(values, np.float32).reshape(len(ids), self.dim)
        state = slab[rows, self.dim:]
        self.rule.init_state(state, self.dim)
        slab[rows, self.dim:] = state
        self.changes.mark(rows)

    def load(self, ids: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Restore saved rows (weights and, when the widths match, optimizer state); returns
        their row numbers."""
        if rows.shape[1] != self.width:  # another rule saved them: keep the weights only
            self.assign(ids, rows[:, :self.dim])
            return self.index.find(ids)
        index = self._rows(self._check(ids))
        self._slab.array[index] = rows
        self.changes.mark(index)
        return index

    def remove(self, ids: np.ndarray) -> int:
        """Delete the rows of ``ids`` (absent ones are ignored); returns how many went."""
        removed, src, dst = self.index.remove(ids)
        if len(removed):
            slab = self._slab.array
            slab[dst] = slab[src]
            if self.stats is not None:
                self.stats.move(src, dst)
            self.changes.move(src, dst)
            self.changes.removed(removed)
            self.counters["removed"] += len(removed)
        return len(removed)

    def shrink(self, threshold: Optional[int] = None) -> dict:
        """End the current pass: decay show/click and delete the rows the accessor marks
        (``threshold`` replaces ``delete_after_unseen_days``), forget pending ids not sighted
        in the pass. Tables without an accessor or entry only count the pass.

        Returns:
            ``{"removed": rows deleted, "forgotten": pending ids forgotten}``.
        """
        out = {"removed": 0, "forgotten": 0}
        if self.stats is not None:
            limit = self.stats.accessor.delete_after_unseen_days if threshold is None \
                else threshold
            drop = self.stats.shrink(len(self), self.passes, limit)
            if drop.any():
                out["removed"] = self.remove(self.index.keys[drop].copy())
        if self.admission is not None:
            out["forgotten"] = self.admission.forget(self.passes)
        self.passes += 1
        if out["removed"]:  # the pages past the rows left go back to the system
            for part in (self._slab, self.stats.cols):
                part.release(len(self))
            self.index.release()
        return out

    def row_stats(self, ids: np.ndarray) -> np.ndarray:
        """``(n, k)`` float32 statistics of ``ids``: [show, click,] passes unseen (NaN for ids
        without a row; ``k == 0`` for tables that keep none)."""
        ids = self._check(ids)
        if self.stats is None:
            return np.empty((len(ids), 0), np.float32)
        rows = self.index.find(ids)
        out = np.full((len(ids), self.stats.width), np.nan, np.float32)
        out[rows >= 0] = self.stats.state(rows[rows >= 0], self.passes)
        return out

    def check_capacity(self, ids: np.ndarray) -> None:
        """Raise unless the rows of ``ids`` fit in ``max_rows`` (existing ids cost nothing).

        Raises:
            RequestError: the missing ids would take the table past ``max_rows``.
        """
        if not self.max_rows or len(self) + len(ids) <= self.max_rows:
            return  # the common case costs one comparison
        new = int((self.index.find(ids) < 0).sum())  # repeated new ids only overcount
        if len(self) + new > self.max_rows:
            raise RequestError(f"table {self.spec.name!r} holds {len(self)} rows here; {new} "
                               f"new ids would pass its limit of {self.max_rows} rows per "
                               "server (FLEETX_PS_MAX_ROWS)")

    def _check(self, ids: np.ndarray) -> np.ndarray:
        ids = np.ascontiguousarray(ids, np.int64).reshape(-1)
        n = self.spec.num_embeddings
        if n is not None and len(ids) and (ids.min() < 0 or ids.max() >= n):
            raise PSConfigError(f"table {self.spec.name!r}: ids must be in [0, {n}); got "
                              f"[{ids.min()}, {ids.max()}]")
        return ids

    def _admitted_rows(self, ids: np.ndarray) -> np.ndarray:
        """Rows of ``ids``; admitted ids without one get it now; -1 for the others."""
        rows = self.index.find(ids)
        missing = np.flatnonzero(rows < 0)
        if len(missing):
            ok = self.admission.take(ids[missing])
            if ok.any():
                rows[missing[ok]] = self._rows(ids[missing[ok]])
        return rows

    def _rows(self, ids: np.ndarray) -> np.ndarray:
        self.check_capacity(ids)
        n0 = len(self)
        for part in (self._slab, self.stats, self.changes):
            if part is not None:
                part.reserve(n0 + len(ids), n0)
        rows, first = self.index.insert(ids)
        n = len(self)
        if n > first:
            keys, slab = self.index.keys[first:], self._slab.array
            slab[first:n, :self.dim] = initial_rows(keys, self.dim, self.spec.init)
            self.rule.init_state(slab[first:n, self.dim:], self.dim)
            if self.stats is not None:
                self.stats.created(first, n, self.passes)
            self.changes.mark(slice(first, n))
            self.counters["created"] += n - first
        return rows


class DenseTable:
    """One server's slice ``[start, stop)`` of a flat dense parameter vector, with its state.

    Values start at zero until worker 0 assigns the model's initial parameters.
    """

    def __init__(self, spec: DenseTableSpec, rule: Rule, start: int, stop: int) -> None:
        self.spec, self.rule, self.start, self.stop = spec, rule, start, stop
        self.numel = stop - start
        self.slab = np.zeros((1, rule.width(self.numel)), np.float32)
        rule.init_state(self.slab[0, self.numel:], self.numel)
        self.initialized = False

    @property
    def nbytes(self) -> int:
        return self.slab.nbytes

    def pull(self) -> np.ndarray:
        """The weights (a view: copy before the next update if you keep it)."""
        return self.slab[0, :self.numel]

    def push(self, grads: np.ndarray) -> None:
        if self.numel:
            g = np.ascontiguousarray(grads, np.float32).reshape(1, self.numel)
            self.rule.apply(self.slab, _ROW0, g, self.numel)

    def assign(self, values: np.ndarray, state: Optional[np.ndarray] = None) -> None:
        """Set the weights; reset the state, or restore a saved one of the right width."""
        self.slab[0, :self.numel] = values
        if state is not None and len(state) == self.slab.shape[1] - self.numel:
            self.slab[0, self.numel:] = state
        else:
            self.rule.init_state(self.slab[0, self.numel:], self.numel)
        self.initialized = True
