"""Table growth control: which ids get a row (admission) and which rows go (shrink).

Two pieces a :class:`~fleetx.ps.table.SparseTable` holds when its spec asks for them:

* :class:`Admission` (a :class:`~fleetx.ps.api.CountFilterEntry` or
  :class:`~fleetx.ps.api.ProbabilityEntry`): the sighting counts of ids that have no row yet.
  A training pull of such an id counts one sighting (in sync mode the server counts each
  round's merged update instead, :class:`~fleetx.ps.shard.Shard`); once the id is admitted
  (its count reached ``count_filter``, or the draw of a sighting fell under ``probability``),
  the next update (push) of the id creates its row. Pending ids live in an index of their own
  with two float32 columns (count, pass of the last sighting): about 22 bytes each, at most
  ``max_pending`` of them.
* :class:`RowStats` (a table with an :class:`~fleetx.ps.api.AccessorConfig`): per row, the pass
  in which an update last touched it, and for :class:`~fleetx.ps.api.ShowClickEntry` tables
  the show and click sums. :meth:`RowStats.shrink` applies Paddle's
  ``CtrCommonAccessor::Shrink``: decay show and click, then mark rows whose score is below
  ``delete_threshold`` or which were unseen for more than ``delete_after_unseen_days`` passes.

A *pass* ends at each shrink; passes are numbered from 0, and a row's number of unseen passes is
``current pass - pass of its last update``. Everything here is float32 arithmetic, as Paddle's
accessor does it.
"""
from __future__ import annotations

import numpy as np

from fleetx.ps.api import AccessorConfig, CountFilterEntry, SparseTableSpec
from fleetx.ps.index import IdIndex
from fleetx.ps.initializers import sighting_draws
from fleetx.ps.storage import RowArray

__all__ = ["Admission", "RowStats", "ADMITTED"]

#: the count a probability entry writes for an id whose draw admitted it
ADMITTED = float(1 << 24)
_COUNT, _SEEN = 0, 1


