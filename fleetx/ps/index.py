"""The id -> row index of a sparse table: open addressing over uint32 slots, rows kept dense.

Memory per id is what the parameter server pays on top of a row's values, so it is kept small:

* a slot is 4 bytes: the row number, plus, in the bits the row number does not need, a tag of
  the key's hash, so that a probe reads a key only when the tags match. The slot array has
  between 1.25 and 1.67 slots per id (load factor 0.6 to 0.8: grown to 0.6 once past 0.8), so
  5 to 6.7 bytes per id;
* the keys live once, in row order (``keys[row]``: 8 bytes per id), in a :class:`RowArray`
  that grows without copying.

Rows are numbered densely in order of creation. Removing ids keeps them dense: the last rows
move into the holes, and :meth:`IdIndex.remove` says which moved, so that a table moves its
values the same way. The probes (find, insert, backward-shift deletion, relinking a moved row)
are in :mod:`fleetx.ps.kernels`, in C with a numpy twin.

Example:
    >>> ix = IdIndex()
    >>> ix.insert(np.array([42, 7, 42]))[0].tolist()
    [0, 1, 0]
    >>> ix.find(np.array([7, 5])).tolist()
    [1, -1]
"""
from __future__ import annotations

import math

import numpy as np

from fleetx.ps import kernels
from fleetx.ps.storage import RowArray

__all__ = ["IdIndex", "MAX_LOAD", "GROWN_LOAD"]

#: past this load factor the slots are re-laid out ...
MAX_LOAD = 0.8
#: ... to this one (linear probing stays short below 0.8 with tags sparing most key reads)
GROWN_LOAD = 0.6
#: the most ids one index holds (a row number must leave room for a tag in 32 bits)
MAX_IDS = int(kernels.MAX_SLOTS * MAX_LOAD)


def _slots_for(ids: int) -> int:
    return max(16, math.ceil(ids / GROWN_LOAD))


class IdIndex:
    """int64 id -> dense row number, created on demand.

    Args:
        capacity: ids to make room for at once.
    """

    def __init__(self, capacity: int = 1024) -> None:
        self._slots = np.full(_slots_for(capacity), kernels.EMPTY, np.uint32)
        self._keys = RowArray(None, np.int64, max(16, capacity))
        self.size = 0

    def __len__(self) -> int:
        return self.size

    @property
    def keys(self) -> np.ndarray:
        """Every id, in row order (a view: valid until the index next grows)."""
        return self._keys.array[:self.size]

    @property
    def nbytes(self) -> int:
        """Bytes held: the slots and the keys of the ids present."""
        return self._slots.nbytes + self._keys.nbytes(self.size)

    def find(self, ids: np.ndarray) -> np.ndarray:
        """Row of every id, -1 where absent."""
        ids = np.ascontiguousarray(ids, np.int64)
        out = np.empty(len(ids), np.int64)
        kernels.index_find(self._slots, self._keys.array[:self.size], ids, out)
        return out

    def insert(self, ids: np.ndarray) -> tuple[np.ndarray, int]:
        """Rows of ``ids``, creating missing ones; returns ``(rows, first_new_row)``: the new
        rows are ``first_new_row .. len(self) - 1``."""
        ids = np.ascontiguousarray(ids, np.int64)
        self.reserve(self.size + len(ids))
        out = np.empty(len(ids), np.int64)
        first = self.size
        self.size = kernels.index_insert(self._slots, self._keys.array, ids, out, first)
        return out, first

    def remove(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Forget ``ids`` (absent ones are ignored) and keep the rows dense: the last rows that
        survive move into the holes. Returns ``(removed ids, src, dst)``: the caller moves its
        per-row values likewise, ``values[dst] = values[src]`` (the two never overlap).
        """
        ids = np.unique(np.asarray(ids, np.int64))
        rows = self.find(ids)
        ids, rows = ids[rows >= 0], rows[rows >= 0]
        keys = self._keys.array
        kernels.index_remove(self._slots, keys[:self.size], ids)
        n, m = self.size, self.size - len(ids)
        dst = np.sort(rows[rows < m])
        src = np.setdiff1d(np.arange(m, n), rows[rows >= m])  # survivors past the end, sorted
        keys[dst] = keys[src]
        # each moved key's slot still names its old row, where its key also still is
        kernels.index_relink(self._slots, keys[:n], keys[dst], dst)
        self.size = m
        return ids, src, dst

    def reserve(self, ids: int) -> None:
        """Room for ``ids`` ids without growing again.

        Raises:
            MemoryError: more than ``MAX_IDS`` ids.
        """
        if ids > MAX_IDS:
            raise MemoryError(f"an index holds at most {MAX_IDS} ids; {ids} requested")
        self._keys.reserve(ids, self.size)
        if ids > MAX_LOAD * len(self._slots):
            slots = np.full(min(_slots_for(ids), kernels.MAX_SLOTS), kernels.EMPTY, np.uint32)
            kernels.index_rebuild(slots, self._keys.array, self.size)
            self._slots = slots

    def release(self) -> None:
        """Give back the memory of keys past the ids present (after :meth:`remove`)."""
        self._keys.release(self.size)
