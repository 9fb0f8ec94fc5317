"""What several test folders share (no tests here): loopback ports.

Import it as the tests import their neighbours, by putting this folder on ``sys.path``::

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from helpers import free_ports
"""
from __future__ import annotations

import socket


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
