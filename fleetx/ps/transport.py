"""Framed links between parameter-server peers: framing, heartbeats, liveness, slow readers.

A :class:`Link` is one authenticated TCP connection to a peer (the handshake is
:mod:`fleetx.ps.handshake`; servers accept through :mod:`fleetx.ps.acceptor`). Sending writes a
frame (:mod:`fleetx.ps.wire` encodes it: header, descriptors, JSON meta, raw buffers) from the
arrays' own memory with one ``sendmsg`` / ``writev``. A receive thread reads frames with
``recv_into`` straight into their final arrays (the owner may supply preallocated targets
through ``allocator``) and hands each message to ``on_message``.

Limits that keep one peer from hurting the others:

* a frame's header announces its size; one above ``max_frame_bytes`` ends the link before
  anything is allocated;
* a frame must arrive in ``dead_after`` seconds plus one second per MiB: a peer trickling
  bytes is cut at that deadline (a per-``recv`` timeout would let one byte every few seconds
  keep it forever);
* a *queued* link (the server's) never blocks its sender: what the socket does not take at
  once is copied to a per-link queue that a writer thread drains. A peer whose unread replies
  exceed ``max_queued_bytes``, or that reads nothing for ``dead_after`` seconds, is dropped.

Liveness: a :class:`Heartbeats` thread sends a HEARTBEAT on every link idle for
``heartbeat_interval``; a link that receives nothing for ``dead_after`` (not even a
heartbeat), is closed or reset, or receives a malformed or late frame ends and calls
``on_lost(link, reason)`` exactly once; a send that makes no progress for ``dead_after`` fails
the same way. So no wait on a link can outlast a dead peer by more than ``dead_after``.
"""
from __future__ import annotations

import collections
import itertools
import json
import logging
import select
import socket
import struct
import threading
import time
from typing import Callable, Optional

import numpy as np

from fleetx.ps.buffers import BufferPool
from fleetx.ps.api import (DEFAULT_MAX_FRAME_BYTES, DESCRIPTOR, HEADER, Kind, Message,
                           PeerLostError, ProtocolError, encode_frame, parse_header,
                           read_descriptors)

__all__ = ["Link", "Heartbeats", "MAX_QUEUED_BYTES"]

log = logging.getLogger("fleetx.ps")

_SOCK_BUF = 4 << 20  # 4 MiB socket buffers: big sends are much cheaper (see baselines §1)
_IOV_MAX = 512       # buffers per sendmsg call (Linux allows 1024)
_TICK = 0.5          # socket timeout: how often blocked threads look at their deadlines
_MIN_RATE = 1 << 20  # bytes/s a frame must average after its first dead_after seconds
#: unread replies a queued link holds beyond the frame being written before it drops the peer
MAX_QUEUED_BYTES = 64 << 20

#: supplies the arrays a frame's buffers are received into (None: the pool's)
Allocator = Callable[[Message, list], Optional[list]]


class _Late(Exception):
    """A frame did not complete before its deadline, or the peer fell silent."""


#: receive buffers of every link of this process, reused once nothing holds them. One pool,
#: not one per link: a server with a thousand workers would otherwise keep a block per size
#: class per connection (gigabytes) though its one handler thread holds few at a time.
_RECEIVE_POOL = BufferPool(keep=8)


