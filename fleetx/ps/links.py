"""The authenticated connections of a service behind an :class:`~fleetx.ps.acceptor.Acceptor`
(a parameter server, a heter worker): bounded in number, kept alive by heartbeats, handed to
the owner's callbacks, and closed together.

The owner gives the link options (``on_message``, ``on_lost``, limits); :meth:`LinkSet.options`
returns them with ``on_lost`` wrapped, so that a lost link leaves the set and the heartbeats
before the owner hears of it.
"""
from __future__ import annotations

import threading
from typing import Any, Callable

from fleetx.ps.transport import Heartbeats, Link

__all__ = ["LinkSet"]


class LinkSet:
    """A service's connections.

    Args:
        limit: connections at most (:meth:`has_room` says no beyond it).
        heartbeat_interval: seconds between heartbeats on an idle link.
        done: once set, no connection is taken any more.
        options: keyword arguments of every :class:`~fleetx.ps.transport.Link`
            (``on_message``, ``on_lost``, ``dead_after``, ...).

    Example:
        >>> links = LinkSet(64, 1.0, done, {"on_message": put, "on_lost": lost,
        ...                                 "dead_after": 30.0})  # doctest: +SKIP
        >>> Acceptor(host, port, key, name, links.has_room, links.adopt).start()  # doctest: +SKIP
    """

    def __init__(self, limit: int, heartbeat_interval: float, done: threading.Event,
                 options: dict) -> None:
        self.limit, self.done = limit, done
        self._owner_lost: Callable[[Any, str], None] = options["on_lost"]
        self._options = {**options, "on_lost": self._lost}
        self._links: set = set()
        self._lock = threading.Lock()
        self._heartbeats = Heartbeats(heartbeat_interval)

    def options(self) -> dict:
        """The link options, ``on_lost`` wrapped (for a transport that builds its own links)."""
        return dict(self._options)

    def has_room(self) -> bool:
        """Another connection may be taken (the acceptor's ``has_room``)."""
        with self._lock:
            return len(self._links) < self.limit and not self.done.is_set()

    def adopt(self, sock: Any, peer: str) -> None:
        """An authenticated socket (the acceptor's ``adopt``): serve it as a link."""
        self.serve(Link(sock, f"connection from {peer}", **self._options))

    def serve(self, link: Any) -> None:
        """Keep ``link`` (any link with ``start``), beat on it when idle, start it."""
        with self._lock:
            self._links.add(link)
        self._heartbeats.add(link)
        link.start()

    def close(self) -> None:
        """Close every link and stop the heartbeats."""
        with self._lock:
            links, self._links = list(self._links), set()
        for link in links:
            link.close()
        self._heartbeats.stop()

    def _lost(self, link: Any, reason: str) -> None:
        self._heartbeats.discard(link)
        with self._lock:
            self._links.discard(link)
        self._owner_lost(link, reason)
