"""What changed in a sparse table since its last save: the base of delta saves (mode 2).

Tracking starts at the first save (or load) of a table, so a table that is never saved pays
nothing: then one byte per row marks the rows an update, a creation or a load wrote since the
last save, and the ids removed since then (by a shrink) are kept until the next save, which
must carry them so that replaying the deltas deletes them too.

Example:
    >>> log = ChangeLog()
    >>> log.start(rows=3)
    >>> log.mark(np.array([2]))
    >>> log.changed(3).tolist()
    [2]
"""
from __future__ import annotations

import numpy as np

from fleetx.ps.storage import RowArray

__all__ = ["ChangeLog"]


class ChangeLog:
    """Rows changed and ids removed since the last save, once :meth:`start` was called."""

    def __init__(self) -> None:
        self.active = False
        self._dirty = None
        self._removed: list[np.ndarray] = []

    def nbytes(self, rows: int) -> int:
        return self._dirty.nbytes(rows) if self.active else 0

    def start(self, rows: int) -> None:
        """From now on (again): nothing changed in the ``rows`` rows present."""
        if self._dirty is None:
            self._dirty = RowArray(None, np.uint8, max(16, rows))
        self._dirty.reserve(rows, 0)
        self._dirty.array[:rows] = 0
        self._removed = []
        self.active = True

    def reserve(self, rows: int, used: int) -> None:
        if self.active:
            self._dirty.reserve(rows, used)

    def mark(self, rows) -> None:
        """``rows`` (an index array or a slice) were written."""
        if self.active:
            self._dirty.array[rows] = 1

    def move(self, src: np.ndarray, dst: np.ndarray) -> None:
        if self.active:
            self._dirty.array[dst] = self._dirty.array[src]

    def removed(self, ids: np.ndarray) -> None:
        if self.active and len(ids):
            self._removed.append(np.asarray(ids, np.int64).copy())

    def changed(self, rows: int) -> np.ndarray:
        """The rows (among the first ``rows``) written since the last save."""
        return np.flatnonzero(self._dirty.array[:rows]) if self.active \
            else np.arange(rows)

    def removed_ids(self) -> np.ndarray:
        """Ids removed since the last save (some may have come back since: replaying deletes
        first, then writes the changed rows)."""
        return np.unique(np.concatenate(self._removed)) if self._removed \
            else np.empty(0, np.int64)
