"""The entry of fleetx's collective user calls: every rank must come, and one that will not is
named at once.

``if rank == 0: fleet.save_checkpoint(...)``, the save guard of every DDP script, leaves rank 0
waiting in the save's collectives while rank 1 goes on into the next step's all-reduce: both
wait for each other until the collective timeout, and the gloo error says nothing of the cause.
So each of those calls first passes :func:`enter`: every rank writes to the job's store that it
entered the call (its n-th call of that name) and waits until every rank has. While it waits it
reads what the missing ranks publish (:mod:`fleetx.comm.progress`, once a second) and fails as
soon as one of them

* entered another fleetx call instead (its announcement names a different call),
* entered a collective this rank never entered (its call count on the default process group is
  past this rank's: it went on, into the next step's all-reduce say, and waits there for this
  rank, which waits here for it), or
* stopped reporting (exited or frozen),

which takes one or two report intervals (about a second), not the collective timeout. A rank
that went on into collectives of other groups only (a hybrid layout's data-parallel group) is
named when the timeout ends, as any rank that does not come. A rank that is merely
late (still computing, evaluating on its own) keeps reporting and makes no call, so it is waited
for, up to the timeout. The entry costs each rank two store writes and a few reads.
"""
from __future__ import annotations

import json
import time
from datetime import timedelta
from typing import Any, Optional, Sequence

from fleetx.comm import progress
from fleetx.comm.api import CommError

__all__ = ["enter"]

_KEY = "entry/{rank}"          # the latest fleetx call a rank entered: {"what": ..., "n": ...}
_DONE = "entered/{what}/{n}/{rank}"
_CHECK_S = 0.2                 # seconds between looks at the missing ranks' reports
_DEFAULT = "0"                 # the default group's name in the progress reports


class Entries:
    """How many times this rank entered each fleetx collective call (one per communicator)."""

    def __init__(self) -> None:
        self.counts: dict = {}

    def next(self, what: str) -> int:
        self.counts[what] = self.counts.get(what, 0) + 1
        return self.counts[what]


def enter(store: Any, rank: int, world_size: int, what: str, entries: Entries,
          timeout: float, interval: float) -> None:
    """Announce that this rank entered ``what`` and wait until every rank has.

    Args:
        store: the job's store (the one :class:`~fleetx.comm.progress.Beacon` reports to).
        rank, world_size: this process in the world.
        what: the user call, as the message names it (``"fleet.save_checkpoint"``).
        entries: this rank's counts of entries (the n-th call of each name must meet the n-th).
        timeout: seconds to wait for a rank that keeps reporting.
        interval: the beacons' report interval in seconds.

    Raises:
        CommError: a rank entered another call or collective, stopped, or did not come within
            ``timeout``; the message names it and the fix (its ``missing`` attribute holds the
            ranks, its ``cause`` why they will not come).
    """
    n = entries.next(what)
    store.set(_KEY.format(rank=rank), json.dumps({"what": what, "n": n}))
    store.set(_DONE.format(what=what, n=n, rank=rank), "1")
    keys = [_DONE.format(what=what, n=n, rank=r) for r in range(world_size)]
    mine = progress.sequence_numbers()
    start = time.monotonic()
    while not _arrived(store, keys):
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        elapsed = time.monotonic() - start
        why = [w for w in (_elsewhere(store, r, what, world_size, mine, interval)
               for r in missing) if w]
        if why or elapsed > timeout:
            # Take the entry back (the announcement stays, so the others name this call too),
            # so that a caller that recovers meets the others' next call of the same name.
            store.delete_key(_DONE.format(what=what, n=n, rank=rank))
            entries.counts[what] = n - 1
            error = CommError(_message(rank, what, missing, why, elapsed))
            error.missing, error.cause = tuple(missing), _cause(why, elapsed)
            raise error


def _arrived(store: Any, keys: list) -> bool:
    """Whether every key is set, waiting at most ``_CHECK_S`` for them: the store answers as
    soon as the last one is set (no polling delay), and the caller looks at the missing ranks
    between waits."""
    try:
        store.wait(keys, timedelta(seconds=_CHECK_S))
        return True
    except RuntimeError:  # torch.distributed.DistStoreError: not yet
        return False


def _elsewhere(store: Any, peer: int, what: str, rank_count: int, mine: dict,
               interval: float) -> Optional[str]:
    """Why ``peer`` will not come to ``what`` (None: it may still come)."""
    entry = _read(store, _KEY.format(rank=peer))
    if entry is not None and entry["what"] != what and not store.check(
            [_DONE.format(what=entry["what"], n=entry["n"], rank=r) for r in range(rank_count)]):
        # Waiting at the entry of another call that not every rank entered: it waits there.
        return f"rank {peer} called {entry['what']}() instead"
    record = progress.read_record(store, peer)
    if record is None:
        return None
    if record.silent(interval, time.time()):
        return f"rank {peer} stopped reporting (it exited or is frozen)"
    # The default group only: its calls are collectives every rank makes (data parallel's
    # all-reduce, the script's own), whereas a pipeline's sends and receives, which torch
    # numbers too, leave the middle stages' counts above the first's on the pipe groups.
    if record.seqs.get(_DEFAULT, 0) > mine.get(_DEFAULT, 0):
        return (f"rank {peer} went on into a collective of its own: call "
                f"#{record.seqs[_DEFAULT]} on the default process group, which this rank has "
                f"not entered")
    return None


def _read(store: Any, key: str) -> Optional[dict]:
    try:
        return json.loads(store.get(key)) if store.check([key]) else None
    except (RuntimeError, ValueError):
        return None


def _cause(why: Sequence[str], elapsed: float) -> str:
    return "; ".join(why) if why else f"they did not come within {elapsed:.0f} s"


def _message(rank: int, what: str, missing: Sequence[int], why: Sequence[str],
             elapsed: float) -> str:
    ranks = ", ".join(str(r) for r in missing)
    cause = _cause(why, elapsed)
    return (f"{what}() is a collective: rank {rank} called it, rank(s) {ranks} did not "
            f"({cause}). Call it on every rank (it writes from rank 0 alone where it writes "
            f"one copy); a guard such as `if rank == 0:` around it leaves the others out")
