"""A Link's limits, on socket pairs with a raw peer: queued sends never block and drop a reader
too slow, frames over the size limit are refused on both sides, a frame has a deadline from its
first byte, and a peer's requests wait in its socket while the owner is behind."""
import socket
import threading
import time

import numpy as np
import pytest

from fleetx.ps.api import (HEADER, WIRE_MAGIC, WIRE_VERSION, Kind, Message, PeerLostError,
                           ProtocolError)
from fleetx.ps.transport import Link


class Owner:
    """Records what a Link hands over and why it ended."""

    def __init__(self):
        self.got, self.lost = [], []
        self.event = threading.Event()

    def message(self, link, msg):
        self.got.append(msg)
        self.event.set()

    def lost_(self, link, reason):
        self.lost.append(reason)
        self.event.set()

    def wait_lost(self, timeout=10.0):
        deadline = time.monotonic() + timeout
        while not self.lost and time.monotonic() < deadline:
            time.sleep(0.02)
        assert self.lost, "the link did not end"
        return self.lost


def link(sock, **kw):
    owner = Owner()
    kw.setdefault("dead_after", 5.0)
    dead_after = kw.pop("dead_after")
    return Link(sock, "peer", owner.message, owner.lost_, dead_after, **kw).start(), owner


def test_a_queued_link_never_blocks_and_drops_a_reader_that_falls_behind():
    mine, theirs = socket.socketpair()  # theirs never reads
    a, owner = link(mine, queued=True, max_queued_bytes=1 << 20)
    big = np.zeros(256 << 10, np.uint8)
    done = []

    def sender():
        try:
            for _ in range(200):
                a.send(Message(Kind.PULL, 1, {}, [big], flags=1))
        except PeerLostError as e:
            done.append(str(e))
    t = threading.Thread(target=sender)
    t.start()
    t.join(timeout=20)
    assert not t.is_alive(), "send() blocked on a peer that does not read"
    assert done and "reads too slowly" in done[0] and "(limit 1048576)" in done[0]
    assert owner.lost == [done[0].split(" lost: ", 1)[1]]  # told once
    theirs.close()


def test_a_queued_link_drops_a_peer_that_reads_nothing_for_dead_after():
    mine, theirs = socket.socketpair()
    a, owner = link(mine, queued=True, dead_after=1.0)
    peer = Link(theirs, "peer", lambda *_: None, lambda *_: None, 1.0)  # never started: it
    stop = threading.Event()                                             # sends, never reads

    def heartbeats():  # so the link does not end for silence instead
        while not stop.wait(0.2):
            peer.send(Message(Kind.HEARTBEAT))
    threading.Thread(target=heartbeats, daemon=True).start()
    a.send(Message(Kind.PULL, 1, {}, [np.zeros(16 << 20, np.uint8)], flags=1))  # returns
    t0 = time.monotonic()
    reason = owner.wait_lost()[0]
    stop.set()
    assert "reads nothing" in reason and 0.5 < time.monotonic() - t0 < 5
    theirs.close()


def test_queued_replies_are_sent_as_they_were_when_queued():
    mine, theirs = socket.socketpair()
    a, _ = link(mine, queued=True)
    b, got = link(theirs)
    rows = np.arange(4 << 20, dtype=np.float32)  # more than the socket takes at once
    a.send(Message(Kind.PULL, 1, {}, [rows], flags=1))
    rows[:] = -1  # the caller reuses its array at once
    assert got.event.wait(10)
    np.testing.assert_array_equal(got.got[0].bufs[0], np.arange(4 << 20, dtype=np.float32))


def test_frames_over_the_size_limit_are_refused_on_both_sides():
    mine, theirs = socket.socketpair()
    a, owner = link(mine, max_frame_bytes=1 << 20)
    with pytest.raises(ProtocolError, match="exceeds the limit of 1048576 bytes "
                                            r"\(FLEETX_PS_MAX_FRAME_MB\)"):
        a.send(Message(Kind.PUSH, 1, {}, [np.zeros(2 << 20, np.uint8)]))
    a.send(Message(Kind.PUSH, 2, {}, [np.zeros(16, np.uint8)]))  # the link is still up
    assert len(theirs.recv(4096)) == 32 + 16 + 2 + 16
    theirs.sendall(HEADER.pack(WIRE_MAGIC, WIRE_VERSION, int(Kind.PUSH), 0, 1, 1, 2, 2 << 20))
    assert "announces 2097152 bytes, more than the limit of 1048576" in owner.wait_lost()[0]


def test_a_frame_has_a_deadline_from_its_first_byte():
    mine, theirs = socket.socketpair()
    _, owner = link(mine, dead_after=1.0)
    head = HEADER.pack(WIRE_MAGIC, WIRE_VERSION, int(Kind.STATS), 0, 1, 0, 2, 0) + b"{}"
    t0 = time.monotonic()
    for b in head:  # a byte every 0.4 s: never silent for dead_after
        if owner.lost:
            break
        theirs.send(bytes([b]))
        time.sleep(0.4)
    assert "not complete within its deadline" in owner.wait_lost()[0]
    assert time.monotonic() - t0 < 4
    mine2, theirs2 = socket.socketpair()
    _, owner2 = link(mine2, dead_after=1.0)
    theirs2.sendall(HEADER.pack(WIRE_MAGIC, WIRE_VERSION, int(Kind.PUSH), 0, 1, 1, 2, 100))
    assert owner2.wait_lost()[0] == "no data for 1 s in the middle of a frame"


def test_a_peer_waits_in_its_socket_while_the_owner_is_behind():
    mine, theirs = socket.socketpair()
    a, owner = link(mine, max_inflight=2)
    b, _ = link(theirs)
    for i in range(5):
        b.send(Message(Kind.PULL, i))
    time.sleep(0.5)
    assert [m.req_id for m in owner.got] == [0, 1]
    a.handled()
    deadline = time.monotonic() + 5
    while len(owner.got) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.2)
    assert [m.req_id for m in owner.got] == [0, 1, 2]
    for _ in range(3):
        a.handled()
    deadline = time.monotonic() + 5
    while len(owner.got) < 5 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert [m.req_id for m in owner.got] == [0, 1, 2, 3, 4]
