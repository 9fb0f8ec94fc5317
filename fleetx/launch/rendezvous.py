"""The node-level rendezvous of a collective job: how the fleetrun of every node finds the others
before any process starts, says what it is waiting for, and gives up after ``FLEETX_TIMEOUT``.

* A static job (``--nnodes N``, the default): node 0 serves the store on the rendezvous address
  the banner shows, and on no other interface; every node writes its key and waits for the
  others', naming the missing nodes by address every few seconds; a node other than node 0
  first waits for node 0's store. At the timeout it fails naming the nodes that never came.
* An elastic job (``--nnodes MIN:MAX``): torch's dynamic (c10d) rendezvous, over a store that the
  node at ``--master`` serves on that address only; every few seconds it says how many nodes
  have joined and what it waits for; at the timeout it fails saying how many were missing.

Each wait is one ``fleetrun: ...`` line on stderr every :data:`REPORT_EVERY` seconds, and each
failure a :class:`~fleetx.launch.api.LaunchError` whose message fleetrun prints as one line.
"""
from __future__ import annotations

import errno
import socket
import sys
import threading
import time
from datetime import datetime, timedelta, timezone
from typing import Callable, Optional, Sequence

from torch.distributed import PrefixStore, Store, TCPStore
from torch.distributed.elastic.rendezvous import (RendezvousHandler, RendezvousInfo,
                                                  RendezvousStoreInfo, RendezvousTimeoutError)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (DynamicRendezvousHandler,
                                                                     RendezvousTimeout)

from fleetx.launch import hosts
from fleetx.launch.api import LaunchError

__all__ = ["REPORT_EVERY", "serve", "StaticRendezvous", "ElasticRendezvous", "elastic_handler"]

#: Seconds between two "waiting for ..." lines.
REPORT_EVERY = 5.0
_POLL_SECONDS = 0.2
_CONNECT_RETRY_SECONDS = 1.0
_STORE_READ_TIMEOUT = timedelta(seconds=60)  # torch's own default for the c10d rendezvous
_ANSWER_SECONDS = 15.0  # a store answers a new client in milliseconds
_NODE_KEY = "fleetx/launch/node/"

Say = Callable[[str], None]


def _say(message: str) -> None:
    print(f"fleetrun: {message}", file=sys.stderr, flush=True)


def _endpoint(addr: str, port: int) -> str:
    return f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class _Clock:
    """One deadline, and a report line at most every :data:`REPORT_EVERY` seconds."""

    def __init__(self, timeout: float, say: Say) -> None:
        self.timeout, self._say = timeout, say
        self._start = time.monotonic()
        self._next_report = self._start + REPORT_EVERY

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self._start

    def expired(self) -> bool:
        return self.elapsed >= self.timeout

    def report(self, what: str) -> None:
        if time.monotonic() >= self._next_report:
            self._say(f"{what} ({self.elapsed:.0f} s of {self.timeout:.0f} s)")
            self._next_report += REPORT_EVERY


# -- the store --------------------------------------------------------------------------------
def serve(addr: str, port: int, hint: str, what: str = "rendezvous store") -> socket.socket:
    """The listening socket of a rendezvous store at ``addr:port``, bound to ``addr`` only.

    Args:
        addr, port: where the store listens (port 0: any free port).
        hint: what the user can do about a port in use, e.g. ``"choose another with --master"``.
        what: the store, as the error names it.

    Raises:
        LaunchError: the port is in use or ``addr`` is not an address of this host.
    """
    try:
        return hosts.listen(addr, port)
    except OSError as exc:
        raise _cannot_serve(exc, addr, port, hint, what) from None


def _cannot_serve(exc: OSError, addr: str, port: int, hint: str,
                  what: str = "rendezvous store") -> LaunchError:
    if exc.errno == errno.EADDRINUSE:
        why = f"port {port} is already in use on {addr}; {hint}"
    elif exc.errno == errno.EADDRNOTAVAIL:
        why = f"{addr} is not an address of this node"
    else:
        why = exc.strerror or str(exc)
    return LaunchError(f"cannot serve the {what} at {_endpoint(addr, port)}: {why}")


def _server_store(listener: socket.socket, addr: str, timeout: timedelta) -> TCPStore:
    """A store served on ``listener`` (torch would listen on every interface by itself)."""
    return TCPStore(addr, listener.getsockname()[1], None, True, timeout,
                    wait_for_workers=False, master_listen_fd=listener.fileno(), use_libuv=True)


