"""fleetrun's end-of-job summary: one line per process this node started, printed to stderr.

Columns: role, rank (index within the role), exit status in words, wall time, peak RSS and
throughput. fleetrun measures the first four itself: wall time from the process's start to the
moment it saw it exit (to its 0.1 s poll), peak RSS as ``VmHWM`` of ``/proc/<pid>/status`` (the
kernel's high-water mark of the resident set, so a peak between two polls still counts), read
at every poll while the process runs (Linux; ``-`` elsewhere, or for a process that ended
before its first poll). Throughput is the samples/s a worker reported through
``fleet.observe`` (``<log_dir>/throughput.<index>``, :mod:`fleetx.observe.api`); ``-`` when it
reported none. Step p50 / p99 are the wall time of a worker's optimizer steps and busy p50
the part of it before the rank waited for the others' gradients (``<log_dir>/steptimes.<index>``,
:mod:`fleetx.observe.steptimes`; a rank far above the others in busy p50 held them back);
``-`` for a process that took no step through a fleet optimizer.
"""
from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from typing import Callable, Hashable, Optional

from fleetx.observe.api import read_throughput
from fleetx.observe.steptimes import read_step_times

__all__ = ["ProcessWatch", "SummaryRow", "peak_rss_kb", "exit_words", "format_table"]


def peak_rss_kb(pid: int) -> Optional[int]:
    """``VmHWM`` of a running process in KiB, or None (gone, or no ``/proc``)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def exit_words(code: Optional[int]) -> str:
    """``ok``, ``failed (exit 3)``, ``killed (SIGKILL)``, or ``stopped`` for None (fleetrun
    stopped it and never learnt its status: the elastic agent reports only the failed ones)."""
    if code is None:
        return "stopped"
    if code == 0:
        return "ok"
    if code < 0:
        try:
            return f"killed ({signal.Signals(-code).name})"
        except ValueError:
            return f"killed (signal {-code})"
    return f"failed (exit {code})"


@dataclass
class SummaryRow:
    """One process in the table."""

    role: str
    rank: int
    exit_code: Optional[int] = None
    wall_s: float = 0.0
    peak_rss_kb: Optional[int] = None
    samples_per_s: Optional[float] = None
    step_times: Optional[tuple[float, float, float]] = None  # wall p50, wall p99, busy p50


class ProcessWatch:
    """What fleetrun saw of each process: started, polled, ended (restarts: one row per
    process slot, wall time from its first start, the largest peak of its runs).

    Args:
        clock: seconds, monotonic (tests pass their own).

    Example:
        >>> watch = ProcessWatch()
        >>> watch.started(("worker", 0), 4242)
        >>> watch.poll(("worker", 0), 4242, None)   # each poll; the code once it exited
        >>> print(format_table(watch.rows(log_dir)))
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._rows: dict[Hashable, SummaryRow] = {}
        self._start: dict[Hashable, float] = {}
        self._pid: dict[Hashable, int] = {}

    def started(self, key: tuple[str, int], pid: int) -> None:
        """``key`` (role, rank) runs as ``pid`` from now (again, after a restart)."""
        if key not in self._rows:
            self._rows[key] = SummaryRow(key[0], key[1])
            self._start[key] = self._clock()
        self._rows[key].exit_code = None
        self._pid[key] = pid

    def poll(self, key: tuple[str, int], pid: int, code: Optional[int]) -> None:
        """Record a poll: ``code`` None while the process runs, its exit code once it ended."""
        if self._pid.get(key) != pid:
            self.started(key, pid)
        row = self._rows[key]
        if code is None:
            rss = peak_rss_kb(pid)
            if rss is not None:
                row.peak_rss_kb = max(row.peak_rss_kb or 0, rss)
            row.wall_s = self._clock() - self._start[key]
        elif row.exit_code is None:
            row.exit_code = code
            row.wall_s = self._clock() - self._start[key]

    def rows(self, log_dir: Optional[str] = None) -> list[SummaryRow]:
        """The rows in role then rank order, with the throughput workers reported."""
        out = sorted(self._rows.values(), key=lambda r: (r.role, r.rank))
        if log_dir:
            for row in out:
                if row.role in ("trainer", "worker"):
                    row.samples_per_s = read_throughput(log_dir, row.rank)
                    row.step_times = read_step_times(log_dir, row.rank)
        return out


def _rss(kb: Optional[int]) -> str:
    if kb is None:
        return "-"
    return f"{kb / 1024:.1f} MiB" if kb < 1 << 20 else f"{kb / (1 << 20):.2f} GiB"


def _steps(times: Optional[tuple[float, float, float]]) -> tuple[str, str, str]:
    if times is None:
        return ("-", "-", "-")
    return tuple(f"{t * 1000:.3g} ms" if t < 1 else f"{t:.3g} s" for t in times)  # type: ignore


def format_table(rows: list[SummaryRow]) -> str:
    """The table as text, a title line first."""
    head = ("role", "rank", "exit status", "wall time", "peak RSS", "samples/s", "step p50",
            "step p99", "busy p50")
    body = [(r.role, str(r.rank), exit_words(r.exit_code), f"{r.wall_s:.1f} s", _rss(r.peak_rss_kb),
             "-" if r.samples_per_s is None else f"{r.samples_per_s:.1f}", *_steps(r.step_times))
            for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join(["fleetrun: job summary", line(head), *map(line, body)])
