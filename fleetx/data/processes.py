"""The processes a dataset starts (pipe commands, reader processes) and how they end.

They stay in the worker's process group, so that fleetrun's guardian, which SIGKILLs the
worker's group when the worker exits, takes them (and whatever they started) along. Each one
also asks the kernel to SIGKILL it when the thread that started it dies
(``PR_SET_PDEATHSIG``, Linux), which covers a worker killed alone (``kill -9 <pid>``): a reader
process dies with the worker, its pipe commands die with it. Stopping one early (a consumer
that broke off) kills the process and every descendant it has, found through ``/proc``, since
they share the worker's group and cannot be reached with ``killpg``.
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from typing import Any, Callable, Optional

__all__ = ["start", "stop_tree", "descendants", "kill_descendants"]

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# looked up once here: the child must not load a library between fork and exec
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
_STOP_ROUNDS = 20  # passes over the tree: a process may fork between a pass and its SIGSTOP


def _die_with(parent: int) -> Optional[Callable[[], None]]:
    """The preexec function: ask for SIGKILL when the parent dies; exit at once if the parent
    is gone already (it died between the fork and the request: no signal would come)."""
    if _PRCTL is None:  # pragma: no cover - not Linux: the guardian's group kill still applies
        return None

    def preexec() -> None:
        _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)
    return preexec


def start(args: Any, **popen: Any) -> subprocess.Popen:
    """``subprocess.Popen(args, **popen)`` in this process's group, killed with its parent.

    Example::

        child = start("cat part-0 | sort", shell=True, stdout=subprocess.PIPE)
    """
    return subprocess.Popen(args, preexec_fn=_die_with(os.getpid()), **popen)


def descendants(pid: int) -> list:
    """The pids of every living descendant of ``pid`` (children first), read from ``/proc``."""
    children: dict = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b") ", 1)[1].split()
        except (OSError, IndexError):  # it ended while we looked
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def _signal_all(pids: list, sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:  # it ended meanwhile
            pass


def _kill_tree(root: int, with_root: bool) -> None:
    """SIGKILL the descendants of ``root`` (and ``root`` itself with ``with_root``), frozen
    (SIGSTOP) first: a killed parent's children are handed to init at once and could no
    longer be found."""
    frozen: set = set()
    for _ in range(_STOP_ROUNDS):
        tree = set(([root] if with_root else []) + descendants(root)) - frozen
        if not tree:
            break
        _signal_all(sorted(tree), signal.SIGSTOP)
        frozen |= tree
    _signal_all(sorted(frozen), signal.SIGKILL)


def stop_tree(process: subprocess.Popen) -> None:
    """Kill ``process`` and all its descendants, then reap it."""
    if process.poll() is None:
        _kill_tree(process.pid, with_root=True)
    process.wait()


def kill_descendants() -> None:
    """Kill every descendant of this process (its commands and theirs), not itself: what a
    process stopped by a signal does before it exits, without unwinding."""
    _kill_tree(os.getpid(), with_root=False)
