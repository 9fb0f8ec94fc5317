"""A free TCP port on loopback, for the benchmarks that start their own process groups."""
from __future__ import annotations

import socket


def free_port() -> int:
    """A port on 127.0.0.1 nobody listens on now (the OS picks it; it may be taken later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
