"""Blame the right rank: when a collective fails, name the peer that never arrived.

The rank that raises is the one that waited: gloo says only ``Timed out waiting 20000ms for
recv operation to complete``. :func:`diagnose` works out who is at fault from what this rank
knows (its own calls: the traceback and torch's flight recorder) and what every peer last
published (:mod:`fleetx.comm.progress`):

* a peer whose count of calls on the failing call's group is below that call's number did not
  arrive at it ("rank 1 did not arrive at all_reduce #21 on group 0 (ranks [0, 1]) within
  20 s; it is alive (reported 0.4 s ago), its latest call: all_reduce #20 ...");
* ranks that torch itself names (a monitored barrier, or the checks a user's
  ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` adds) are taken as named.

``FLEETX_DEBUG_COLLECTIVES=1`` finds divergent calls before they run (:mod:`fleetx.comm.debug`).

:class:`Watch` runs this for exceptions nobody caught (a ``sys.excepthook`` that chains the
previous one): the diagnosis is added to the traceback as a note and, under fleetrun, left in the
log folder for the launcher's ABORT message (:func:`fleetx.comm.api.write_fault`).
"""
from __future__ import annotations

import os
import re
import sys
import threading
import time
from typing import Any, Optional

import torch.distributed as dist

from fleetx import env
from fleetx.comm import progress
from fleetx.comm.api import Blame, write_fault
from fleetx.comm.progress import Call, Record

__all__ = ["diagnose", "is_collective_failure", "Watch"]

# What gloo, the c10d store and the DETAIL checks say when a collective cannot complete.
_FAILURE = re.compile(r"[Tt]imed out|timeout|Connection closed by peer|Connection reset by peer|"
                      r"failed to pass monitoredBarrier")
