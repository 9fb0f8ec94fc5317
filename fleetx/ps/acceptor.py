"""A server's front door: listen, authenticate, hand over; survive anything a client does.

One thread runs a selector over the listening socket and every connection still in the
handshake (:mod:`fleetx.ps.handshake`), all non-blocking, so no client can hold it up: one
that says nothing, trickles bytes, resets before ``accept()`` or answers wrongly costs a file
descriptor and a few hundred bytes until its deadline, never a thread, and never delays the
others (also those from the same address: nothing is decided per address).

* At most ``max_pending`` connections may be in the handshake; a new one evicts the oldest
  (an idle stranger, not the worker that connected a millisecond ago).
* An authenticated connection is adopted only while the owner has room (``has_room``);
  otherwise it is told BUSY and closed at once (the client retries until its timeout).
* ``accept()`` errors never end the loop: a connection reset before it was accepted is
  skipped; out of file descriptors (EMFILE/ENFILE) or kernel memory, the oldest pending
  connection is closed to free one and accepting goes on, so strangers holding connections
  are cycled out and a worker queued behind them gets in; with none to close, accepting
  pauses (backing off from 50 ms to 1 s) while the kernel keeps the rest in the listen queue.
* Failed handshakes are counted and logged as rate-limited warnings; nothing a connection
  sends before it is authenticated reaches the owner.
"""
from __future__ import annotations

import collections
import errno
import logging
import selectors
import socket
import struct
import threading
import time
from typing import Callable, Optional

from fleetx.ps import local as local_links
from fleetx.ps.api import PeerLostError
from fleetx.ps.handshake import BUSY, REJECTED, RESPONSE_BYTES, Challenge

__all__ = ["Acceptor", "RateLimitedLog", "MAX_PENDING", "HANDSHAKE_TIMEOUT"]

log = logging.getLogger("fleetx.ps")

MAX_PENDING = 64          # connections in the handshake at once
HANDSHAKE_TIMEOUT = 10.0  # seconds a connection has to authenticate (a real one takes ~1 ms)
_BACKLOG = 1024           # the kernel caps it at net.core.somaxconn
_RESOURCE_ERRORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
_MAX_BACKOFF = 1.0


class RateLimitedLog:
    """Counts events; warns about each kind at most once per ``interval`` seconds, saying how
    many were held back. ``counts`` keeps every event."""

    def __init__(self, interval: float = 10.0) -> None:
        self.interval = interval
        self.counts: collections.Counter = collections.Counter()
        self._last: dict[str, tuple[float, int]] = {}
        self._lock = threading.Lock()

    def count(self, kind: str) -> None:
        with self._lock:
            self.counts[kind] += 1

    def warning(self, kind: str, fmt: str, *args) -> None:
        with self._lock:
            self.counts[kind] += 1
            now, count = time.monotonic(), self.counts[kind]
            at, seen = self._last.get(kind, (float("-inf"), 0))
            if now - at < self.interval:
                return
            self._last[kind] = (now, count)
        more = count - seen - 1
        log.warning(fmt + (f" ({more} more since the last such warning, {count} in all)"
                           if more else ""), *args)


class _Pending:
    __slots__ = ("sock", "peer", "challenge", "deadline", "answer")

    def __init__(self, sock: socket.socket, peer: str, challenge: Challenge,
                 deadline: float) -> None:
        self.sock, self.peer, self.challenge, self.deadline = sock, peer, challenge, deadline
        self.answer = bytearray()