def _client_store(addr: str, port: int, who: str, clock: _Clock) -> TCPStore:
    """Connect to the store at ``addr:port`` once ``who`` serves it, reporting the wait.

    A plain TCP connection probes first: torch's client would retry on its own, silently or with a
    C++ stack trace per attempt.
    """
    where = _endpoint(addr, port)
    while True:
        try:
            socket.create_connection((addr, port), timeout=_CONNECT_RETRY_SECONDS).close()
            break
        except OSError:
            pass
        if clock.expired():
            raise LaunchError(f"{who} did not serve the rendezvous store at {where} within "
                              f"{clock.timeout:.0f} s (FLEETX_TIMEOUT): start fleetrun there, "
                              f"check that this node can reach {where}, or set FLEETX_TIMEOUT to "
                              f"wait longer")
        clock.report(f"waiting for {who} to serve the rendezvous store at {where}")
        time.sleep(_CONNECT_RETRY_SECONDS)
    return _store_client(addr, port)


def _store_client(addr: str, port: int) -> TCPStore:
    """A client of the store at ``addr:port``, which accepts connections.

    torch's client waits for the store's answer without a deadline, forever when another
    program holds the port: it runs in a thread (the call releases the GIL) that is given up on
    after :data:`_ANSWER_SECONDS`.
    """
    box: list = []

    def connect() -> None:
        try:
            box.append(TCPStore(addr, port, None, False, _STORE_READ_TIMEOUT))
        except (RuntimeError, ValueError) as exc:
            box.append(exc)

    thread = threading.Thread(target=connect, name="fleetrun-store", daemon=True)
    thread.start()
    thread.join(_ANSWER_SECONDS)
    where = _endpoint(addr, port)
    if not box:
        raise LaunchError(f"cannot use the rendezvous store at {where}: something listens there "
                          f"but did not answer as a store within {_ANSWER_SECONDS:.0f} s (is "
                          f"the port taken by another program?)")
    if isinstance(box[0], Exception):
        raise LaunchError(f"cannot use the rendezvous store at {where}: "
                          f"{_first_line(box[0])}")
    return box[0]


# -- static jobs ------------------------------------------------------------------------------
class StaticRendezvous(RendezvousHandler):
    """Every node of ``node_addrs`` joins once; node 0 serves the store.

    Node 0 binds the store's socket at construction, to ``master_addr`` alone, so a port in use
    is reported before anything starts.

    Args:
        node_rank: this node's index in ``node_addrs``.
        node_addrs: every node's address, in node-rank order (the messages name them).
        master_addr, master_port: the store.
        timeout: seconds to wait for every node (``FLEETX_TIMEOUT``).
        run_id: the prefix of the agent's keys.
        say: where the waiting lines go.

    Raises:
        LaunchError: on node 0, the store cannot listen at ``master_addr:master_port``.
    """

    def __init__(self, node_rank: int, node_addrs: Sequence[str], master_addr: str,
                 master_port: int, timeout: float, run_id: str = "fleetx",
                 say: Say = _say) -> None:
        self._rank, self._addrs = node_rank, tuple(node_addrs)
        self._master = (master_addr, master_port)
        self._timeout, self._run_id, self._say = timeout, run_id, say
        self._store: Optional[Store] = None
        self._listener = serve(master_addr, master_port, "choose a free one with --master "
                               "HOST:PORT (the same on every node)") if node_rank == 0 else None

    def get_backend(self) -> str:
        return "static"

    @property
    def use_agent_store(self) -> bool:
        return True

    def next_rendezvous(self) -> RendezvousInfo:
        if self._store is None:  # a restart finds every node still there
            clock = _Clock(self._timeout, self._say)
            self._store = self._open(clock)
            self._join(self._store, clock)
        store = PrefixStore(self._run_id, self._store)
        return RendezvousInfo(store, self._rank, len(self._addrs),
                              RendezvousStoreInfo(*self._master))

    def _open(self, clock: _Clock) -> Store:
        addr, port = self._master
        if self._listener is not None:
            return _server_store(self._listener, addr, timedelta(seconds=self._timeout))
        return _client_store(addr, port, f"node 0 ({self._addrs[0]})", clock)

    def _join(self, store: Store, clock: _Clock) -> None:
        where = _endpoint(*self._master)
        try:
            store.set(f"{_NODE_KEY}{self._rank}", self._addrs[self._rank])
            while True:
                missing = [r for r in range(len(self._addrs))
                           if not store.check([f"{_NODE_KEY}{r}"])]
                if not missing:
                    return
                names = ", ".join(self._addrs[r] for r in missing)
                if clock.expired():
                    raise LaunchError(
                        f"node(s) {names} did not join the rendezvous at {where} within "
                        f"{clock.timeout:.0f} s (FLEETX_TIMEOUT): start fleetrun there with the "
                        f"same --ips, or set FLEETX_TIMEOUT to wait longer")
                clock.report(f"waiting for node(s) {names} to join the rendezvous at {where}")
                time.sleep(_POLL_SECONDS)
        except (RuntimeError, ValueError) as exc:  # torch's store errors; LaunchError is neither
            if isinstance(exc, LaunchError):
                raise
            raise LaunchError(f"lost the rendezvous store at {where} (served by node 0, "
                              f"{self._addrs[0]}): {_first_line(exc)}") from None

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None:
        pass

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return self._run_id

    def shutdown(self) -> bool:
        return True


