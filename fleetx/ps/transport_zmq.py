"""A ZeroMQ transport for the parameter server, to measure against the TCP links: loopback only.

``FLEETX_PS_TRANSPORT=zmq`` (``PSConfig.transport``) makes servers and workers talk through
pyzmq instead of :mod:`fleetx.ps.transport`, so that ``benchmarks/ps_ctr.py --transports
tcp,zmq`` can weigh the two on the real workload (``docs/parameter_server.md`` §13). It exists
for that comparison only: it runs no shared-secret handshake, so both ends refuse any endpoint
that is not a loopback address; and it has no per-peer limit on requests waiting for the
handler (the TCP server's ``max_inflight``). A production ZeroMQ transport would authenticate
every peer with CURVE (a key pair per server, checked by a ZAP handler).

Shape (ps-lite's ``Van`` is ZeroMQ too):

* a server binds one ROUTER socket on its endpoint (:class:`Listener`); one thread receives from
  it and turns each peer identity into a :class:`ZmqLink` on its first frame, greeting it with a
  HEARTBEAT;
* a worker connects one DEALER socket per server (:func:`connect_link`), each a
  :class:`ZmqLink` with its own receive thread, as a TCP ``Link`` has.

A frame is the wire format of :mod:`fleetx.ps.wire` as one multipart message: part 0 holds the
header, descriptors and JSON meta, then one part per non-empty buffer. ZeroMQ sends after
``send`` returns, so an array that owns its memory goes zero-copy (``copy=False``), while a view
into memory its owner may change later (a live dense table, a caller's gradient) is copied
first, by pyzmq (``copy=True``). Received buffers are numpy views of ZeroMQ's own message memory
(no copy), or are copied once into the receiver's preallocated targets (``allocator``), where a
TCP link receives in place.

ZeroMQ sockets are not thread-safe, and handler, heartbeat and communicator threads all send: so
every call on a socket is made under its lock, the receive thread waits on the socket's file
descriptor (``zmq.FD``) outside the lock, and a sender that finds input pending after its send
(a send may consume the descriptor's wake-up) wakes the receive thread through a pipe.

Liveness as with TCP links: heartbeats on idle links (:class:`fleetx.ps.transport.Heartbeats`);
a link that hears nothing for ``dead_after`` is lost. A send to a peer that is gone, or whose
queue is full (``SNDHWM`` messages, ``ROUTER_MANDATORY``), ends that peer's link, as the TCP
server drops a slow reader, instead of ZeroMQ's default of dropping the message in silence.
ZeroMQ reconnects by itself, so a dead peer is noticed by its silence after ``dead_after``, not
at once from a connection reset.
"""
from __future__ import annotations

import json
import logging
import os
import select
import threading
import time
from typing import Callable, Optional

import numpy as np

from fleetx.ps.acceptor import RateLimitedLog
from fleetx.ps.api import (DEFAULT_MAX_FRAME_BYTES, DESCRIPTOR, HEADER, MAX_BUFFERS,
                           MAX_META_BYTES, PSConfigError, Kind, Message, PeerLostError,
                           ProtocolError, PSTimeoutError, encode_frame, parse_header,
                           read_descriptors)
from fleetx.ps.handshake import is_loopback

try:
    import zmq
except ImportError:  # optional: the bench extra (pip install -e '.[bench]')
    zmq = None

__all__ = ["ZmqLink", "Listener", "connect_link"]

log = logging.getLogger("fleetx.ps")

_TICK = 0.25     # seconds a receive thread sleeps at most before it looks at deadlines
_HWM = 1000      # messages queued per peer and direction; a server drops a peer beyond it
_BATCH = 64      # messages taken per hold of a socket's lock, so senders get their turn
_HEAD_MAX = HEADER.size + MAX_BUFFERS * DESCRIPTOR.size + MAX_META_BYTES