class Acceptor:
    """Listens on ``host:port`` (and, with ``local``, on a Unix-domain socket for peers on
    this machine, :mod:`fleetx.ps.local`) and hands every authenticated connection to
    ``adopt``.

    Args:
        host, port: where to listen (port 0 picks a free port, see :attr:`endpoint`).
        key: the job's secret (``b""``: none; only for loopback, see
            :func:`fleetx.ps.handshake.require_secret`).
        name: how log lines name the server.
        has_room: ``fn() -> bool``: whether the owner takes another connection now.
        adopt: ``fn(sock, peer)``: called (on this thread) with each authenticated, blocking
            socket and ``"ip:port"`` of its peer.
        max_pending: connections in the handshake at once.
        handshake_timeout: seconds a connection has to authenticate.
        local: also listen on the same-machine socket of the port (when one can be made);
            its connections pass the same handshake and limits.
        resolve_wait: seconds to keep trying while ``host`` is a name that does not resolve
            yet (a pod's own DNS name appears shortly after the pod starts).

    Raises:
        PeerLostError: the address cannot be listened on (names the endpoint).

    Example:
        >>> acc = Acceptor("127.0.0.1", 0, key, "server 0", lambda: True, adopt)  # doctest: +SKIP
        >>> acc.start(); ...; acc.close()
    """

    def __init__(self, host: str, port: int, key: bytes, name: str,
                 has_room: Callable[[], bool], adopt: Callable[[socket.socket, str], None],
                 max_pending: int = MAX_PENDING,
                 handshake_timeout: float = HANDSHAKE_TIMEOUT, local: bool = False,
                 resolve_wait: float = 0.0) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        deadline = time.monotonic() + resolve_wait
        while True:
            try:
                self.sock.bind((host, port))
                self.sock.listen(_BACKLOG)
                break
            except socket.gaierror as e:  # the name is not known yet: wait for it, bounded
                if time.monotonic() + 0.5 > deadline:
                    self.sock.close()
                    raise PeerLostError(f"server endpoint {host}:{port}",
                                        f"cannot listen: {host!r} did not resolve within "
                                        f"{resolve_wait:.0f} s ({e})") from None
                time.sleep(0.5)
            except OSError as e:
                self.sock.close()
                raise PeerLostError(f"server endpoint {host}:{port}",
                                    f"cannot listen: {e}") from None
        self.sock.setblocking(False)
        self.host, self.port = host, self.sock.getsockname()[1]
        # bound after the TCP address and port, which no other process holds meanwhile: the
        # path is ours
        self.local_sock = local_links.listen(host, self.port, _BACKLOG) if local else None
        self.local_path = self.local_sock.getsockname() if self.local_sock else None
        self._listeners = [s for s in (self.sock, self.local_sock) if s is not None]
        self.name, self._key = name, key
        self._has_room, self._adopt = has_room, adopt
        self._max_pending, self._timeout = max_pending, handshake_timeout
        self.events = RateLimitedLog()
        self._pending: dict[socket.socket, _Pending] = {}  # oldest first
        self._sel = selectors.DefaultSelector()
        self._paused_until: Optional[float] = None
        self._backoff = 0.05
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ps-accept", daemon=True)

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> "Acceptor":
        for listener in self._listeners:
            self._sel.register(listener, selectors.EVENT_READ)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop accepting; close the listening socket and every pending connection."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        for p in list(self._pending.values()):
            self._drop(p)
        self._sel.close()
        if self.local_sock is not None:
            local_links.unlink(self.local_path)  # before the port is free for another server
            self.local_sock.close()
        self.sock.close()

    def counters(self) -> dict:
        """Connections by outcome: accepted, authenticated, auth_failed, handshake_timeout,
        evicted, busy, closed_early, accept_error, out_of_descriptors."""
        return dict(self.events.counts)

    # -- the loop -----------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._step()
            except Exception:  # the front door must never fall: log, breathe, go on
                log.exception("%s: error in the accept loop (continuing)", self.name)
                time.sleep(0.05)

    def _step(self) -> None:
        for key, _ in self._sel.select(timeout=0.2):
            if key.fileobj in self._listeners:
                self._accept_some(key.fileobj)
            elif key.data is not None:
                self._read(key.data)
        now = time.monotonic()
        for p in [p for p in self._pending.values() if p.deadline < now]:
            # counted before the peer can see the close (tests read the counters then)
            self.events.warning("handshake_timeout", "%s: a connection from %s did not "
                                "authenticate within %g s; closed", self.name, p.peer,
                                self._timeout)
            self._drop(p)
        if self._paused_until is not None and now >= self._paused_until:
            self._paused_until = None
            for listener in self._listeners:
                self._sel.register(listener, selectors.EVENT_READ)

    def _accept_some(self, listener: socket.socket) -> None:
        for _ in range(64):  # then let pending handshakes have their turn
            try:
                conn, addr = listener.accept()  # the address comes with it: no getpeername
            except BlockingIOError:
                return
            except OSError as e:
                if e.errno in _RESOURCE_ERRORS:
                    if self._starved(e):
                        continue
                    return
                # ECONNABORTED, EPROTO, EPERM...: that one connection is gone; the rest wait
                self.events.warning("accept_error", "%s: accept failed: %s (continuing)",
                                    self.name, e)
                continue
            self._backoff = 0.05
            self._begin(conn, _peer_name(conn, addr))

    def _starved(self, e: OSError) -> bool:
        """Out of descriptors or memory: close the oldest unauthenticated connection to make
        room (True: accept again now), or, with none, pause accepting and back off."""
        if self._pending:
            self.events.warning("out_of_descriptors", "%s: cannot accept connections: %s; "
                                "closing the oldest unauthenticated ones to make room",
                                self.name, e.strerror)
            self._drop(next(iter(self._pending.values())))
            return True
        self.events.warning("out_of_descriptors", "%s: cannot accept connections: %s; "
                            "pausing %.2f s (the kernel keeps them queued)", self.name,
                            e.strerror, self._backoff)
        for listener in self._listeners:
            self._sel.unregister(listener)
        self._paused_until = time.monotonic() + self._backoff
        self._backoff = min(_MAX_BACKOFF, self._backoff * 2)
        return False

    def _begin(self, conn: socket.socket, peer: str) -> None:
        self.events.count("accepted")
        challenge = Challenge(self._key)
        try:
            conn.setblocking(False)
            conn.send(challenge.message())  # 40 bytes: a fresh socket's buffer takes them
        except OSError:  # reset or closed before we could greet it
            conn.close()
            self.events.count("closed_early")
            return
        if len(self._pending) >= self._max_pending:
            self.events.warning("evicted", "%s: %d connections are in the handshake; closed "
                                "the oldest", self.name, self._max_pending)
            self._drop(next(iter(self._pending.values())))
        p = _Pending(conn, peer, challenge, time.monotonic() + self._timeout)
        self._pending[conn] = p
        self._sel.register(conn, selectors.EVENT_READ, p)

    def _read(self, p: _Pending) -> None:
        try:
            chunk = p.sock.recv(RESPONSE_BYTES - len(p.answer))
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._drop(p)
            self.events.count("closed_early")
            return
        p.answer += chunk
        if len(p.answer) < RESPONSE_BYTES:
            return
        self._forget(p)
        verdict = p.challenge.verdict(bytes(p.answer))
        if verdict is None:
            self.events.warning("auth_failed", "%s: a connection from %s failed "
                                "authentication (no secret or another one); closed",
                                self.name, p.peer)
            self._close_with(p.sock, REJECTED)
        elif not self._has_room():
            self.events.warning("busy", "%s: at its connection limit; closed a new "
                                "connection from %s", self.name, p.peer)
            self._close_with(p.sock, BUSY)
        else:
            self._hand_over(p, verdict)

    def _hand_over(self, p: _Pending, verdict: bytes) -> None:
        try:
            if p.sock.send(verdict) != len(verdict):
                raise ConnectionError("verdict not taken")
            p.sock.setblocking(True)
        except OSError:
            p.sock.close()
            self.events.count("closed_early")
            return
        self.events.count("authenticated")
        self._adopt(p.sock, p.peer)

    # -- bookkeeping --------------------------------------------------------------------------
    def _forget(self, p: _Pending) -> None:
        self._pending.pop(p.sock, None)
        try:
            self._sel.unregister(p.sock)
        except (KeyError, ValueError):
            pass

    def _drop(self, p: _Pending) -> None:
        self._forget(p)
        p.sock.close()

    @staticmethod
    def _close_with(sock: socket.socket, verdict: bytes) -> None:
        try:
            sock.send(verdict)
        except OSError:
            pass
        sock.close()


def _peer_name(conn: socket.socket, addr) -> str:
    """``ip:port`` of a TCP peer; the process id of a same-machine one (Linux tells it)."""
    if conn.family != socket.AF_UNIX:
        return "%s:%s" % tuple(addr[:2]) if addr else "unknown peer"
    try:
        pid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, _SO_PEERCRED, 12))[0]
        return f"pid {pid} (same-machine socket)"
    except (OSError, struct.error):
        return "a same-machine socket"


_SO_PEERCRED = getattr(socket, "SO_PEERCRED", 17)