# -- elastic jobs -----------------------------------------------------------------------------
class ElasticRendezvous(DynamicRendezvousHandler):
    """torch's dynamic rendezvous, saying every few seconds what it waits for, failing with one
    line at the join timeout, and serving the workers' store on this node's address only."""

    _say: Say = staticmethod(_say)
    _where: str = ""
    _seen = 0  # participants last seen while waiting

    def next_rendezvous(self) -> RendezvousInfo:
        stop = threading.Event()
        watcher = threading.Thread(target=self._watch, args=(stop,), name="fleetrun-rdzv",
                                   daemon=True)
        watcher.start()
        try:
            return super().next_rendezvous()
        except RendezvousTimeoutError:
            stop.set()
            watcher.join()
            low, timeout = self._settings.min_nodes, self._settings.timeout.join.total_seconds()
            raise LaunchError(f"only {self._seen} of at least {low} node(s) joined the "
                              f"rendezvous at {self._where} within {timeout:.0f} s "
                              f"(FLEETX_TIMEOUT): {low - self._seen} node(s) missing; start "
                              f"fleetrun there with the same --nnodes and --master, or set "
                              f"FLEETX_TIMEOUT to wait longer") from None
        finally:
            stop.set()
            watcher.join()

    def _watch(self, stop: threading.Event) -> None:
        """Report the state of the round every few seconds while this node waits in it."""
        low, high = self._settings.min_nodes, self._settings.max_nodes
        clock = _Clock(self._settings.timeout.join.total_seconds(), self._say)
        self._seen = 0
        while not stop.wait(_POLL_SECONDS):
            # The joining thread replaces the state as a whole; reading it here is safe.
            state = self._state_holder.state
            if state.complete:
                continue
            joined = len(state.participants)
            # At the join timeout torch removes this node from the round before the error
            # reaches us: a count without it would report one node fewer than joined.
            if self._this_node in state.participants or not self._seen:
                self._seen = joined
            if joined < low or state.deadline is None:
                clock.report(f"waiting for node(s) to join the rendezvous at {self._where}: "
                             f"{joined} of at least {low} joined")
                continue
            left = (state.deadline - datetime.now(timezone.utc)).total_seconds()
            if left >= 1:
                clock.report(f"{joined} of {low}..{high} node(s) joined the rendezvous at "
                             f"{self._where}; starting in {left:.0f} s unless more join")

    def _create_tcp_store_server(self, master_addr, master_port):  # torch >= 2.5
        listener = serve(master_addr, master_port or 0, "choose another with --master")
        self._listener = listener  # the store serves on it as long as this handler lives
        return _server_store(listener, master_addr, _STORE_READ_TIMEOUT)


def elastic_handler(master_addr: str, master_port: int, min_nodes: int, max_nodes: int,
                    own_addr: str, timeout: float, run_id: str = "fleetx",
                    say: Say = _say) -> ElasticRendezvous:
    """The rendezvous of an elastic job; this node serves its store when ``master_addr`` is one
    of its addresses and no other process of the host serves it already.

    Raises:
        LaunchError: the store could not be served or reached within ``timeout``.
    """
    listener = None
    if hosts.is_local_address(master_addr):
        try:
            listener = hosts.listen(master_addr, master_port)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:  # in use: another node of this host serves it
                raise _cannot_serve(exc, master_addr, master_port, "") from None
    if listener is not None:
        store = _server_store(listener, master_addr, _STORE_READ_TIMEOUT)
    else:
        store = _client_store(master_addr, master_port, f"the node at --master {master_addr}",
                              _Clock(timeout, say))
    handler = ElasticRendezvous.from_backend(
        run_id, store, C10dRendezvousBackend(store, run_id), min_nodes, max_nodes, own_addr,
        RendezvousTimeout(join=timedelta(seconds=timeout)))
    handler._say, handler._where = say, _endpoint(master_addr, master_port)
    handler._master_listener = listener  # keep the store's socket for the handler's lifetime
    return handler
