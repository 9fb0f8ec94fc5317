"""Collective progress: how far each rank has got, published so that a failing rank can tell
which peer never arrived.

torch numbers the collectives of every process group (``_get_sequence_number_for_group``: the
calls this rank has entered on it) and, for gloo and NCCL, keeps a flight recorder of the
recent calls (operation, group, sequence number, shapes, dtypes, start time). Neither crosses
processes, so every rank runs a :class:`Beacon`: a daemon thread that writes the rank's sequence
numbers to the rendezvous store once an ``interval`` (about one small ``set`` per second). When a
rank's numbers have not moved for ``stall_after`` seconds (a third of the collective timeout) it
also publishes its latest call, read from its flight recorder once per stall (a full dump costs
~50 ms, too much to pay every second or at every slow step).

A rank that sleeps, computes or waits elsewhere keeps publishing (the thread runs while the main
thread is in Python or a blocking call); one frozen in C code that holds the interpreter lock,
or dead, stops, and the age of its last report says so.
"""
from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Optional

import torch.distributed as dist

__all__ = ["Call", "Record", "Beacon", "groups", "group_name", "sequence_numbers",
           "recent_calls", "read_record"]

_KEY = "progress/{rank}"
# A peer silent for this many report intervals is frozen or gone, not merely busy.
_SILENT_INTERVALS = 3


@dataclass(frozen=True)
class Call:
    """One collective call as the flight recorder saw it.

    Attributes:
        op: the operation (``all_reduce``, ``broadcast``...).
        group: the process group's name (``"0"`` is the default group).
        seq: its number on that group (1 is the group's first call).
        shapes, dtypes: of its input tensors.
        started: wall-clock time it was entered (seconds).
        timeout: the group's timeout in seconds (0 when unknown).
    """

    op: str
    group: str
    seq: int
    shapes: tuple = ()
    dtypes: tuple = ()
    started: float = 0.0
    timeout: float = 0.0

    def describe(self) -> str:
        """``all_reduce #21 (float32 [5])``."""
        tensors = ", ".join(f"{d} {list(s)}" for d, s in zip(self.dtypes, self.shapes))
        return f"{self.op} #{self.seq}" + (f" ({tensors})" if tensors else "")


@dataclass(frozen=True)
class Record:
    """What one rank last published.

    Attributes:
        rank, pid: who published it.
        time: when (wall clock, seconds).
        seqs: calls entered so far, by group name.
        latest: its most recent call, published only once its numbers stopped moving.
    """

    rank: int
    pid: int
    time: float
    seqs: dict
    latest: Optional[Call] = None

    def silent(self, interval: float, now: float) -> bool:
        """Whether the rank has missed several reports: it is frozen or gone, not busy."""
        return now - self.time > _SILENT_INTERVALS * interval

    def state(self, interval: float, now: float) -> str:
        """``it is alive (reported 0.4 s ago), its latest call: ...`` or, when it has been
        silent for several intervals, that it stopped."""
        age = now - self.time
        if self.silent(interval, now):
            return f"it has not reported for {age:.0f} s (stopped, frozen or gone)"
        latest = self.latest
        where = (f", its latest call: {latest.describe()} on group {latest.group}, entered "
                 f"{now - latest.started:.0f} s ago" if latest else "")
        return f"it is alive (reported {age:.1f} s ago){where}"


def groups() -> dict[str, tuple[Any, list[int]]]:
    """Every process group this rank belongs to, by name, with the global ranks in it."""
    # torch keeps no public registry of groups; _world is where new_group records them.
    world = dist.distributed_c10d._world
    return {name: (pg, sorted(world.pg_group_ranks.get(pg, {})))
            for pg, name in list(world.pg_names.items())}


def group_name(pg: Any) -> Optional[str]:
    """The name reports use for process group ``pg`` (None: the default group), or None when
    this rank is not in it."""
    try:
        pg = pg if pg is not None else dist.group.WORLD
        return dist.distributed_c10d._world.pg_names.get(pg)
    except (AttributeError, RuntimeError):
        return None


def sequence_numbers(found: Optional[dict] = None) -> dict[str, int]:
    """Collective calls this rank has entered, by group name."""
    seqs = {}
    for name, (pg, _) in (found if found is not None else groups()).items():
        try:
            seqs[name] = int(pg._get_sequence_number_for_group())
        except RuntimeError:  # a backend that does not number its calls
            continue
    return seqs


