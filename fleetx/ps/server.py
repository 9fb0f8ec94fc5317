"""The server: one process holding a shard of every table and serving every worker.

Threads: one accepts connections, one receive thread per worker link (transport), one
heartbeat thread, and a single handler thread that owns all tables. Receive threads only
enqueue; the handler applies requests one at a time, so tables need no locks (Paddle gives
each shard one task thread for the same reason) and a worker's requests are applied in the
order it sent them.

Modes (``PSConfig.mode``):

* sync: a PUSH joins the current round; when every worker that has not stopped has pushed,
  the server applies the mean of their gradients and only then answers all of them. So once a
  worker's step returns, its later pulls see that step. Pulls are answered at once (they never
  wait for other workers, also after those stopped).
* async: a PUSH is applied on arrival.
* GEO: pushes carry parameter deltas, added as they come (a ``sum`` rule replaces the
  table's); the server remembers which rows changed since each worker's last exchange and
  returns exactly those.

Liveness: a worker that dies, closes its connection or stops sending heartbeats is declared
lost; every request waiting on it (a sync round, a barrier) fails with a PeerLostError naming
it, and :meth:`PSServer.run` raises it once no worker is left. Workers that do not connect
within ``PSConfig.timeout`` are lost the same way, and so is a worker whose heartbeats still
come but which sent no request for ``timeout`` seconds while others waited for it in a sync
round or barrier (its process is alive but stuck). Every ``log_interval`` the server logs its
rows, memory and requests/s.

Validation: every request is checked against the tables before it changes anything
(:mod:`fleetx.ps.requests`); a refused request is answered with the error, counted in STATS
(``rejected``) and logged as a rate-limited warning. A sync push joins its round
only once it is known to apply, and a round that still fails answers every member with the
error. SAVE writes only under ``PSConfig.save_root`` (default: the working directory).

Inference (``docs/ps_inference.md``): a server started ``read_only`` serves an inference-only
job, and a worker that sent INFER has turned to inference; either way PUSH, INIT, SET_LR and a
PULL that may create rows are refused with a :class:`RequestError` naming the mode, and such a
worker leaves the sync rounds (as after BYE) while still taking part in barriers.

Heter workers (``PSConfig.heter_workers``, ``docs/heter.md``) connect as the ranks after the
trainers': their pushes are applied on arrival in every mode, they take no part in sync rounds
or barrier counts, and the server finishes once they, too, said BYE.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import Any, Optional

from fleetx.checkpoint import CheckpointError
from fleetx.ps import kernels, readonly, requests
from fleetx.ps.api import (PSConfigError, Kind, Message, PSMode, PeerLostError, ProtocolError,
                           PSConfig, PSError, Tables, endpoint_of)
from fleetx.ps.checkpoint import confine
from fleetx.ps.requests import Push
from fleetx.ps.roster import Roster
from fleetx.ps.shard_requests import ShardRequests
from fleetx.ps.rounds import Waiting, Waits, stalled
from fleetx.ps.shard import Shard
from fleetx.ps.snapshots import Snapshots
from fleetx.ps.acceptor import HANDSHAKE_TIMEOUT, Acceptor, RateLimitedLog
from fleetx.ps.handshake import require_secret
from fleetx.ps.links import LinkSet
from fleetx.ps.transport import Link

__all__ = ["PSServer", "run_server"]

log = logging.getLogger("fleetx.ps")

#: requests of one connection waiting for the handler at once; more wait in that connection's
#: socket, so a flood from one peer delays the others' requests by at most this many
_MAX_INFLIGHT = 16
#: how often the handler looks for workers stuck while others wait for them
_STALL_CHECK_S = 0.25


class _Lost:
    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


class PSServer:
    """A parameter server.

    Args:
        config: the cluster (the same on every process).
        index: this server's position in ``config.servers``; it listens on that endpoint
            (port 0 picks a free port, see :attr:`endpoint`).
        tables: every table of the job.
        load_dir: start from a checkpoint written by ``save_persistables`` (it must lie under
            ``config.save_root``), or from a list: a base save, then its deltas in order.
        load_tables: load only these tables from it (None: all).
        capacity: sparse rows to preallocate per table.
        read_only: serve an inference-only job: every write is refused, naming the mode.

    Raises:
        PSConfigError: ``load_dir`` is outside the save root, or a table's shape changed.
        fleetx.checkpoint.CheckpointError: the checkpoint is missing, damaged or inconsistent.

    Example:
        >>> server = PSServer(config, 0, tables)   # doctest: +SKIP
        >>> server.run()                           # blocks until every worker stopped
    """

    def __init__(self, config: PSConfig, index: int, tables: Tables,
                 load_dir: Any = None, capacity: int = 1024,
                 load_tables: Optional[list] = None, read_only: bool = False) -> None:
        if not 0 <= index < config.num_servers:
            raise PSConfigError(f"server index {index} outside [0, {config.num_servers})")
        self.config, self.index, self.tables = config, index, tables
        self.read_only = read_only
        self.name = f"server {index} ({config.servers[index]})"
        self.save_root = os.path.realpath(config.save_root or os.getcwd())
        if load_dir:
            load_dir = [confine(str(d), self.save_root) for d in load_dir] \
                if isinstance(load_dir, (list, tuple)) else confine(load_dir, self.save_root)
        self._snapshots = Snapshots(config, index) if config.failover else None
        restart = self._snapshots is not None and config.restart_count > 0
        restoring = restart and self._snapshots.available()
        self.shard = Shard(config, index, tables, None if restoring else load_dir, capacity,
                           load_tables)
        self._pushes: dict[int, int] = {}  # pushes applied per worker rank (failover reports)
        self.restored = self._snapshots.restore(self.shard) if restoring else None
        if self.restored is not None:
            self._pushes = dict(self.restored.pushes)
            log.warning("%s: restarted (restart %d): loaded snapshot %s written %s from %s; "
                        "updates applied after it are lost", self.name, config.restart_count,
                        self.restored.save_id, self.restored.created, self._snapshots.dirname)
            if config.mode == PSMode.GEO:
                log.info("%s: GEO: the workers' next exchanges bring back all %d rows",
                         self.name, self.shard.geo_resend_all())
        elif restart:
            log.warning("%s: restarted (restart %d) before its first snapshot: starting as at "
                        "the first start (%s, the tables' initializers with the same seed); the "
                        "workers send their initial values again", self.name,
                        config.restart_count, f"loaded from {load_dir}" if load_dir else
                        "no checkpoint")
        if load_dir and not restoring:
            log.info("%s: loaded from %s", self.name, load_dir)
        self._queue: queue.Queue = queue.Queue()
        self.roster = Roster(config, read_only, self.name, on_change=self._progress)
        self._waits = Waits()  # sync rounds and barriers
        # a restarted server's workers passed the start barrier (a worker restarted later
        # must not wait there)
        self._waits.started = restart
        self._requests = 0
        self._refused = RateLimitedLog()  # requests refused, by kind
        self._skipped = RateLimitedLog()  # pushes skipped for NaN/inf (nonfinite="skip")
        self._done = threading.Event()
        self._acceptor: Optional[Acceptor] = None
        self._links: Optional[LinkSet] = None  # authenticated connections (connection_limit)
        self._threads: list[threading.Thread] = []
        tables = ShardRequests(config, self.shard, self.save_root)
        self._handlers = {Kind.HELLO: self._on_hello, Kind.BYE: self._on_bye,
                          Kind.PUSH: self._on_push, Kind.BARRIER: self._on_barrier,
                          Kind.INFER: self._on_infer,
                          Kind.STATS: lambda link, msg: msg.reply(self.stats()),
                          **tables.handlers()}

    # ------------------------------------------------------------------ life cycle

    @property
    def endpoint(self) -> str:
        """``host:port`` actually listened on (after :meth:`start`)."""
        return self._acceptor.endpoint if self._acceptor else self.config.servers[self.index]

    def start(self) -> "PSServer":
        """Listen and serve in background threads; returns at once.

        Raises:
            PSConfigError: no shared secret while listening on a non-loopback address, or the
                secret file cannot be read.
            PeerLostError: the endpoint cannot be listened on.
        """
        host, port = endpoint_of(self.config.servers, self.index)
        key = require_secret(self.config, host, self.name)
        self._links = LinkSet(self.config.connection_limit, self.config.heartbeat_interval,
                              self._done, self._link_options())
        self._acceptor = self._listen(host, port, key)
        self.name = f"server {self.index} ({self.endpoint})"
        self._acceptor.name = self.roster.name = self.name
        self.roster.started = time.monotonic()
        t = threading.Thread(target=self._serve, name="ps-handler", daemon=True)
        t.start()
        self._threads.append(t)
        self._acceptor.start()
        log.info("%s: listening on %s (%s), mode %s, %d workers expected%s", self.name,
                 self.endpoint, self.config.transport, self.config.mode.value,
                 self.config.num_workers, _serving(self.config, self.read_only))
        kernels.log_backend(log, self.name)
        return self

    def run(self) -> None:
        """Serve until every worker has stopped (or was lost).

        Raises:
            PeerLostError: a worker died or never connected (the first such worker is named).
        """
        if self._acceptor is None:
            self.start()
        try:
            while not self._done.wait(0.5):
                pass
        finally:
            self.stop()
        if self.roster.lost:
            raise self.roster.lost[0]

    def stop(self) -> None:
        """Stop serving and close every connection."""
        self._done.set()
        if self._acceptor:
            self._acceptor.close()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=5)
        if self._links:
            self._links.close()

    def _listen(self, host: str, port: int, key: bytes):
        """The front door of the configured transport (``PSConfig.transport``)."""
        if self.config.transport == "zmq":  # loopback-only comparison: no handshake
            from fleetx.ps.transport_zmq import Listener
            return Listener(host, port, self.name, self._links.has_room, self._links.serve,
                            self._links.options())
        # a connection silent for dead_after is dead; a real handshake takes about a millisecond
        return Acceptor(host, port, key, self.name, self._links.has_room, self._links.adopt,
                        handshake_timeout=min(HANDSHAKE_TIMEOUT, self.config.dead_after),
                        local=self.config.local_sockets, resolve_wait=self.config.timeout)

    def _link_options(self) -> dict:
        """Replies are queued per link, so a peer that stops reading never blocks the handler
        thread; a peer may have ``_MAX_INFLIGHT`` requests waiting for it."""
        return {"on_message": self._on_message, "on_lost": self._on_link_lost,
                "dead_after": self.config.dead_after,
                "max_frame_bytes": self.config.max_frame_bytes, "queued": True,
                "max_inflight": _MAX_INFLIGHT}

    def _on_message(self, link: Link, msg: Message) -> None:
        self._queue.put((link, msg))

    def _on_link_lost(self, link: Link, reason: str) -> None:
        if "rank" not in link.peer_info and reason != "connection closed by peer" and \
                not reason.startswith("protocol error"):
            # a registered worker's loss and a malformed frame are reported by the handler;
            # this one (a trickle, a reader too slow) would go unseen
            self._acceptor.events.warning("dropped", "%s: dropped %s: %s", self.name,
                                          link.name, reason)
        self._queue.put((link, _Lost(reason)))

    # ------------------------------------------------------------------ handler thread

    def _serve(self) -> None:
        next_log = time.monotonic() + self.config.log_interval
        next_stall_check = 0.0
        last_requests, last_t = 0, time.monotonic()
        while not self._done.is_set():
            try:
                link, item = self._queue.get(timeout=0.25)
            except queue.Empty:
                link = item = None
            if isinstance(item, _Lost):
                self._worker_lost(link, item.reason)
            elif item is not None:
                self._requests += 1
                self._dispatch(link, item)
                link.handled()  # the link may hand over its next request
            now = time.monotonic()
            self.roster.check_registration(now)
            if now >= next_stall_check:  # timeouts are seconds long: not on every request
                self.roster.check_away(now)
                self._check_stalls(now)
                next_stall_check = now + _STALL_CHECK_S
            if self._snapshots is not None and self._snapshots.due(now):
                self._snapshot()
            if now >= next_log:
                rate = (self._requests - last_requests) / (now - last_t)
                log.info("%s: %s", self.name, self._stats_line(rate))
                next_log, last_requests, last_t = now + self.config.log_interval, \
                    self._requests, now
            if self.roster.finished():
                self._done.set()

    def _snapshot(self) -> None:
        """Failover: snapshot the shard now (a failure is logged; serving goes on and the
        previous snapshot stays)."""
        try:
            self._snapshots.take(self.shard, self._pushes)
        except (CheckpointError, OSError) as e:
            self._snapshots.last = time.monotonic()  # try again after the interval
            log.error("%s: snapshot failed (the previous one stays): %s", self.name, e)

    def _dispatch(self, link: Link, msg: Message) -> None:
        try:
            if msg.kind != Kind.HELLO and "rank" not in link.peer_info:
                raise ProtocolError(f"{msg.kind.name} before HELLO")
            handler = self._handlers.get(msg.kind)
            if handler is None or msg.is_reply:
                raise ProtocolError(f"unexpected {msg.kind.name} frame")
            requests.check_meta(msg.kind.name, msg.meta)
            self._check_writable(link, msg)
            worker = self.roster.of(link)
            if worker is not None and worker.link is link:
                worker.last_request = time.monotonic()
            reply = handler(link, msg)
            if msg.kind == Kind.INIT and self._snapshots is not None:
                self._snapshot()  # answered once a restart would find the initial values
            if worker is not None and worker.link is link:  # a long SAVE/INIT is work too
                worker.last_request = time.monotonic()
        except (PSError, CheckpointError) as e:
            self._reject(link, msg, e)
            reply = msg.error_reply(e)
        except Exception as e:  # answer, never leave the worker waiting
            log.debug("%s: %s from %s failed", self.name, msg.kind.name, link.name,
                      exc_info=True)
            self._refused.warning(msg.kind.name, "%s: %s from %s failed: %s: %s", self.name,
                                  msg.kind.name, link.name, type(e).__name__, e)
            reply = msg.error_reply(e)
        if reply is not None:
            self._send(link, reply)

    def _reject(self, link: Link, msg: Message, error: Exception) -> None:
        """Count a refused request and warn (rate-limited) naming its sender and the reason."""
        if isinstance(error, PeerLostError):
            return  # not the sender's fault: a round it joined lost another worker
        self._refused.warning(msg.kind.name, "%s: refused %s from %s: %s: %s", self.name,
                              msg.kind.name, link.name, type(error).__name__, error)

    def _send(self, link: Link, msg: Message) -> None:
        try:
            link.send(msg)
        except PeerLostError:
            pass  # the link reported itself lost; its worker is handled there
        except ProtocolError as e:  # the reply cannot travel (over the frame limit): say so
            log.error("%s: reply to %s: %s", self.name, link.name, e)
            try:
                link.send(Message(msg.kind, msg.req_id).error_reply(e))
            except PSError:
                pass

    def _check_writable(self, link: Link, msg: Message) -> None:
        """Inference: refuse anything that would change a table (:mod:`.readonly`)."""
        what = readonly.write_of(msg.kind, msg.meta)
        worker = self.roster.of(link)
        if what and (self.read_only or (worker is not None and worker.infer)):
            raise readonly.refusal(what, self.name, self.read_only, worker and worker.name)

    # ------------------------------------------------------------------ workers

    def _on_hello(self, link: Link, msg: Message) -> Message:
        worker = self.roster.register(link, msg.meta, self.tables.fingerprint(),
                                      self.config.mode.value)
        meta = {"server": self.index, "initialized": sorted(self.shard.initialized),
                "read_only": self.read_only}
        if self.config.failover:  # a reconnecting worker tells what it lost
            rank = link.peer_info["rank"]
            # a rank that rejoins: the job started without it waiting at the start barrier
            meta["rejoined"], meta["started"] = worker.rejoins > 0, self._waits.started
            if worker.new_process:  # the new process counts its pushes from 0
                self._pushes.pop(rank, None)
            meta["restart"] = self.config.restart_count
            meta["restored"] = None if self.restored is None else {
                "save_id": self.restored.save_id, "created": self.restored.created,
                "pushes": self.restored.pushes.get(rank, 0)}
        return msg.reply(meta)

    def _on_infer(self, link: Link, msg: Message) -> Message:
        """The worker turned to inference: refuse its writes from now on, and let the sync
        rounds go on without it (it still counts in barriers)."""
        self.roster.turned_to_inference(link)
        return msg.reply()

    def _on_bye(self, link: Link, msg: Message) -> Message:
        self.roster.stopped(link)
        return msg.reply()

    def _worker_lost(self, link: Link, reason: str) -> None:
        if reason.startswith("protocol error"):  # the transport's words for a malformed frame
            self._refused.warning("frame", "%s: closed %s: %s", self.name, link.name, reason)
        if self.roster.link_lost(link, reason):  # failover: away; its rounds wait for it
            self._waits.forget(link.peer_info["rank"], link)

    def _progress(self) -> None:
        self._try_rounds()
        self._try_barriers()

    # ------------------------------------------------------------------ data requests

    def _on_push(self, link: Link, msg: Message) -> Optional[Message]:
        push = self._checked_push(link, msg)
        if self.config.mode == PSMode.SYNC and link.peer_info["rank"] < self.config.num_workers:
            self._waits.push(link.peer_info["rank"], Waiting(link, msg, push, time.monotonic()))
            self._try_rounds()
            return None
        self.shard.apply(push)
        return self._push_reply(link, msg, push)

    def _checked_push(self, link: Link, msg: Message) -> Push:
        """The push, checked; with ``nonfinite="skip"`` one holding NaN/inf becomes empty.

        Raises:
            RequestError: malformed, or non-finite values with ``nonfinite="refuse"``.
        """
        push = self.shard.parse_push("PUSH", msg.meta, msg.bufs)
        if not push.nonfinite:
            return push
        error = requests.nonfinite_error("PUSH", push, "gradients")
        if self.config.nonfinite == "refuse":
            raise error
        self._skipped.warning("PUSH", "%s: skipped a push from %s (FLEETX_PS_NONFINITE=skip): "
                              "%s", self.name, link.name, error)
        return Push([], [], push.nonfinite)

    def _push_reply(self, link: Link, msg: Message, push: Push) -> Message:
        rank = link.peer_info["rank"]  # applied: counted for the snapshots
        self._pushes[rank] = self._pushes.get(rank, 0) + 1
        meta = {"skipped_nonfinite": push.nonfinite} if push.nonfinite else {}
        return msg.reply(meta, self.shard.push_reply(msg.meta, link.peer_info["rank"]))

    def _try_rounds(self) -> None:
        """Sync: apply and answer every round that every expected worker has pushed to."""
        if self.roster.lost:
            return self._fail_waits()
        while True:
            entries = self._waits.next_round(self.roster.expected(rounds=True))
            if entries is None:
                return
            try:
                self.shard.apply_mean([e.payload for e in entries])
                replies = [self._push_reply(e.link, e.msg, e.payload) for e in entries]
            except Exception as e:  # every member hears of it; none is left waiting
                if not isinstance(e, PSError):
                    log.debug("%s: a sync round failed", self.name, exc_info=True)
                self._refused.warning("PUSH", "%s: a sync round of %d pushes failed: %s: %s",
                                      self.name, len(entries), type(e).__name__, e)
                replies = [entry.msg.error_reply(e) for entry in entries]
            for entry, reply in zip(entries, replies):
                self._send(entry.link, reply)

    def _fail_waits(self) -> None:
        """A worker was lost: every waiting round and barrier fails, naming it."""
        for entry in self._waits.drain():
            self._send(entry.link, entry.msg.error_reply(self.roster.lost[0]))

    def _on_barrier(self, link: Link, msg: Message) -> None:
        name = requests.parse_barrier(msg.meta)
        self._waits.enter(name, link.peer_info["rank"], Waiting(link, msg, None,
                                                                time.monotonic()))
        self._try_barriers()

    def _try_barriers(self) -> None:
        if self.roster.lost:
            return self._fail_waits()
        for members in self._waits.complete_barriers(self.roster.expected()):
            for entry in members:
                self._send(entry.link, entry.msg.reply())

    def _check_stalls(self, now: float) -> None:
        """A sync round or barrier waiting longer than ``timeout`` for workers that sent no
        request for that long: those workers are declared lost (their heartbeats prove the
        process lives, not that it works), which fails the wait for every member."""
        roster = self.roster
        if roster.lost:
            return
        timeout = self.config.timeout
        for stall in stalled(self._waits, roster.active_requests(), roster.expected(), now,
                             timeout, roster.expected(rounds=True)):
            w = roster.workers[stall.rank]
            if w.link is not None:
                w.link.close()  # it may wake up later: it must not rejoin a failed job
            waiters = ", ".join(f"worker {r}" for r in stall.arrived)
            roster.mark_lost(w, f"sent no request for {stall.silent_for:.0f} s while {waiters} "
                            f"waited in {stall.what} (timeout {timeout:g} s, FLEETX_TIMEOUT); "
                            "its heartbeats still came, so the process is alive but stuck")

    # ------------------------------------------------------------------ observability

    def stats(self) -> dict:
        """Rows and bytes per table, requests served, peak resident memory, requests refused
        (in all and by kind) and pushes skipped for non-finite values."""
        return {"server": self.index, "requests": self._requests, **self.shard.stats(),
                "workers": self.roster.states(),
                "rejected": sum(self._refused.counts.values()),
                "rejected_by_kind": dict(self._refused.counts),
                "skipped_pushes": self._skipped.counts["PUSH"],
                "connections": self._acceptor.counters() if self._acceptor else {}}

    def _stats_line(self, rate: float) -> str:
        s = self.stats()
        tables = ", ".join(f"{n} {r} rows" for n, r in s["rows"].items())
        mb = sum(s["table_bytes"].values()) / 2 ** 20
        return (f"{tables or 'no sparse tables'}; tables {mb:.1f} MiB, max RSS "
                f"{s['max_rss_bytes'] / 2 ** 20:.0f} MiB; {rate:.1f} requests/s")


def _serving(config: PSConfig, read_only: bool) -> str:
    """The end of the start-up line: heter workers and the inference-only mode."""
    heter = f", {config.num_heter_workers} heter workers" if config.num_heter_workers else ""
    return heter + (", inference only (read-only tables)" if read_only else "")


def run_server(config: PSConfig, index: int, tables: Tables, load_dir: Any = None,
               load_tables: Optional[list] = None, read_only: bool = False) -> None:
    """Build a :class:`PSServer` and serve until every worker stopped (``fleet.run_server``;
    ``load_tables``: load only these tables; ``read_only``: an inference-only job)."""
    PSServer(config, index, tables, load_dir=load_dir, load_tables=load_tables,
             read_only=read_only).run()
