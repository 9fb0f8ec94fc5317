"""Requests that wait for other workers: sync rounds and barriers.

A sync push waits in its worker's queue until every expected worker has a push queued; then
the heads of the queues form one round. A barrier request waits under its name until every
expected worker entered it. :class:`Waits` holds both and says which are complete; the server
decides what completing or failing them means (:mod:`fleetx.ps.server`).

A wait that lasts longer than the timeout is a stall. :func:`stalled` names the workers it is
waiting for that sent no request for that long: their heartbeats prove the process lives, not
that it works (a main thread stuck in a deadlock, a debugger, an endless loop).

No sockets and no threads: the server's handler thread calls these one at a time.
"""
from __future__ import annotations

import collections
from typing import Any, Iterable, Mapping, NamedTuple, Optional

__all__ = ["Waits", "Waiting", "Stall", "stalled", "START_BARRIER"]

#: the barrier every worker enters after its HELLO (and worker 0's INIT); once it completed, a
#: worker that rejoins under failover skips it (the others passed it long ago)
START_BARRIER = "fleetx.ps.start"


class Waiting(NamedTuple):
    """One waiting request: who sent it, the message, what it carries, since when."""

    link: Any
    msg: Any
    payload: Any
    since: float


class Stall(NamedTuple):
    """A worker that stalls a wait: its rank, seconds since its last request, and the wait
    (``"a sync round"`` or ``"barrier 'name'"``) with the ranks already in it."""

    rank: int
    silent_for: float
    what: str
    arrived: tuple


class Waits:
    """Pending sync pushes (one FIFO per worker rank) and barriers (by name)."""

    def __init__(self) -> None:
        self._rounds: dict[int, collections.deque] = collections.defaultdict(collections.deque)
        self._barriers: dict[str, dict[int, Waiting]] = {}
        self.started = False  # START_BARRIER completed

    def push(self, rank: int, item: Waiting) -> None:
        self._rounds[rank].append(item)

    def enter(self, name: str, rank: int, item: Waiting) -> None:
        self._barriers.setdefault(name, {})[rank] = item

    def next_round(self, expected: Iterable[int]) -> Optional[list[Waiting]]:
        """The next complete round (removed), in ``expected`` order, or None."""
        expected = list(expected)
        if not expected or any(not self._rounds[r] for r in expected):
            return None
        return [self._rounds[r].popleft() for r in expected]

    def complete_barriers(self, expected: Iterable[int]) -> list[list[Waiting]]:
        """Every barrier that all of ``expected`` entered (removed)."""
        expected = list(expected)
        done = [name for name, w in self._barriers.items() if all(r in w for r in expected)]
        self.started = self.started or START_BARRIER in done
        return [list(self._barriers.pop(name).values()) for name in done]

    def forget(self, rank: int, link: Any) -> int:
        """Drop what ``rank`` sent on ``link`` (which died) and still waits: its pushes not
        yet in a round and its barrier entries. Returns how many. (Failover: the worker
        rejoins and sends its steps again; a round keeps waiting for its rank.)"""
        q = self._rounds.get(rank)
        kept = collections.deque(i for i in q if i.link is not link) if q else None
        dropped = len(q) - len(kept) if q else 0
        if q:
            self._rounds[rank] = kept
        for w in self._barriers.values():
            if rank in w and w[rank].link is link:
                del w[rank]
                dropped += 1
        return dropped

    def drain(self) -> list[Waiting]:
        """Every waiting request, rounds and barriers (removed): to fail them all."""
        out = [item for q in self._rounds.values() for item in q]
        out += [item for w in self._barriers.values() for item in w.values()]
        self._rounds.clear()
        self._barriers.clear()
        return out

    def oldest(self) -> list[tuple[float, str, tuple]]:
        """``(waiting since, what, ranks in it)`` of the current round and of every barrier."""
        out = []
        heads = {r: q[0].since for r, q in self._rounds.items() if q}
        if heads:
            out.append((min(heads.values()), "a sync round", tuple(sorted(heads))))
        for name, w in self._barriers.items():
            if w:
                out.append((min(i.since for i in w.values()), f"barrier {name!r}",
                            tuple(sorted(w))))
        return out


def stalled(waits: Waits, last_request: Mapping[int, float], expected: Iterable[int],
            now: float, timeout: float,
            round_expected: Optional[Iterable[int]] = None) -> list[Stall]:
    """Workers that hold up a wait older than ``timeout`` and sent no request for as long.

    Args:
        waits: the pending rounds and barriers.
        last_request: active worker rank -> time of its last request (heartbeats excluded).
        expected: the ranks barriers (and, without ``round_expected``, rounds) wait for.
        now / timeout: seconds, on the clock of ``last_request``.
        round_expected: the ranks sync rounds wait for, when fewer (workers that turned to
            inference leave the rounds but not the barriers).
    """
    expected, out, seen = list(expected), [], set()
    rounds = expected if round_expected is None else list(round_expected)
    for since, what, arrived in waits.oldest():
        if now - since <= timeout:
            continue
        for r in (rounds if what == "a sync round" else expected):
            silent = now - last_request.get(r, now)
            if r not in arrived and r not in seen and silent > timeout:
                out.append(Stall(r, silent, what, arrived))
                seen.add(r)
    return out
