"""LinkSet: the connections of a server or a heter worker, bounded, closed together, a lost one
leaving the set before its owner hears of it."""
from __future__ import annotations

import threading

from fleetx.ps.links import LinkSet


class FakeLink:
    def __init__(self) -> None:
        self.started = self.closed = False
        self.last_send = float("inf")  # never idle: no heartbeat is sent

    def start(self) -> None:
        self.started = True

    def close(self) -> None:
        self.closed = True


def test_bounded_lost_and_closed_together():
    heard, done = [], threading.Event()
    links = LinkSet(2, 0.05, done, {"on_lost": lambda link, why: heard.append(
        (link, why, links.has_room()))})
    a, b = FakeLink(), FakeLink()
    assert links.has_room()
    links.serve(a)
    links.serve(b)
    assert a.started and b.started and not links.has_room()  # the limit
    links.options()["on_lost"](a, "connection closed by peer")
    assert heard == [(a, "connection closed by peer", True)]  # out before the owner hears
    done.set()
    assert not links.has_room()  # a service that is done takes nobody
    links.close()
    assert b.closed and not a.closed