class Admission:
    """Sighting counts of ids waiting for a row.

    Args:
        spec: the table (its entry: :class:`CountFilterEntry` or ``ProbabilityEntry``).
    """

    def __init__(self, spec: SparseTableSpec) -> None:
        entry = spec.entry
        self.need = float(entry.count_filter) if isinstance(entry, CountFilterEntry) \
            else ADMITTED
        self.probability = getattr(entry, "probability", None)
        self.seed = getattr(entry, "seed", 0)
        self.max_pending = entry.max_pending
        self.index = IdIndex(16)
        self._cols = RowArray(2, np.float32, 16)
        self.counters = {"sighted": 0, "admitted": 0, "not_counted": 0, "forgotten": 0}

    def __len__(self) -> int:
        return len(self.index)

    @property
    def nbytes(self) -> int:
        return self.index.nbytes + self._cols.nbytes(len(self))

    def sight(self, ids: np.ndarray, pass_id: int) -> None:
        """One training sighting of each of ``ids`` (distinct ids without a row)."""
        rows = self.index.find(ids)
        new = ids[rows < 0]
        room = max(0, self.max_pending - len(self))
        if len(new) > room:  # full: the ids past the room are not counted this time
            self.counters["not_counted"] += len(new) - room
            new = new[:room]
        if len(new):
            self._cols.reserve(len(self) + len(new), len(self))
            added, first = self.index.insert(new)
            self._cols.array[first:len(self)] = 0.0
        rows = self.index.find(ids)
        rows = rows[rows >= 0]
        cols = self._cols.array
        waiting = rows[cols[rows, _COUNT] < self.need]
        cols[waiting, _COUNT] += 1
        cols[rows, _SEEN] = pass_id
        self.counters["sighted"] += len(rows)
        if self.probability is not None and len(waiting):
            draws = sighting_draws(self.index.keys[waiting], self.seed, cols[waiting, _COUNT])
            cols[waiting[draws < self.probability], _COUNT] = ADMITTED

    def take(self, ids: np.ndarray) -> np.ndarray:
        """Which of ``ids`` (distinct ids without a row) are admitted; those leave the pending
        set (their rows are about to be created)."""
        rows = self.index.find(ids)
        ok = rows >= 0
        ok[ok] = self._cols.array[rows[ok], _COUNT] >= self.need
        if ok.any():
            self._remove(ids[ok])
            self.counters["admitted"] += int(ok.sum())
        return ok

    def forget(self, pass_id: int) -> int:
        """At the end of pass ``pass_id``: forget ids not sighted during it."""
        n = len(self)
        stale = self.index.keys[self._cols.array[:n, _SEEN] < pass_id].copy()
        self._remove(stale)
        self.counters["forgotten"] += len(stale)
        return len(stale)

    def state(self) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, (count, pass of last sighting) float32)`` of every pending id."""
        return self.index.keys.copy(), self._cols.array[:len(self)].copy()

    def restore(self, ids: np.ndarray, cols: np.ndarray) -> None:
        """Add saved pending ids (ids that already wait keep their own counts)."""
        keep = self.index.find(ids) < 0
        ids, cols = ids[keep][:max(0, self.max_pending - len(self))], cols[keep]
        self._cols.reserve(len(self) + len(ids), len(self))
        _, first = self.index.insert(ids)
        self._cols.array[first:len(self)] = cols[:len(ids)]

    def clear(self) -> None:
        """Forget every pending id (a saved set replaces them)."""
        self._remove(self.index.keys.copy())

    def _remove(self, ids: np.ndarray) -> None:
        _, src, dst = self.index.remove(ids)
        cols = self._cols.array
        cols[dst] = cols[src]


class RowStats:
    """Per row: the pass of its last update, and show/click for show/click tables.

    Args:
        spec: the table (``accessor`` set).
    """

    def __init__(self, spec: SparseTableSpec) -> None:
        self.accessor: AccessorConfig = spec.accessor
        self.show_click = spec.show_click
        self.width = 3 if self.show_click else 1  # [show, click,] last seen
        self.cols = RowArray(self.width, np.float32, 16)

    def nbytes(self, rows: int) -> int:
        return self.cols.nbytes(rows)

    def reserve(self, rows: int, used: int) -> None:
        self.cols.reserve(rows, used)

    def created(self, first: int, stop: int, pass_id: int) -> None:
        """Rows ``first .. stop-1`` are new: no show or click yet, seen in this pass."""
        self.cols.array[first:stop] = 0.0
        self.cols.array[first:stop, -1] = pass_id

    def touched(self, rows: np.ndarray, pass_id: int, show_click=None) -> None:
        """An update reached ``rows`` (distinct) in pass ``pass_id``, with ``(n, 2)`` show and
        click sums for show/click tables."""
        cols = self.cols.array
        cols[rows, -1] = pass_id
        if self.show_click and show_click is not None:
            cols[rows, :2] += show_click

    def move(self, src: np.ndarray, dst: np.ndarray) -> None:
        self.cols.array[dst] = self.cols.array[src]

    def shrink(self, rows: int, pass_id: int, unseen_limit: int) -> np.ndarray:
        """End of pass ``pass_id`` for the first ``rows`` rows: decay show and click, and return
        the mask of rows to delete (score below ``delete_threshold``, or not updated in more
        than ``unseen_limit`` passes)."""
        a, cols = self.accessor, self.cols.array[:rows]
        unseen = np.float32(pass_id) - cols[:, -1]
        drop = unseen > np.float32(unseen_limit)
        if self.show_click:
            cols[:, :2] *= np.float32(a.show_click_decay_rate)
            drop |= self.score(cols[:, 0], cols[:, 1]) < np.float32(a.delete_threshold)
        return drop

    def decay(self, rows: int, passes: int) -> None:
        """Replay the show/click decay of ``passes`` shrinks on the first ``rows`` rows, with
        the float32 operations :meth:`shrink` makes (so the values are the same bits)."""
        if not self.show_click:
            return
        cols, rate = self.cols.array[:rows, :2], np.float32(self.accessor.show_click_decay_rate)
        left = passes
        while left > 0:
            # one copy per 64 passes: a fixed point (zeros, or the smallest denormal the rate
            # rounds back to) is stable, so multiplying past it inside a chunk changes nothing
            before, chunk = cols.copy(), min(left, 64)
            for _ in range(chunk):
                cols *= rate
            left -= chunk
            if np.array_equal(before, cols):
                break

    def score(self, show: np.ndarray, click: np.ndarray) -> np.ndarray:
        """``(show - click) * nonclk_coeff + click * click_coeff`` in float32."""
        a = self.accessor
        return (show - click) * np.float32(a.nonclk_coeff) + click * np.float32(a.click_coeff)

    def state(self, rows: np.ndarray, pass_id: int) -> np.ndarray:
        """``(n, width)`` float32: [show, click,] passes unseen, of ``rows`` (portable: no pass
        numbers)."""
        out = self.cols.array[rows].copy()
        out[:, -1] = np.float32(pass_id) - out[:, -1]
        return out

    def restore(self, rows: np.ndarray, saved: np.ndarray, pass_id: int) -> None:
        """The inverse of :meth:`state` (a save of a table with the same statistics)."""
        cols = self.cols.array
        cols[rows] = saved
        cols[rows, -1] = np.float32(pass_id) - saved[:, -1]