def _check_usable(host: str, who: str) -> None:
    """Raises: PSConfigError: pyzmq is missing, or ``host`` is not a loopback address."""
    if zmq is None:
        raise PSConfigError(f"{who}: FLEETX_PS_TRANSPORT=zmq needs pyzmq (pip install "
                          "pyzmq, or the bench extra); or use FLEETX_PS_TRANSPORT=tcp")
    if not is_loopback(host):
        raise PSConfigError(f"{who}: FLEETX_PS_TRANSPORT=zmq authenticates no one and is for "
                          f"loopback comparisons only; {host} is not a loopback address (use "
                          "FLEETX_PS_TRANSPORT=tcp)")


def _configure(sock, max_frame_bytes: int) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, _HWM)
    sock.setsockopt(zmq.RCVHWM, _HWM)
    # a part larger than this ends the connection before ZeroMQ allocates it
    sock.setsockopt(zmq.MAXMSGSIZE, max(max_frame_bytes, _HEAD_MAX))


class _Socket:
    """A ZeroMQ socket shared by threads: every call under one lock (see the module docstring)."""

    def __init__(self, sock) -> None:
        self.sock, self.lock = sock, threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poll = select.poll()
        self._poll.register(sock.getsockopt(zmq.FD), select.POLLIN)
        self._poll.register(self._wake_r, select.POLLIN)
        self._more = False
        self._open = True

    def send(self, parts: list, copies: list) -> None:
        """One multipart message, without waiting.

        Raises:
            zmq.Again: the peer's queue is full. zmq.ZMQError: the peer is gone (a ROUTER's
                EHOSTUNREACH) or the socket is closed.
        """
        last = len(parts) - 1
        with self.lock:
            if not self._open:
                raise zmq.ZMQError(zmq.ENOTSOCK)
            for i, (part, copy) in enumerate(zip(parts, copies)):
                self.sock.send(part, zmq.NOBLOCK | (zmq.SNDMORE if i < last else 0), copy=copy)
            if self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                self._wake_locked()

    def wake(self) -> None:
        """Make :meth:`wait` return now."""
        with self.lock:
            if self._open:
                self._wake_locked()

    def _wake_locked(self) -> None:
        # under the lock: once closed, the pipe's descriptor number may belong to another file
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:
            pass  # a full pipe wakes the reader anyway

    def wait(self, timeout: float) -> None:
        """Until input may be pending or ``timeout`` passed (at once if :meth:`drain` left
        some)."""
        if not self._more:
            self._poll.poll(timeout * 1000)
        try:
            os.read(self._wake_r, 4096)
        except (BlockingIOError, OSError):
            pass

    def drain(self) -> list:
        """Up to ``_BATCH`` received multipart messages (lists of ``zmq.Frame``)."""
        out = []
        with self.lock:
            if not self._open:
                return out
            while len(out) < _BATCH and self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                out.append(self.sock.recv_multipart(zmq.NOBLOCK, copy=False))
            self._more = len(out) == _BATCH
        return out

    def close(self) -> None:
        with self.lock:
            if self._open:
                self._open = False
                self.sock.close(linger=0)
                os.close(self._wake_r)
                os.close(self._wake_w)


def _parts(msg: Message, max_frame_bytes: int) -> tuple[list, list]:
    """The frame's parts and, per part, whether pyzmq must copy it (see the module
    docstring): views and arrays made contiguous here are copied, arrays that own their
    memory are not."""
    parts = encode_frame(msg, max_frame_bytes)
    copies = [True] + [not (isinstance(b, np.ndarray) and b.base is None)
                       for b in msg.bufs if np.asarray(b).nbytes]
    return parts, copies


