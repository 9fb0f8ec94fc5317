"""Request tracking: request ids, pending handles, and failing them when a peer is lost.

An operation that talks to several servers (a pull routed over all of them) is one
:class:`Handle` with one part per request. Replies complete parts from the receive threads;
:meth:`Handle.wait` runs the handle's ``finish`` function on the caller's thread once every
part is in, so assembling results never blocks a receive thread. When a link is lost,
:meth:`Tracker.fail_peer` fails every request still pending on it with an error naming the
peer, so a wait never outlives a dead peer. The tracker also times each request from its
registration to its reply, per message kind (:mod:`fleetx.ps.latency`, :meth:`Tracker.latency`).
"""
from __future__ import annotations

import itertools
import threading
import time
from typing import Any, Callable, Optional

from fleetx.ps.api import Message, PSConfigError, PeerLostError, PSTimeoutError, RemoteError
from fleetx.ps.latency import BUCKETS, SUB_BITS, Latencies

__all__ = ["Handle", "Tracker", "remote_error"]

_SMALL, _HALF = 1 << SUB_BITS, SUB_BITS - 1
_now = time.perf_counter_ns  # monotonic, ~60 ns
_ERRORS = {cls.__name__: cls for cls in (PSConfigError, PSTimeoutError)}


def remote_error(meta: dict, peer_name: str) -> Exception:
    """The exception an error reply stands for. A server relaying the loss of another peer
    (a worker that died during a sync step) raises PeerLostError naming that peer."""
    name, text = meta.get("error", "PSError"), meta.get("message", "")
    if name == "PeerLostError" and "peer" in meta:
        return PeerLostError(meta["peer"], f"{meta.get('reason', '')} (reported by {peer_name})")
    cls = _ERRORS.get(name)
    return cls(f"{peer_name}: {text}") if cls else RemoteError(peer_name, name, text)


class Handle:
    """A pending operation (ps-lite's timestamp): ``wait()`` returns its result or raises.

    Args:
        parts: how many replies complete it.
        finish: ``fn(replies) -> result``, replies in part order; runs inside :meth:`wait`.
    """

    def __init__(self, parts: int, finish: Optional[Callable[[list], Any]] = None) -> None:
        self._replies: list = [None] * parts
        self._left = parts
        self._finish = finish
        self._error: Optional[BaseException] = None
        self._lock = threading.Lock()
        self._event = threading.Event()
        self._result: Any = None
        self._finished = False
        if parts == 0:
            self._event.set()

    def done(self) -> bool:
        """True once every reply arrived or the operation failed."""
        return self._event.is_set()

    def wait(self, timeout: Optional[float] = None) -> Any:
        """Block until done; return the result.

        Raises:
            PeerLostError: a peer of this operation died or stopped answering.
            RemoteError: a server reported a failure handling the request.
            PSTimeoutError: ``timeout`` seconds passed first (the operation stays pending).
        """
        if not self._event.wait(timeout):
            raise PSTimeoutError(f"no reply within {timeout} s")
        if self._error is not None:
            raise self._error
        if not self._finished:
            self._result = self._finish(self._replies) if self._finish else self._replies
            self._finished = True
        return self._result

    def _complete(self, part: int, msg: Message) -> None:
        with self._lock:
            if self._event.is_set() or self._replies[part] is not None:
                return
            self._replies[part] = msg
            self._left -= 1
            if self._left == 0:
                self._event.set()

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            if not self._event.is_set():
                self._error = error
                self._event.set()

    @classmethod
    def resolved(cls, result: Any) -> "Handle":
        """A handle that is already done with ``result`` (operations with nothing to send)."""
        h = cls(0, lambda _: result)
        return h


class Tracker:
    """Request ids -> pending entries ``(handle, part, peer, receive targets, latency counts of
    its kind, registration time in ns[, message kept for a resend])``."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._pending: dict[int, tuple] = {}
        self._latency = Latencies()
        self._counts: dict = {}  # kind name -> its histogram's counts (one lookup per request)

    def register(self, handle: Handle, part: int, peer: int,
                 targets: Optional[list] = None, kind: Optional[str] = None) -> int:
        """A fresh request id for part ``part`` of ``handle``, sent to peer ``peer``.
        ``targets``: arrays the reply's buffers should be received into, in order. ``kind``:
        the message kind's name, to time the request under (None: not timed)."""
        req_id = next(self._ids)
        with self._lock:
            counts = self._counts.get(kind)
            if counts is None and kind is not None:
                counts = self._counts[kind] = self._latency.of(kind).counts
            self._pending[req_id] = (handle, part, peer, targets, counts, _now())
        return req_id

    def attach(self, req_id: int, msg: Message) -> None:
        """Keep the request's message, to send it again (failover: its server restarted)."""
        with self._lock:
            entry = self._pending.get(req_id)
            if entry is not None:
                self._pending[req_id] = entry[:6] + (msg,)

    def unanswered(self, peer: int) -> list[Message]:
        """The kept messages of the requests still pending on ``peer``, oldest first."""
        with self._lock:
            return [e[6] for k, e in sorted(self._pending.items())
                    if e[2] == peer and len(e) > 6]

    def targets(self, req_id: int) -> Optional[list]:
        with self._lock:
            entry = self._pending.get(req_id)
        return entry[3] if entry else None

    def resolve(self, msg: Message, peer_name: str) -> None:
        """Complete (or fail, for an error reply) the request ``msg`` answers, and count its
        latency (an error reply is a reply too)."""
        with self._lock:
            entry = self._pending.pop(msg.req_id, None)
            if entry is not None and entry[4] is not None:
                # latency.bucket() inlined: this runs for every reply, on a receive thread
                ns = _now() - entry[5]
                if ns < _SMALL:
                    entry[4][ns] += 1
                else:
                    shift = ns.bit_length() - SUB_BITS
                    b = (shift << _HALF) + (ns >> shift)
                    entry[4][b if b < BUCKETS else BUCKETS - 1] += 1
        if entry is None:
            return  # already failed (its peer was declared lost), or a stale reply
        handle, part = entry[0], entry[1]
        if msg.is_error:
            handle._fail(remote_error(msg.meta, peer_name))
        else:
            handle._complete(part, msg)

    def latency(self) -> Latencies:
        """A copy of the latency histograms, per message kind name, since this tracker began."""
        with self._lock:
            return self._latency.copy()

    def forget(self, req_id: int, error: BaseException) -> None:
        """Fail one request (its send failed)."""
        with self._lock:
            entry = self._pending.pop(req_id, None)
        if entry:
            entry[0]._fail(error)

    def fail_peer(self, peer: int, error: BaseException) -> None:
        """Fail every request pending on ``peer``."""
        with self._lock:
            dead = [k for k, e in self._pending.items() if e[2] == peer]
            entries = [self._pending.pop(k) for k in dead]
        for e in entries:
            e[0]._fail(error)

    def fail_all(self, error: BaseException) -> None:
        with self._lock:
            entries = list(self._pending.values())
            self._pending.clear()
        for e in entries:
            e[0]._fail(error)
