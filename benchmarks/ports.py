"""What the benchmarks that start their own process groups share: a free TCP port on loopback,
and ``start_processes``, torch's spawn whose processes end without interpreter teardown.

Why the second: a process that ran a gloo collective inside backward can abort at interpreter
shutdown ("terminate called without an active exception": a gloo thread frees a work object
that needs the GIL while the interpreter finalizes; ``docs/reliability.md``). fleetrun ends the
processes it starts with ``exit_cleanly``; processes that torch's spawn starts end through
``sys.exit``, so ``start_processes`` ends each of them the same way fleetrun does.
"""
from __future__ import annotations

import socket
from typing import Any, Callable

import torch.multiprocessing as mp

from fleetx.launch.script import exit_cleanly


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports on 127.0.0.1 nobody listens on now (the OS picks them, all bound at
    once so no two are the same; they may be taken later)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    """A port on 127.0.0.1 nobody listens on now (the OS picks it; it may be taken later)."""
    return free_ports(1)[0]


def start_processes(fn: Callable, args: tuple, nprocs: int, **kwargs: Any) -> Any:
    """``torch.multiprocessing.start_processes(fn, args, nprocs, ...)`` (spawn by default);
    each process that returns from ``fn(rank, *args)`` ends with ``exit_cleanly(0)``."""
    kwargs.setdefault("start_method", "spawn")
    return mp.start_processes(_ended_cleanly, args=(fn, *args), nprocs=nprocs, **kwargs)


def _ended_cleanly(rank: int, fn: Callable, *args: Any) -> None:
    fn(rank, *args)
    exit_cleanly(0)
