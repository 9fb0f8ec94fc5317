"""The contract of ``fleetx.comm``: its errors and the fault report a rank leaves for fleetrun.

When a collective fails on one rank because another never arrived, the rank that waited is the
one that raises, so the launcher, which sees only exit codes, would blame it. The failing rank
therefore works out who did not arrive (``progress.py``) and, when it runs under fleetrun,
writes a :class:`Blame` to ``<log dir>/fault.<rank>.json``; fleetrun reads it when it reports
the failure. This module imports nothing heavy: the launcher reads the report without torch.

It also holds the package's one piece of process-wide state, the collective-call checker
(:func:`set_checker`): the world's process groups (``groups.py``) install it when
``FLEETX_DEBUG_COLLECTIVES=1`` and remove it when they are torn down, and :func:`check_call`
consults it before each collective fleetx makes. It is process-wide, like torch's default
process group, because the DDP comm hooks that make those calls are built by strategies with no
handle on the process groups.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Any, Optional, Protocol, Sequence

__all__ = ["CommError", "Blame", "fault_path", "write_fault", "read_fault", "CallChecker",
           "set_checker", "check_call", "checking"]


class CommError(RuntimeError):
    """A peer could not be reached in time, or the ranks diverged (the message names them)."""


@dataclass(frozen=True)
class Blame:
    """Which ranks made a collective fail, as worked out by the rank that raised.

    Attributes:
        reporter: the rank that raised (it waited for the others).
        pid: its process id, so a report left by an earlier job is never read as this one's.
        ranks: the ranks at fault, in order.
        message: one line naming them and the call, e.g. ``rank 1 did not arrive at
            all_reduce #21 (group 0, ranks [0, 1]) within 20 s``.
    """

    reporter: int
    pid: int
    ranks: tuple
    message: str


def fault_path(log_dir: str, rank: int) -> str:
    """Where rank ``rank`` leaves its :class:`Blame` in fleetrun's log folder."""
    return os.path.join(log_dir, f"fault.{rank}.json")


def write_fault(log_dir: str, blame: Blame) -> None:
    """Write ``blame`` for fleetrun (atomically: the launcher may read at any moment)."""
    path = fault_path(log_dir, blame.reporter)
    tmp = f"{path}.{blame.pid}.tmp"
    with open(tmp, "w") as f:
        json.dump(asdict(blame), f)
    os.replace(tmp, path)


def read_fault(log_dir: str, rank: int, pid: int) -> Optional[Blame]:
    """The :class:`Blame` that process ``pid`` (rank ``rank``) left, or None when there is none,
    it is unreadable, or it was left by another process."""
    try:
        with open(fault_path(log_dir, rank)) as f:
            data = json.load(f)
        blame = Blame(int(data["reporter"]), int(data["pid"]),
                      tuple(int(r) for r in data["ranks"]), str(data["message"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return blame if blame.pid == pid and blame.reporter == rank else None


class CallChecker(Protocol):
    """What ``FLEETX_DEBUG_COLLECTIVES=1`` installs (:class:`fleetx.comm.debug.Checker`)."""

    def check(self, op: str, group: Any, tensors: Sequence[Any]) -> None: ...


_checker: Optional[CallChecker] = None


def set_checker(checker: Optional[CallChecker]) -> None:
    """Install (or, with None, remove) the checker :func:`check_call` consults."""
    global _checker
    _checker = checker


def check_call(op: str, group: Any, tensors: Sequence[Any]) -> None:
    """Before a collective: with the debug checks on, raise :class:`CommError` unless every
    rank of ``group`` is about to make the same call; otherwise do nothing.

    Example (what the gradient pipeline does before each bucket's all-reduce)::

        check_call("all_reduce", group, [tensor])
        dist.all_reduce(tensor, group=group)
    """
    if _checker is not None:
        _checker.check(op, group, tensors)


def checking() -> bool:
    """Whether the debug checks are on in this process."""
    return _checker is not None