def _decode(frames: list, max_frame_bytes: int, allocator) -> Message:
    """A :class:`Message` from its parts, buffers as views of the parts or copied into the
    ``allocator``'s targets.

    Raises:
        ProtocolError: anything that is not a well-formed frame of this wire version.
    """
    head = frames[0].buffer
    if len(head) < HEADER.size:
        raise ProtocolError(f"a first part of {len(head)} bytes, shorter than the header")
    kind, flags, req_id, nbufs, meta_len, total = parse_header(head[:HEADER.size],
                                                               max_frame_bytes)
    end = HEADER.size + nbufs * DESCRIPTOR.size
    if len(head) != end + meta_len:
        raise ProtocolError(f"a first part of {len(head)} bytes; its header announces "
                            f"{end + meta_len}")
    descs = read_descriptors(head[HEADER.size:end], nbufs, total)
    try:
        msg = Message(kind, req_id, json.loads(bytes(head[end:]) or b"{}"), (), flags)
    except ValueError as e:
        raise ProtocolError(f"bad meta or kind: {e}") from None
    data = [f.buffer for f in frames[1:]]
    if len(data) != sum(1 for _, n in descs if n):
        raise ProtocolError(f"{len(data)} buffer parts for {nbufs} descriptors")
    targets = allocator(msg, descs) if allocator else None
    parts = iter(data)
    for i, (dtype, nbytes) in enumerate(descs):
        part = next(parts) if nbytes else b""
        if len(part) != nbytes:
            raise ProtocolError(f"buffer {i}: {len(part)} bytes, its descriptor says {nbytes}")
        arr = targets[i] if targets and i < len(targets) else None
        if arr is None:
            arr = np.frombuffer(part, dtype) if nbytes else np.empty(0, dtype)
        elif arr.nbytes != nbytes or arr.dtype != dtype or not arr.flags.c_contiguous:
            raise ProtocolError(f"buffer {i}: reply does not fit its target "
                                f"({nbytes} bytes of {dtype} for {arr.nbytes} of {arr.dtype})")
        elif nbytes:
            arr.reshape(-1).view(np.uint8)[:] = np.frombuffer(part, np.uint8)
        msg.bufs.append(arr)
    return msg