def recent_calls() -> list[Call]:
    """This process's recent collective calls from torch's flight recorder, oldest first
    (empty when the recorder is off: ``TORCH_FR_BUFFER_SIZE=0``)."""
    try:
        from torch._C._distributed_c10d import _dump_fr_trace_json
        entries = json.loads(_dump_fr_trace_json(True, False)).get("entries", [])
    except (ImportError, RuntimeError, ValueError):
        return []
    calls = [_call(e) for e in entries if not e.get("is_p2p")]
    return sorted((c for c in calls if c is not None), key=lambda c: c.started)


# The recorder writes c10's scalar names; messages use torch's, as tensors print them.
_DTYPES = {"Float": "float32", "Double": "float64", "Half": "float16", "BFloat16": "bfloat16",
           "Long": "int64", "Int": "int32", "Short": "int16", "Char": "int8", "Byte": "uint8",
           "Bool": "bool"}


def _call(entry: dict) -> Optional[Call]:
    try:
        group = str(entry["process_group"][0])
        op = str(entry["profiling_name"]).rpartition(":")[2]
        return Call(op, group, int(entry["collective_seq_id"]),
                    tuple(tuple(s) for s in entry.get("input_sizes", ())),
                    tuple(_DTYPES.get(d, d) for d in entry.get("input_dtypes", ())),
                    int(entry.get("time_created_ns", 0)) / 1e9,
                    int(entry.get("timeout_ms", 0)) / 1000)
    except (KeyError, IndexError, TypeError, ValueError):
        return None


def read_record(store: Any, rank: int) -> Optional[Record]:
    """What ``rank`` last published, or None when it never did (or the store is gone)."""
    key = _KEY.format(rank=rank)
    try:
        if not store.check([key]):
            return None
        data = json.loads(store.get(key))
        latest = data.get("latest")
        return Record(int(data["rank"]), int(data["pid"]), float(data["time"]),
                      {str(k): int(v) for k, v in data["seqs"].items()},
                      Call(**{**latest, "shapes": tuple(tuple(s) for s in latest["shapes"]),
                              "dtypes": tuple(latest["dtypes"])}) if latest else None)
    except (RuntimeError, ValueError, KeyError, TypeError):
        return None


class Beacon:
    """Publishes this rank's collective progress to ``store`` every ``interval`` seconds.

    Args:
        store: the job's rendezvous store (a client; thread-safe).
        rank: this process's global rank.
        interval: seconds between reports; keep it well below the collective timeout.
        stall_after: seconds without a new call after which the report says where the rank is.

    Example (what :class:`~fleetx.comm.groups.ProcessGroups` does at join)::

        beacon = Beacon(store, rank, interval=1.0, stall_after=100.0)
        beacon.start()
        ...
        beacon.stop()
    """

    def __init__(self, store: Any, rank: int, interval: float, stall_after: float) -> None:
        self.store, self.rank, self.interval, self.stall_after = store, rank, interval, stall_after
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._previous: Optional[dict] = None
        self._moved = time.monotonic()
        self._latest: Optional[Call] = None
        self._looked = False  # whether this stall's latest call was read already

    def start(self) -> None:
        self.publish()
        # A daemon: a normal exit must not wait for it (stop() ends it first at atexit).
        self._thread = threading.Thread(target=self._run, name="fleetx-beacon", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval + 1.0)
        self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.publish()
            except (RuntimeError, OSError):  # the store is gone: the job is ending
                return

    def publish(self) -> None:
        """Write one report now."""
        seqs, now = sequence_numbers(), time.monotonic()
        if seqs != self._previous:
            self._previous, self._moved, self._latest, self._looked = seqs, now, None, False
        elif not self._looked and now - self._moved >= self.stall_after:
            calls = recent_calls()  # stalled: say where, once
            self._latest, self._looked = (calls[-1] if calls else None), True
        record = {"rank": self.rank, "pid": os.getpid(), "time": time.time(), "seqs": seqs,
                  "latest": asdict(self._latest) if self._latest else None}
        self.store.set(_KEY.format(rank=self.rank), json.dumps(record))
