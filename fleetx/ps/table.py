"""Tables: rows plus a rule.

* :class:`IdIndex` maps int64 ids to row numbers: open addressing with linear probing over one
  int64 array of ``(key, row)`` pairs (one cache line per probe), load factor at most 1/2.
  Rows are numbered densely in order of creation, so a table's rows live in one slab.
* :class:`SparseTable` keeps a float32 slab ``(rows, dim + state)``: the weights, then the
  rule's state, side by side (one gather reads a whole row). A missing id gets a row on first
  touch, initialised from ``(seed, id)`` alone (:mod:`fleetx.ps.initializers`).
* :class:`DenseTable` is one server's slice of a flat dense vector: a single row of width
  ``numel``, so the same rules and kernels serve it.

Tables are not thread-safe: a server touches them from one handler thread only.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from fleetx.ps import kernels
from fleetx.ps.api import PSConfigError, DenseTableSpec, RequestError, SparseTableSpec
from fleetx.ps.initializers import initial_rows
from fleetx.ps.rules import Rule

__all__ = ["IdIndex", "SparseTable", "DenseTable"]

_ROW0 = np.zeros(1, np.int64)


def _pow2_at_least(n: int) -> int:
    return 1 << max(4, int(n - 1).bit_length())


class IdIndex:
    """int64 id -> dense row number, created on demand.

    Example:
        >>> ix = IdIndex()
        >>> ix.insert(np.array([42, 7, 42]))[0].tolist()
        [0, 1, 0]
        >>> ix.find(np.array([7, 5])).tolist()
        [1, -1]
    """

    def __init__(self, capacity: int = 1024) -> None:
        self._slots = np.full(2 * _pow2_at_least(2 * capacity), -1, np.int64)
        self._row_keys = np.empty(max(16, capacity), np.int64)
        self.size = 0

    def __len__(self) -> int:
        return self.size

    @property
    def keys(self) -> np.ndarray:
        """Every id, in row order (a view)."""
        return self._row_keys[:self.size]

    @property
    def nbytes(self) -> int:
        return self._slots.nbytes + self._row_keys.nbytes

    def find(self, ids: np.ndarray) -> np.ndarray:
        """Row of every id, -1 where absent."""
        ids = np.ascontiguousarray(ids, np.int64)
        out = np.empty(len(ids), np.int64)
        kernels.index_find(self._slots, ids, out)
        return out

    def insert(self, ids: np.ndarray) -> tuple[np.ndarray, int]:
        """Rows of ``ids``, creating missing ones; returns ``(rows, first_new_row)``: the new
        rows are ``first_new_row .. len(self) - 1``."""
        ids = np.ascontiguousarray(ids, np.int64)
        self._reserve(len(ids))
        out = np.empty(len(ids), np.int64)
        first = self.size
        self.size = kernels.index_insert(self._slots, self._row_keys, ids, out, first)
        return out, first

    def _reserve(self, extra: int) -> None:
        need = self.size + extra
        if need > len(self._row_keys):
            grown = np.empty(max(need, 2 * len(self._row_keys)), np.int64)
            grown[:self.size] = self._row_keys[:self.size]
            self._row_keys = grown
        if 2 * need > len(self._slots) // 2:  # keep the load factor <= 1/2
            slots = np.full(2 * _pow2_at_least(4 * need), -1, np.int64)
            out = np.empty(self.size, np.int64)
            kernels.index_insert(slots, self._row_keys, self._row_keys[:self.size].copy(),
                                 out, 0)
            self._slots = slots


class SparseTable:
    """id -> row of ``dim`` weights plus the rule's state; rows are created on first touch.

    Args:
        spec: the table's shape, rule configuration and initialiser.
        rule: the update rule (decides the state columns).
        capacity: rows to allocate up front (the slab grows by doubling).
        max_rows: refuse to create rows beyond this many (0: no limit), so that no request
            can make a server allocate without bound.
    """

    def __init__(self, spec: SparseTableSpec, rule: Rule, capacity: int = 1024,
                 max_rows: int = 0) -> None:
        self.spec, self.rule, self.dim, self.max_rows = spec, rule, spec.dim, max_rows
        self.width = rule.width(spec.dim)
        self.index = IdIndex(capacity)
        self._slab = np.zeros((max(16, capacity), self.width), np.float32)

    def __len__(self) -> int:
        return len(self.index)

    @property
    def nbytes(self) -> int:
        return self._slab.nbytes + self.index.nbytes

    @property
    def slab(self) -> np.ndarray:
        """Rows in use: ``(len(self), width)`` (a view)."""
        return self._slab[:len(self)]

    def pull(self, ids: np.ndarray, create: bool = True) -> np.ndarray:
        """Weights of ``ids`` as ``(n, dim)``; ``create=False`` leaves the table unchanged and
        returns what an absent row would be initialised to."""
        ids = self._check(ids)
        if create:
            rows = self._rows(ids)  # before reading self._slab: creating rows may grow it
            return kernels.gather(self._slab, rows, self.dim)
        rows = self.index.find(ids)
        missing = rows < 0
        out = kernels.gather(self._slab, np.where(missing, 0, rows), self.dim)
        if missing.any():
            out[missing] = initial_rows(ids[missing], self.dim, self.spec.init)
        return out

    def push(self, ids: np.ndarray, grads: np.ndarray) -> None:
        """Apply the rule to the rows of ``ids`` (unique) with ``grads`` ``(n, dim)``."""
        ids = self._check(ids)
        grads = np.ascontiguousarray(grads, np.float32).reshape(len(ids), self.dim)
        rows = self._rows(ids)
        self.rule.apply(self._slab, rows, grads, self.dim)

    def assign(self, ids: np.ndarray, values: np.ndarray) -> None:
        """Set the weights of ``ids`` and reset their optimizer state."""
        ids = self._check(ids)
        rows = self._rows(ids)
        self._slab[rows, :self.dim] = np.asarray(values, np.float32).reshape(len(ids), -1)
        state = self._slab[rows, self.dim:]
        self.rule.init_state(state, self.dim)
        self._slab[rows, self.dim:] = state

    def load(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Restore saved rows (weights and, when the widths match, optimizer state)."""
        if rows.shape[1] == self.width:
            index = self._rows(self._check(ids))
            self._slab[index] = rows
        else:  # another rule saved them: keep the weights, start the state afresh
            self.assign(ids, rows[:, :self.dim])

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

    def _rows(self, ids: np.ndarray) -> np.ndarray:
        self.check_capacity(ids)
        rows, first = self.index.insert(ids)
        if len(self) > first:
            self._grow(len(self))
            keys = self.index.keys[first:]
            self._slab[first:len(self), :self.dim] = initial_rows(keys, self.dim,
                                                                  self.spec.init)
            self.rule.init_state(self._slab[first:len(self), self.dim:], self.dim)
        return rows

    def _grow(self, need: int) -> None:
        if need > len(self._slab):
            slab = np.zeros((max(need, 2 * len(self._slab)), self.width), np.float32)
            slab[:len(self._slab)] = self._slab
            self._slab = slab


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