class ZmqLink:
    """One peer over ZeroMQ, with a TCP ``Link``'s interface (``send``, ``close``, ``closed``,
    ``handled``, ``start``, ``name``, ``peer_info``, ``last_send``/``last_recv``) and callbacks
    (``on_message(link, msg)``, ``on_lost(link, reason)`` once).

    Args:
        socket: the shared socket; ``ident``: the peer's routing identity on a server's
            ROUTER, None on a worker's own DEALER (whose receive thread this link then runs).
        queued: a server link: a send never waits; a peer whose queue is full is dropped.
        max_queued_bytes, max_inflight: accepted for the interface; ZeroMQ queues count
            messages (``SNDHWM``), and one receive thread serves every peer.
    """

    def __init__(self, socket: _Socket, ident: Optional[bytes], name: str,
                 on_message: Callable, on_lost: Callable, dead_after: float,
                 allocator=None, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
                 queued: bool = False, max_queued_bytes: Optional[int] = None,
                 max_inflight: Optional[int] = None,
                 on_end: Optional[Callable[["ZmqLink"], None]] = None) -> None:
        self._sock, self._ident, self.name = socket, ident, name
        self._on_message, self._on_lost, self._allocator = on_message, on_lost, allocator
        self._on_end = on_end
        self.dead_after, self.max_frame_bytes, self.queued = dead_after, max_frame_bytes, queued
        self.last_send = self.last_recv = time.monotonic()
        self.peer_info: dict = {}
        self._closed = threading.Event()
        self._started = False
        self._thread = None if ident is not None else threading.Thread(
            target=self._run, name=f"ps-recv {name}", daemon=True)

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def start(self) -> "ZmqLink":
        if self._thread is not None:
            self._started = True
            self._thread.start()
        return self

    def handled(self) -> None:
        """Nothing to release (no ``max_inflight`` here)."""

    def send(self, msg: Message) -> None:
        """Queue one frame with ZeroMQ (thread-safe).

        Raises:
            PeerLostError: the link is or goes down (a server: the peer is gone or reads too
                slowly; a worker: its queue stayed full for ``dead_after``).
            ProtocolError: the frame cannot travel (dtype, size); the link stays up.
        """
        parts, copies = _parts(msg, self.max_frame_bytes)
        if self._ident is not None:
            parts, copies = [self._ident] + parts, [True] + copies
        since = None
        while True:
            if self._closed.is_set():
                raise PeerLostError(self.name, "connection already closed")
            try:
                self._sock.send(parts, copies)
                break
            except zmq.Again:
                since = since or time.monotonic()
                if self.queued or time.monotonic() - since > self.dead_after:
                    self._fail(f"reads too slowly: {_HWM} messages unread")
                time.sleep(0.001)
            except zmq.ZMQError as e:
                self._fail("connection closed by peer" if e.errno == zmq.EHOSTUNREACH
                           else f"send failed: {e}")
        self.last_send = time.monotonic()

    def _fail(self, reason: str) -> None:
        self._lose(reason)
        raise PeerLostError(self.name, reason)

    def close(self) -> None:
        """End the link on purpose (no ``on_lost`` call)."""
        self._end()

    def _end(self) -> bool:
        if self._closed.is_set():
            return False
        self._closed.set()
        if self._on_end is not None:
            self._on_end(self)
        if self._ident is None and not self._started:
            self._sock.close()  # a worker link whose receive thread never ran
        elif self._ident is None:
            self._sock.wake()  # its receive thread closes the socket
        return True

    def _lose(self, reason: str) -> None:
        if self._end():
            self._on_lost(self, reason)

    def deliver(self, frames: list) -> None:
        """Handle one received message (from the receive thread)."""
        try:
            msg = _decode(frames, self.max_frame_bytes, self._allocator)
            self.last_recv = time.monotonic()
            if msg.kind != Kind.HEARTBEAT:
                self._on_message(self, msg)
        except ProtocolError as e:
            self._lose(f"protocol error: {e}")
        except Exception as e:  # a bug in a handler must not leave the peer waiting forever
            log.exception("ps: link %s: handler failed", self.name)
            self._lose(f"internal error: {type(e).__name__}: {e}")

    def check(self, now: float) -> None:
        """Lost when nothing, not even a heartbeat, came for ``dead_after``."""
        if now - self.last_recv > self.dead_after:
            self._lose(f"no frame or heartbeat for {self.dead_after:g} s")

    def _run(self) -> None:
        """A worker link's receive thread: it owns the DEALER and closes it at the end."""
        try:
            while not self._closed.is_set():
                self._sock.wait(_TICK)
                for frames in self._sock.drain():
                    self.deliver(frames)
                self.check(time.monotonic())
        except zmq.ZMQError as e:
            self._lose(f"connection error: {e}")
        finally:
            self._sock.close()


