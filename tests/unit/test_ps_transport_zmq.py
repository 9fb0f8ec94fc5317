"""The ZeroMQ transport kept for comparison: loopback only, and a peer's bad or silent frames end
only that peer's link (raw pyzmq sockets send the faults)."""
import queue
import threading
import time

import numpy as np
import pytest

zmq = pytest.importorskip("zmq")

from fleetx.ps.api import (HEADER, WIRE_MAGIC, WIRE_VERSION, PSConfigError, Kind,  # noqa: E402
                           Message, encode_frame)
from fleetx.ps.transport_zmq import Listener, connect_link  # noqa: E402


class Server:
    """A Listener whose links answer every request with its buffers doubled."""

    def __init__(self, dead_after=30.0, max_frame_bytes=1 << 20):
        self.lost: queue.Queue = queue.Queue()
        self.links = []
        options = {"on_message": self._answer, "on_lost": lambda l, r: self.lost.put((l, r)),
                   "dead_after": dead_after, "max_frame_bytes": max_frame_bytes,
                   "queued": True}
        self.listener = Listener("127.0.0.1", 0, "server", lambda: True, self.links.append,
                                 options).start()

    def _answer(self, link, msg):
        link.send(msg.reply({"n": len(msg.bufs)}, [b * 2 for b in msg.bufs]))

    def raw_peer(self):
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{self.listener.endpoint}")
        return sock


@pytest.fixture
def server():
    s = Server()
    yield s
    s.listener.close()


def test_both_ends_refuse_an_address_that_is_not_loopback():
    with pytest.raises(PSConfigError, match="10.1.2.3 is not a loopback address"):
        Listener("10.1.2.3", 0, "server 0", lambda: True, lambda link: None, {})
    with pytest.raises(PSConfigError, match="server 1: .*10.1.2.3 is not a loopback address"):
        connect_link("10.1.2.3", 6000, "server 1", 1.0, None, None, 5.0)


def test_a_request_travels_and_its_reply_lands_in_the_target(server):
    target = np.zeros(200_000, np.float32)  # above pyzmq's copy threshold: zero-copy sends
    replies: queue.Queue = queue.Queue()
    link = connect_link("127.0.0.1", server.listener.port, "server 0", 10.0,
                        lambda l, m: replies.put(m), lambda l, r: replies.put(r), 10.0,
                        allocator=lambda m, d: [target]).start()
    try:
        values = np.arange(200_000, dtype=np.float32)
        link.send(Message(Kind.PULL, 7, {"x": 1}, [values]))
        reply = replies.get(timeout=10)
        assert reply.req_id == 7 and reply.meta == {"n": 1} and reply.bufs[0] is target
        np.testing.assert_array_equal(target, values * 2)
    finally:
        link.close()


def test_a_malformed_frame_ends_only_that_peers_link(server):
    good = server.raw_peer()
    good.send_multipart(encode_frame(Message(Kind.HEARTBEAT), 1 << 20))
    bad = server.raw_peer()
    bad.send_multipart([b"GARBAGE!" * 4])  # 32 bytes with another magic
    link, reason = server.lost.get(timeout=10)
    assert "protocol error: bad magic" in reason
    deadline = time.monotonic() + 10  # the two peers' first frames arrive in either order
    while len(server.links) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(server.links) == 2 and [l for l in server.links if l.closed] == [link]
    good.close()
    bad.close()


def test_a_header_above_the_frame_limit_is_refused(server):
    peer = server.raw_peer()
    huge = HEADER.pack(WIRE_MAGIC, WIRE_VERSION, Kind.PUSH, 0, 1, 0, 0, 1 << 40)
    peer.send_multipart([huge])
    _, reason = server.lost.get(timeout=10)
    assert "more than the limit" in reason
    peer.close()


def test_a_silent_peer_is_lost_after_dead_after():
    s = Server(dead_after=1.0)
    try:
        peer = s.raw_peer()
        t0 = time.monotonic()
        peer.send_multipart(encode_frame(Message(Kind.HEARTBEAT), 1 << 20))
        _, reason = s.lost.get(timeout=20)
        assert "no frame or heartbeat for 1 s" in reason
        assert time.monotonic() - t0 < 15  # generous: one receive tick after dead_after
        peer.close()
    finally:
        s.listener.close()


def test_threads_sending_at_once_all_get_answers(server):
    """Sends from several threads and the receive thread share one socket under its lock."""
    replies: queue.Queue = queue.Queue()
    link = connect_link("127.0.0.1", server.listener.port, "server 0", 10.0,
                        lambda l, m: replies.put(m.req_id), lambda l, r: replies.put(r),
                        10.0).start()

    def send(base):
        for i in range(50):
            link.send(Message(Kind.PUSH, base + i, {}, [np.ones(1000, np.float32)]))
    threads = [threading.Thread(target=send, args=(k * 100,)) for k in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        got = sorted(replies.get(timeout=10) for _ in range(200))
        assert got == sorted(k * 100 + i for k in range(4) for i in range(50))
    finally:
        link.close()
