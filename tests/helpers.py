"""What several test folders share (no tests here): loopback ports, an example's modules, a
finished request.

Import it as the tests import their neighbours, by putting this folder on ``sys.path``::

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from helpers import free_ports
"""
from __future__ import annotations

import contextlib
import socket
import sys
from pathlib import Path
from typing import Iterator


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports that were free a moment ago (all bound at once, so no two
    are the same, then released for the caller to use)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    """One loopback port that was free a moment ago."""
    return free_ports(1)[0]


@contextlib.contextmanager
def example_modules(folder: Path) -> Iterator[None]:
    """Import an example's modules by their plain names (``import data``, ``import model``)
    inside the block, whatever another example of the same module names left in
    ``sys.modules``; the previous modules and ``sys.path`` come back afterwards."""
    names = {p.stem for p in Path(folder).glob("*.py")}
    saved = {n: sys.modules.pop(n) for n in list(sys.modules) if n in names}
    sys.path.insert(0, str(folder))
    try:
        yield
    finally:
        sys.path.remove(str(folder))
        for n in names:
            sys.modules.pop(n, None)
        sys.modules.update(saved)


class Done:
    """A client request that has finished with ``result`` already (``wait`` returns it at
    once), for fakes of the parameter-server client."""

    def __init__(self, result) -> None:
        self.result = result

    def wait(self, timeout=None):
        return self.result

    def done(self) -> bool:
        return True