class Listener:
    """A server's ROUTER socket on ``host:port``; the counterpart of
    :class:`fleetx.ps.acceptor.Acceptor` (``endpoint``, ``name``, ``events``, ``counters``,
    ``start``, ``close``).

    Args:
        host, port: where to bind (port 0: a free port).
        name: how log lines name the server.
        has_room: ``fn() -> bool``: whether the owner takes another peer now.
        adopt: ``fn(link)``: called (on this thread) with each new peer's :class:`ZmqLink`.
        link_options: :class:`ZmqLink` keyword arguments (callbacks, ``dead_after``, limits).

    Raises:
        PSConfigError: pyzmq is missing or ``host`` is not a loopback address.
        PeerLostError: the address cannot be bound (names the endpoint).
    """

    def __init__(self, host: str, port: int, name: str, has_room: Callable[[], bool],
                 adopt: Callable[[ZmqLink], None], link_options: dict) -> None:
        _check_usable(host, name)
        sock = zmq.Context.instance().socket(zmq.ROUTER)
        _configure(sock, link_options.get("max_frame_bytes", DEFAULT_MAX_FRAME_BYTES))
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full or unknown peer is an error, not a drop
        try:
            if port:
                sock.bind(f"tcp://{host}:{port}")
            else:
                port = sock.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError as e:
            sock.close(linger=0)
            raise PeerLostError(f"server endpoint {host}:{port}", f"cannot listen: {e}") from None
        self.host, self.port, self.name = host, port, name
        self._sock = _Socket(sock)
        self._has_room, self._adopt, self._options = has_room, adopt, link_options
        self.events = RateLimitedLog()
        self._links: dict[bytes, ZmqLink] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ps-zmq-recv", daemon=True)

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> "Listener":
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop receiving and close the socket (the links' sends then fail)."""
        self._stop.set()
        self._sock.wake()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._sock.close()

    def counters(self) -> dict:
        """Peers by outcome: accepted, busy."""
        return dict(self.events.counts)

    def _forget(self, link: ZmqLink) -> None:
        with self._lock:
            if self._links.get(link._ident) is link:
                del self._links[link._ident]

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._sock.wait(_TICK)
                for frames in self._sock.drain():
                    self._dispatch(frames)
                with self._lock:
                    links = list(self._links.values())
                now = time.monotonic()
                for link in links:
                    link.check(now)
            except Exception:  # the server's only receive thread must not fall
                if not self._stop.is_set():
                    log.exception("%s: error in the zmq receive loop (continuing)", self.name)
                    time.sleep(0.05)

    def _dispatch(self, frames: list) -> None:
        ident = frames[0].bytes
        with self._lock:
            link = self._links.get(ident)
        if link is None:
            link = self._new_link(ident, frames[0])
            if link is None:
                return
        link.deliver(frames[1:])

    def _new_link(self, ident: bytes, frame) -> Optional[ZmqLink]:
        """A first frame from ``ident``: a link for it, greeted at once (a worker's
        :func:`connect_link` waits for that greeting), or None when there is no room."""
        try:
            peer = frame.get("Peer-Address")
        except zmq.ZMQError:
            peer = "unknown peer"
        if not self._has_room():
            self.events.warning("busy", "%s: at its connection limit; ignored a new zmq peer "
                                "from %s", self.name, peer)
            return None
        self.events.count("accepted")
        link = ZmqLink(self._sock, ident, f"connection from {peer}", **self._options,
                       on_end=self._forget)
        with self._lock:
            self._links[ident] = link
        self._adopt(link)
        try:
            link.send(Message(Kind.HEARTBEAT))
        except PeerLostError:
            pass  # reported through on_lost
        return link


def connect_link(host: str, port: int, name: str, timeout: float, on_message: Callable,
                 on_lost: Callable, dead_after: float, allocator=None, *,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> ZmqLink:
    """A worker's link to the server at ``host:port``, not yet started: connected once the
    server has answered its first HEARTBEAT (servers may start later than workers).

    Raises:
        PSConfigError: pyzmq is missing or ``host`` is not a loopback address.
        PSTimeoutError: no answer within ``timeout`` seconds; the message names ``name``.
    """
    _check_usable(host, name)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    _configure(sock, max_frame_bytes)
    sock.connect(f"tcp://{host}:{port}")
    link = ZmqLink(_Socket(sock), None, name, on_message, on_lost, dead_after, allocator,
                   max_frame_bytes=max_frame_bytes)
    link.send(Message(Kind.HEARTBEAT))  # ZeroMQ holds it until the connection is up
    deadline = time.monotonic() + timeout
    # the receive thread has not started: this thread is the socket's only reader
    while True:
        greeting = link._sock.drain()
        if greeting:
            break
        left = deadline - time.monotonic()
        if left <= 0:
            link.close()
            raise PSTimeoutError(f"{name} is not reachable at {host}:{port} after "
                                 f"{timeout:.0f} s (zmq transport)")
        link._sock.wait(min(_TICK, left))
    try:
        for frames in greeting:
            if _decode(frames, max_frame_bytes, None).kind != Kind.HEARTBEAT:
                raise ProtocolError("the first frame is not the server's greeting")
    except ProtocolError as e:
        link.close()
        raise ProtocolError(f"{name} at {host}:{port}: {e}") from None
    link.last_recv = time.monotonic()
    return link