class Link:
    """A framed, heartbeat-watched connection to one peer.

    Args:
        sock: a connected (and authenticated) socket.
        name: how errors name the peer (``"server 0 (host:port)"``); may be renamed later.
        on_message: ``fn(link, message)``, called from the receive thread for every
            non-heartbeat frame.
        on_lost: ``fn(link, reason)``, called once when the link ends for any reason other
            than :meth:`close` by its owner.
        dead_after: seconds of silence after which the peer counts as dead.
        allocator: optional ``fn(message_without_buffers, [(dtype, nbytes), ...])`` returning a
            list with a preallocated array (or None) per buffer, to receive into directly.
        max_frame_bytes: the largest frame payload accepted (or sent).
        queued: :meth:`send` never blocks: what the socket does not take at once waits in a
            queue drained by a writer thread (servers answer many peers from one thread).
        max_queued_bytes: a queued link whose unread data exceeds this is dropped.
        max_inflight: at most this many received frames may be handed to ``on_message`` and
            not yet marked :meth:`handled`; the receive thread waits (reading nothing more
            from this peer) until the owner catches up, so one peer flooding requests cannot
            queue unbounded work ahead of the others. None: no limit.
    """

    def __init__(self, sock: socket.socket, name: str,
                 on_message: Callable[["Link", Message], None],
                 on_lost: Callable[["Link", str], None], dead_after: float,
                 allocator: Optional[Allocator] = None, *,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, queued: bool = False,
                 max_queued_bytes: int = MAX_QUEUED_BYTES,
                 max_inflight: Optional[int] = None) -> None:
        self.sock, self.name = sock, name
        self._on_message, self._on_lost, self._allocator = on_message, on_lost, allocator
        self._cond = threading.Condition()  # guards the queue and closing
        self._send_lock = threading.Lock()  # one blocking send at a time
        self._closed = threading.Event()
        self.dead_after, self.max_frame_bytes = dead_after, max_frame_bytes
        self._max_queued = max_queued_bytes
        self.last_send = self.last_recv = time.monotonic()
        self.bytes_sent = self.bytes_received = 0  # whole frames, header and all
        self.peer_info: dict = {}  # filled by the owner (e.g. a worker's rank after HELLO)
        self._out: collections.deque = collections.deque()  # queued mode: unsent byte views
        self._out_bytes = 0
        self._io_threads = 0  # the socket is closed when the last of them ends
        self._credits = threading.BoundedSemaphore(max_inflight) if max_inflight else None
        self._pool = _RECEIVE_POOL  # buffers without a target: reused once nothing holds them
        _tune(sock, min(_TICK, dead_after / 2))
        self._threads = [threading.Thread(target=self._recv_loop, name=f"ps-recv {name}",
                                          daemon=True)]
        if queued:
            self._threads.append(threading.Thread(target=self._write_loop,
                                                  name=f"ps-send {name}", daemon=True))
        self.queued = queued

    def start(self) -> "Link":
        with self._cond:
            self._io_threads = len(self._threads)
        for t in self._threads:
            t.start()
        return self

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def send(self, msg: Message) -> None:
        """Write one frame (thread-safe). On a queued link this never blocks.

        Raises:
            PeerLostError: the link is or goes down (a queued link: the peer reads too slowly).
            ProtocolError: the frame cannot travel (dtype, size); the link stays up.
        """
        parts = encode_frame(msg, self.max_frame_bytes)
        # a blocking send must not hold _cond: closing the link from another thread (a lost
        # peer seen by the receive thread) has to wake it, not wait for it
        with (self._cond if self.queued else self._send_lock):
            if self._closed.is_set():
                raise PeerLostError(self.name, "connection already closed")
            if self.queued:
                self._enqueue(parts)
            else:
                self._send_blocking(parts)
            self.bytes_sent += sum(len(p) for p in parts)

    def close(self) -> None:
        """End the link on purpose (no ``on_lost`` call)."""
        self._end()

    def handled(self) -> None:
        """The owner is done with one frame it was handed (see ``max_inflight``)."""
        if self._credits is not None:
            try:
                self._credits.release()
            except ValueError:  # more calls than frames: harmless
                pass

    def _wait_for_credit(self) -> bool:
        while self._credits is not None and not self._credits.acquire(timeout=_TICK):
            if self._closed.is_set():
                return False
        return True

    # -- sending ------------------------------------------------------------------------------
    def _send_blocking(self, parts: list) -> None:
        views = [memoryview(p) for p in parts]
        progress = time.monotonic()
        while views:
            try:
                _advance(views, self.sock.sendmsg(views[:_IOV_MAX]))
                progress = time.monotonic()
            except (socket.timeout, BlockingIOError):  # SO_SNDTIMEO passed with nothing sent
                if time.monotonic() - progress > self.dead_after:
                    reason = f"a send made no progress for {self.dead_after:g} s"
                    self._lose(reason)
                    raise PeerLostError(self.name, "send timed out") from None
            except OSError as e:
                self._lose(f"send failed: {e}")
                raise PeerLostError(self.name, f"send failed: {e}") from None
        self.last_send = time.monotonic()

    def _enqueue(self, parts: list) -> None:
        views = [memoryview(p).cast("B") for p in parts]
        if not self._out:
            try:
                self._write_some(views)
            except OSError as e:
                self._lose(f"send failed: {e}")
                raise PeerLostError(self.name, f"send failed: {e}") from None
            if not views:
                return
        size = sum(len(v) for v in views)
        if self._out_bytes and self._out_bytes + size > self._max_queued:
            reason = (f"reads too slowly: {self._out_bytes + size} bytes of replies unread "
                      f"(limit {self._max_queued})")
            self._lose(reason)
            raise PeerLostError(self.name, reason)
        # a copy: the caller may change its arrays once send() returns, as after a direct send
        self._out.extend(memoryview(bytes(v)) for v in views)
        self._out_bytes += size
        self._cond.notify_all()

    def _write_some(self, views: list) -> None:
        """Write what the socket takes now, without waiting; drops what was written."""
        while views:
            try:
                n = self.sock.sendmsg(views[:_IOV_MAX], (), socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            _advance(views, n)
            self.last_send = time.monotonic()

    def _write_loop(self) -> None:
        poller = select.poll()
        stalled: Optional[float] = None
        try:
            poller.register(self.sock.fileno(), select.POLLOUT)
            while True:
                with self._cond:
                    while not self._out and not self._closed.is_set():
                        self._cond.wait()
                    if self._closed.is_set():
                        return
                    written = self._write_queued()
                if written or not self._out:
                    stalled = None
                    continue
                now = time.monotonic()
                stalled = stalled or now
                if now - stalled > self.dead_after:
                    with self._cond:
                        self._lose(f"reads nothing: {self._out_bytes} bytes of replies unread "
                                   f"for {self.dead_after:g} s")
                    return
                poller.poll(_TICK * 1000)
        except OSError as e:
            with self._cond:
                self._lose(f"send failed: {e}")
        finally:
            self._io_ended()

    def _write_queued(self) -> int:
        """One non-blocking ``writev`` from the front of the queue (under ``_cond``); the bytes
        written. Only the first ``_IOV_MAX`` chunks are looked at, so a long queue of small
        replies costs no more per call than a short one."""
        out = self._out
        try:
            n = self.sock.sendmsg(list(itertools.islice(out, _IOV_MAX)), (), socket.MSG_DONTWAIT)
        except BlockingIOError:
            return 0
        left = n
        while left:
            if left >= len(out[0]):
                left -= len(out.popleft())
            else:
                out[0] = out[0][left:]
                left = 0
        self._out_bytes -= n
        if n:
            self.last_send = time.monotonic()
        return n

    # -- ending -------------------------------------------------------------------------------
    def _end(self) -> bool:
        """Mark closed and wake every thread using the socket; the last one closes it (so its
        descriptor cannot be reused by another connection while one still writes to it)."""
        with self._cond:
            if self._closed.is_set():
                return False
            self._closed.set()
            self._out.clear()
            self._out_bytes = 0
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            if self._io_threads == 0:
                self.sock.close()
            self._cond.notify_all()
        return True

    def _io_ended(self) -> None:
        with self._cond:
            self._io_threads -= 1
            if self._io_threads == 0 and self._closed.is_set():
                self.sock.close()

    def _lose(self, reason: str) -> None:
        if self._end():
            self._on_lost(self, reason)

    # -- receiving ----------------------------------------------------------------------------
    def _recv_loop(self) -> None:
        try:
            while not self._closed.is_set():
                msg = self._recv_frame()
                self.last_recv = time.monotonic()
                if msg.kind != Kind.HEARTBEAT and self._wait_for_credit():
                    self._on_message(self, msg)
        except _Late as e:
            self._lose(str(e))
        except EOFError:
            self._lose("connection closed by peer")
        except ProtocolError as e:
            self._lose(f"protocol error: {e}")
        except OSError as e:
            self._lose(f"connection error: {e}")
        except Exception as e:  # a bug in a handler must not leave the peer waiting forever
            log.exception("ps: link %s: handler failed", self.name)
            self._lose(f"internal error: {type(e).__name__}: {e}")
        finally:
            self._io_ended()

    def _fill(self, view: memoryview, deadline: Optional[float]) -> float:
        """Receive exactly ``len(view)`` bytes before ``deadline``. None: the start of a frame,
        awaited for ``dead_after`` seconds of silence; from its first byte on, the frame has
        ``dead_after`` seconds. Within a frame, ``dead_after`` seconds without a byte are
        death too. Returns the deadline in force."""
        got, n = 0, len(view)
        last = self.last_recv if deadline is None else time.monotonic()
        while got < n:
            try:  # the whole rest at once: one system call, however many segments it takes
                k = self.sock.recv_into(view[got:], 0, socket.MSG_WAITALL)
            except (socket.timeout, BlockingIOError):  # SO_RCVTIMEO passed with nothing read
                if time.monotonic() - last > self.dead_after:
                    raise _Late(f"no frame or heartbeat for {self.dead_after:g} s"
                                if deadline is None else f"no data for {self.dead_after:g} s "
                                "in the middle of a frame") from None
                k = None
            if k == 0:
                raise EOFError
            if k:
                got += k
                last = time.monotonic()
                if deadline is None:  # the frame has begun: it must now complete in time
                    deadline = last + self.dead_after
            # checked on every wake-up: bytes trickling in faster than the socket timeout
            # must not postpone the check forever
            if deadline is not None and got < n and time.monotonic() > deadline:
                raise _Late("a frame was not complete within its deadline (dead_after "
                            "plus 1 s per MiB): the peer sends too slowly")
        return deadline

    def _recv_frame(self) -> Message:
        head = bytearray(HEADER.size)
        deadline = self._fill(memoryview(head), None)
        kind, flags, req_id, nbufs, meta_len, total = parse_header(head, self.max_frame_bytes)
        rest = bytearray(nbufs * DESCRIPTOR.size + meta_len)
        self._fill(memoryview(rest), deadline)
        descs = read_descriptors(rest, nbufs, total)
        try:
            meta = json.loads(bytes(rest[nbufs * DESCRIPTOR.size:]) or b"{}")
            msg = Message(kind, req_id, meta, (), flags)
        except ValueError as e:
            raise ProtocolError(f"bad meta or kind: {e}") from None
        deadline += total / _MIN_RATE
        self.bytes_received += HEADER.size + len(rest) + total  # one receive thread: no lock
        targets = self._allocator(msg, descs) if self._allocator else None
        for i, (dtype, nbytes) in enumerate(descs):
            arr = targets[i] if targets and i < len(targets) else None
            if arr is None:
                arr = self._pool.take(dtype, nbytes)
            elif arr.nbytes != nbytes or arr.dtype != dtype or not arr.flags.c_contiguous:
                raise ProtocolError(f"buffer {i}: reply does not fit its target "
                                    f"({nbytes} bytes of {dtype} for {arr.nbytes} of {arr.dtype})")
            if nbytes:
                self._fill(memoryview(arr.reshape(-1).view(np.uint8)), deadline)
            msg.bufs.append(arr)
        return msg


def _tune(sock: socket.socket, tick: float) -> None:
    """Big buffers, no Nagle; a blocking socket whose waits the kernel ends after ``tick``
    seconds (SO_RCVTIMEO / SO_SNDTIMEO), so that a receive of a large buffer is one system
    call (MSG_WAITALL) rather than a poll and a read per arriving segment, and every blocked
    thread still looks at its deadlines each tick. Writes that must not block say so per call
    (MSG_DONTWAIT)."""
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, opt, _SOCK_BUF)
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(None)
    seconds = int(tick)
    timeval = struct.pack("@ll", seconds, max(1, int((tick - seconds) * 1e6)))
    for opt in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO):
        sock.setsockopt(socket.SOL_SOCKET, opt, timeval)


def _advance(views: list, sent: int) -> None:
    """Drop ``sent`` bytes from the front of ``views`` (in place)."""
    while sent and views:
        if sent >= len(views[0]):
            sent -= len(views[0])
            views.pop(0)
        else:
            views[0] = views[0][sent:]
            sent = 0
    while views and len(views[0]) == 0:
        views.pop(0)


class Heartbeats:
    """Sends a HEARTBEAT on every registered link that has sent nothing for ``interval``."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._links: set[Link] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ps-heartbeat", daemon=True)
        self._thread.start()

    def add(self, link: Link) -> None:
        with self._lock:
            self._links.add(link)

    def discard(self, link: Link) -> None:
        with self._lock:
            self._links.discard(link)

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        beat = Message(Kind.HEARTBEAT)
        while not self._stop.wait(self.interval / 4):
            now = time.monotonic()
            with self._lock:
                links = [l for l in self._links if not l.closed]
            for link in links:
                if now - link.last_send >= self.interval:
                    try:
                        link.send(beat)
                    except PeerLostError:
                        pass  # the link reported itself lost