_NAMED = re.compile(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier")
# How many report intervals a failing rank waits for the store's answer before it concludes that
# the store's node is out of reach.
_STORE_WAIT_INTERVALS = 3
_COLLECTIVES = frozenset({
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
    "broadcast_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
    "all_to_all_single", "gather", "scatter", "barrier", "monitored_barrier"})


def is_collective_failure(exc: BaseException) -> bool:
    """True for the errors a collective raises when a peer is late, gone or diverged."""
    return isinstance(exc, RuntimeError) and bool(_FAILURE.search(str(exc)))


def _named_ranks(text: str) -> list[int]:
    """The ranks torch names in a monitored-barrier failure ("Ranks 1, 3 failed to pass")."""
    named = _NAMED.search(text)
    return [int(r) for r in named.group(1).split(",") if r.strip()] if named else []


def _python_call(exc: BaseException) -> tuple[Optional[str], Optional[str]]:
    """(operation, group name) of the torch.distributed function the traceback ends in, if any
    (DDP's gradient all-reduce runs in C++ and leaves none)."""
    op = group = None
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_name in _COLLECTIVES and code.co_filename.endswith("distributed_c10d.py"):
            op, pg = code.co_name, tb.tb_frame.f_locals.get("group")
            group = progress.group_name(pg)
        tb = tb.tb_next
    return op, group


def _failed_call(exc: BaseException, seqs: dict, calls: list[Call]) -> Optional[Call]:
    """The call that failed here: the traceback's, else the flight recorder's latest.

    Its number is this rank's count on its group, except under ``DETAIL`` where the checks run
    (and fail) before the call is counted, so it is the next one (a monitored barrier is
    counted before it waits either way).
    """
    op, group = _python_call(exc)
    if group is None and calls:
        group = calls[-1].group
        op = calls[-1].op if not _checked_first() else None
    if group is None or group not in seqs:
        return None
    seq = seqs[group] + (1 if _checked_first() and op != "monitored_barrier" else 0)
    known = [c for c in calls if c.group == group and c.seq == seq]
    if known and op in (None, known[-1].op):
        return known[-1]
    return Call(op or "collective call", group, seq)


def _checked_first() -> bool:
    return dist.get_debug_level() == dist.DebugLevel.DETAIL


def _op_of(call_number: int, failed: Call, calls: list[Call]) -> str:
    if call_number == failed.seq:
        return failed.op
    known = [c.op for c in calls if c.group == failed.group and c.seq == call_number]
    return known[-1] if known else "collective call"


def _late_peers(failed: Call, calls: list[Call], members: list[int],
                records: dict[int, Optional[Record]], rank: int,
                waited: float, interval: float, now: float) -> dict[int, str]:
    late = {}
    for peer in members:
        record = records.get(peer)
        if peer == rank or record is None:
            continue
        entered = record.seqs.get(failed.group)
        if record.time < failed.started and not record.silent(interval, now):
            continue  # reported before this call began and not silent since: no evidence
        if entered is not None and entered < failed.seq:
            late[peer] = (f"rank {peer} did not arrive at {_op_of(entered + 1, failed, calls)} "
                          f"#{entered + 1} on group {failed.group} (ranks {members}) within "
                          f"{waited:.0f} s; {record.state(interval, now)}")
    return late


def _read_records(store: Any, peers: list[int], wait: float
                  ) -> tuple[dict[int, Optional[Record]], bool]:
    """(every peer's record, whether the store answered within ``wait`` seconds).

    The reads run on a daemon thread: when the link to the store's node is down, a store read
    blocks while TCP retransmits (many minutes), and the diagnosis must not outlast the error
    it explains by more than ``wait``.
    """
    found: dict[int, Optional[Record]] = {}

    def read() -> None:
        for peer in peers:
            found[peer] = progress.read_record(store, peer)

    reader = threading.Thread(target=read, name="fleetx-blame-read", daemon=True)
    reader.start()
    reader.join(wait)
    return dict(found), not reader.is_alive()


def _unreachable(failed: Call, members: list[int], peers: list[int], rank: int,
                 waited: float, wait: float) -> Blame:
    """The finding when neither the peers nor the store answer: this rank lost the network to
    the node that holds the store (rank 0's), or that node is gone."""
    where = ""
    if env.is_set("MASTER_ADDR"):
        where = f" at {env.get('MASTER_ADDR')}:{env.get('MASTER_PORT') or '?'}"
    names = ", ".join(str(p) for p in peers)
    message = (f"rank{'s' if len(peers) > 1 else ''} {names} did not arrive at {failed.op} "
               f"#{failed.seq} on group {failed.group} (ranks {members}) within {waited:.0f} s, "
               f"and the job's store{where} did not answer for {wait:.0f} s: the network to "
               f"that node is down or the node is gone")
    return Blame(rank, os.getpid(), tuple(peers), message)


def diagnose(exc: BaseException, store: Any, rank: int, timeout: float,
             interval: float) -> Optional[Blame]:
    """Who made the collective that raised ``exc`` fail, or None when this rank cannot tell.

    Args:
        exc: the error a collective raised on this rank.
        store: the store the peers' beacons publish to.
        rank: this rank.
        timeout: the collective timeout in seconds (when the recorder does not say).
        interval: the beacons' report interval in seconds.
    """
    found = progress.groups()
    seqs, calls, now = progress.sequence_numbers(found), progress.recent_calls(), time.time()
    failed = _failed_call(exc, seqs, calls)
    members = found[failed.group][1] if failed is not None and failed.group in found else []
    peers = [r for r in members if r != rank]
    records, answered = _read_records(store, peers, _STORE_WAIT_INTERVALS * interval)
    if not answered and failed is not None:  # cut off from the store's node: blame that side
        return _unreachable(failed, members, peers, rank, failed.timeout or timeout,
                            _STORE_WAIT_INTERVALS * interval)
    late = {} if failed is None else _late_peers(failed, calls, members, records, rank,
                                                 failed.timeout or timeout, interval, now)
    for peer in _named_ranks(str(exc)):
        if peer not in late:
            call = f" at {failed.op} #{failed.seq} on group {failed.group}" if failed else ""
            record = records.get(peer) or progress.read_record(store, peer)
            state = f"; {record.state(interval, now)}" if record else ""
            late[peer] = f"rank {peer} did not arrive{call} within {timeout:.0f} s{state}"
    if not late:
        return None
    return Blame(rank, os.getpid(), tuple(sorted(late)), "; ".join(late[r] for r in sorted(late)))


class Watch:
    """This rank's beacon plus the excepthook that explains failed collectives.

    Args:
        store: the job's rendezvous store.
        rank: this rank.
        timeout: the collective timeout in seconds.
        log_dir: fleetrun's log folder (``FLEETX_LOG_DIR``), or None outside fleetrun.
        interval: seconds between progress reports.
    """

    def __init__(self, store: Any, rank: int, timeout: float, log_dir: Optional[str],
                 interval: float) -> None:
        self.store, self.rank, self.timeout, self.log_dir = store, rank, timeout, log_dir
        self.interval = interval
        self.beacon = progress.Beacon(store, rank, interval, stall_after=timeout / 3)
        self.reported: Optional[Blame] = None
        self._previous_hook = None

    def start(self) -> None:
        self.beacon.start()
        self._previous_hook, sys.excepthook = sys.excepthook, self._excepthook

    def stop(self) -> None:
        self.beacon.stop()
        if sys.excepthook == self._excepthook:
            sys.excepthook = self._previous_hook
        self._previous_hook = None

    def report(self, blame: Blame) -> None:
        """Record ``blame`` as this rank's latest finding and leave it for fleetrun (under
        fleetrun; the report of the error that ends the process is the one read)."""
        self.reported = blame
        if self.log_dir:
            try:
                write_fault(self.log_dir, blame)
            except OSError:
                pass  # the error's own message still names the rank

    def explain(self, exc: BaseException) -> Optional[Blame]:
        """Diagnose ``exc`` once (a note on it, and the report for fleetrun); the blame or None.
        Never raises: explaining must not hide the error it explains."""
        if hasattr(exc, "_fleetx_blame"):
            return exc._fleetx_blame
        reported = self.reported
        if reported is not None and reported.message in str(exc):
            return reported  # the same finding come back as another error (DDP's comm hook)
        blame = None
        if is_collective_failure(exc):
            try:
                blame = diagnose(exc, self.store, self.rank, self.timeout, self.interval)
            except Exception as problem:  # noqa: BLE001 - see the docstring
                _note(exc, f"fleetx: could not tell which rank is at fault: {problem!r}")
        try:
            exc._fleetx_blame = blame
        except AttributeError:  # an exception type without a __dict__: explained every time
            pass
        if blame is not None:
            _note(exc, f"fleetx: {blame.message}")
            self.report(blame)
        return blame

    def _excepthook(self, kind: type, exc: BaseException, tb: Any) -> None:
        cause = exc
        while cause is not None and not hasattr(cause, "_fleetx_blame"):
            cause = cause.__cause__ or cause.__context__
        if cause is None:
            self.explain(exc)
        elif cause._fleetx_blame is not None and cause._fleetx_blame != self.reported:
            self.report(cause._fleetx_blame)  # found where it was raised (an eval guard's)
        (self._previous_hook or sys.__excepthook__)(kind, exc, tb)


def _note(exc: BaseException, text: str) -> None:
    """Attach ``text`` to ``exc`` (printed under its traceback); Python 3.10 has no notes, so
    there it goes to stderr at once."""
    if hasattr(exc, "add_note"):
        exc.add_note(text)
    else:  # pragma: no cover - Python 3.10
        print(text, file=sys.stderr, flush=True)
