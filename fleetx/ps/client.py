"""The worker's view of the servers (ps-lite's KVWorker): non-blocking pull and push + wait.

Every operation is batched: the ids of every table are de-duplicated on the client, grouped
by owning server (:func:`fleetx.ps.partition.route`), and sent as ONE request per server that
carries every table, never one per table or per id. Each call returns a :class:`Handle` at
once; ``handle.wait()`` gives the result. Replies land directly in their final arrays: a
pulled table's unique rows are grouped by server, so each server's rows are one contiguous
slice that the transport receives into, and dense slices go straight into the flat vector.

Example:
    >>> client = KVClient(config, rank=0, tables=tables)      # doctest: +SKIP
    >>> client.start()
    >>> rows = client.pull({"emb": ids}).wait().sparse["emb"].expand()
    >>> client.push({"emb": (ids, grads)}).wait()
    >>> client.stop()
"""
from __future__ import annotations

import logging
import os
import socket
from typing import Mapping, Optional, Sequence

import numpy as np

from fleetx.checkpoint import FileEntry
from fleetx.ps import kernels
from fleetx.ps.buffers import BufferPool
from fleetx.ps.api import (PSConfigError, Kind, Message, PSMode, PeerLostError, PSConfig, PSError,
                           Tables, endpoint_of)
from fleetx.ps.partition import Route, dense_ranges, route
from fleetx.ps.failover import Failover
from fleetx.ps.tracker import Handle, Tracker
from fleetx.ps.handshake import connect, resolve_secret
from fleetx.ps.transport import Heartbeats, Link

__all__ = ["KVClient", "SparseRows", "PullResult"]

log = logging.getLogger("fleetx.ps")

_F32 = np.dtype(np.float32)


class SparseRows:
    """The rows one pull returned for one table.

    Attributes:
        ids: the unique ids (grouped by server).
        values: their rows, ``(len(ids), dim)`` float32.
        inverse: ``requested_ids.reshape(-1) == ids[inverse]``.
        shape: the shape of the requested ids.
    """

    __slots__ = ("ids", "values", "inverse", "shape")

    def __init__(self, ids, values, inverse, shape) -> None:
        self.ids, self.values, self.inverse, self.shape = ids, values, inverse, shape

    def expand(self) -> np.ndarray:
        """One row per requested id: ``(*shape, dim)``."""
        return self.values[self.inverse].reshape(tuple(self.shape) + (self.values.shape[1],))


class PullResult:
    """``sparse``: table -> :class:`SparseRows`; ``dense``: table -> full flat weights."""

    __slots__ = ("sparse", "dense")

    def __init__(self, sparse: dict, dense: dict) -> None:
        self.sparse, self.dense = sparse, dense


class KVClient:
    """Connections from one worker to every server.

    Args:
        config: the cluster.
        rank: this worker's index in ``[0, config.num_workers)``; heter worker ``i`` is rank
            ``config.num_workers + i``.
        tables: every table of the job (must match the servers').
        infer: this worker only reads (inference): HELLO says so, and a read-only server
            (an inference-only job) accepts only such workers.
    """

    def __init__(self, config: PSConfig, rank: int, tables: Tables, infer: bool = False) -> None:
        ranks = config.num_workers + config.num_heter_workers
        if not 0 <= rank < ranks:
            raise PSConfigError(f"worker rank {rank} outside [0, {ranks})")
        self.config, self.rank, self.tables, self.infer = config, rank, tables, infer
        self._dense_ranges = {t.name: dense_ranges(t.numel, config.num_servers)
                              for t in tables.dense}
        self._tracker = Tracker()
        self._links: list[Link] = []
        self._lost: Optional[PeerLostError] = None
        self._heartbeats: Optional[Heartbeats] = None
        self.initialized: set[str] = set()  # tables some server already holds (a checkpoint)
        # failover: the servers knew this rank (a restarted worker), and the job is past its
        # start barrier (server 0 says)
        self.rejoined = self.started = False
        self._retired = {"sent": 0, "received": 0}  # bytes of links failover replaced
        self._registered = False
        self._pool = BufferPool()
        self._key = b""
        self._failover = Failover(self) if config.failover else None

    # ------------------------------------------------------------------ life cycle

    def start(self) -> None:
        """Connect to every server (waiting up to ``config.timeout`` for them), prove that this
        process holds the job's secret (and check that each server does), and say HELLO.

        Raises:
            PSTimeoutError: a server is not reachable (named in the message).
            AuthError: a server rejected this process's secret, or did not prove it holds it.
            PSConfigError: a server has another table layout or mode; the secret file is
                unreadable.
        """
        c = self.config
        self._key = key = resolve_secret(c) or b""
        self._heartbeats = Heartbeats(c.heartbeat_interval)
        for i in range(c.num_servers):
            host, port = endpoint_of(c.servers, i)
            name = f"server {i} ({c.servers[i]})"
            link = self._connect(host, port, name, key)
            link.peer_info["index"] = i
            self._links.append(link.start())
            self._heartbeats.add(link)
        meta = self._hello_meta()
        replies = self._request(Kind.HELLO, {s: (meta, [], None) for s in self._servers()},
                                None).wait(c.timeout)
        for r in replies:
            self.initialized |= set(r.meta.get("initialized", ()))
        self.rejoined = any(r.meta.get("rejoined") for r in replies)
        self.started = bool(replies[0].meta.get("started"))
        self._registered = True
        kernels.log_backend(log, f"worker {self.rank}")

    def _hello_meta(self) -> dict:
        meta = {"rank": self.rank, "pid": os.getpid(), "host": socket.gethostname(),
                "fingerprint": self.tables.fingerprint(), "mode": self.config.mode.value}
        if self.infer:
            meta["infer"] = True
        return meta

    def _connect(self, host: str, port: int, name: str, key: bytes,
                 timeout: Optional[float] = None) -> Link:
        """A link to one server over the configured transport (``PSConfig.transport``), not
        yet started; ``timeout``: how long to keep trying (default ``PSConfig.timeout``)."""
        c = self.config
        timeout = c.timeout if timeout is None else timeout
        options = {"on_message": self._on_reply, "on_lost": self._on_lost,
                   "dead_after": c.dead_after, "allocator": self._allocate,
                   "max_frame_bytes": c.max_frame_bytes}
        if c.transport == "zmq":  # loopback-only comparison: no handshake
            from fleetx.ps.transport_zmq import connect_link
            return connect_link(host, port, name, timeout, **options)
        return Link(connect(host, port, name, timeout, key, local=c.local_sockets), name,
                    **options)

    def stop(self) -> None:
        """Say BYE to every server (they stop counting this worker) and disconnect."""
        try:
            if self._lost is None and self._registered:
                self._registered = False
                # failover: a restarting server must hear it too, or it waits for this worker
                wait = self.config.timeout if self._failover else self.config.dead_after
                self._request(Kind.BYE, {s: ({}, [], None) for s in self._servers()},
                              None).wait(wait)
        except PSError as e:  # stopping anyway; the servers treat the close as a loss
            log.warning("worker %d: BYE failed: %s", self.rank, e)
        finally:
            if self._failover is not None:
                self._failover.stopping = True
            for link in self._links:
                link.close()
            if self._heartbeats:
                self._heartbeats.stop()

    def _array(self, numel: int) -> np.ndarray:
        """A float32 array for a reply to land in: from the pool, so that the memory of the
        arrays a step no longer holds (rows of the last batch, replaced dense weights) is
        written again instead of being given back and faulted in anew."""
        return self._pool.take(_F32, 4 * numel)

    def _servers(self) -> range:
        return range(self.config.num_servers)

    def _on_reply(self, link: Link, msg: Message) -> None:
        if self._failover is not None:
            self._failover.replied(link.peer_info["index"], msg)
        self._tracker.resolve(msg, link.name)

    def _on_lost(self, link: Link, reason: str) -> None:
        if self._failover is not None and self._failover.lost(link, reason):
            return  # reconnecting: the pending requests wait for the restarted server
        err = PeerLostError(link.name, reason)
        self._lost = self._lost or err
        self._tracker.fail_peer(link.peer_info["index"], err)

    def _allocate(self, msg: Message, descs: list) -> Optional[list]:
        return self._tracker.targets(msg.req_id) if msg.is_reply and not msg.is_error else None

    def _request(self, kind: Kind, per_server: Mapping[int, tuple], finish) -> Handle:
        """Send ``per_server[s] = (meta, bufs, reply targets)`` to each server ``s``; one
        handle whose ``finish`` receives the replies in the order of ``per_server``."""
        if self._lost is not None:
            raise self._lost
        handle = Handle(len(per_server), finish)
        for part, (s, (meta, bufs, targets)) in enumerate(per_server.items()):
            req = self._tracker.register(handle, part, s, targets, kind.name)
            msg = Message(kind, req, meta, bufs)
            if self._failover is not None:
                self._tracker.attach(req, msg)
                self._failover.send(s, msg)
                continue
            try:
                self._links[s].send(msg)
            except PeerLostError as e:
                self._tracker.forget(req, e)
        return handle

    # ------------------------------------------------------------------ routing helpers

    def _route(self, name: str, ids) -> Route:
        spec = self.tables.get(name)
        ids = np.asarray(ids)
        if not hasattr(spec, "dim"):
            raise PSConfigError(f"table {name!r} is dense; sparse ids cannot address it")
        if ids.size and ids.dtype.kind not in "iu":
            raise PSConfigError(f"table {name!r}: ids must be integers, got {ids.dtype}")
        if spec.num_embeddings is not None and ids.size and (
                ids.min() < 0 or ids.max() >= spec.num_embeddings):
            raise PSConfigError(f"table {name!r}: ids must be in [0, {spec.num_embeddings}); "
                              f"got [{ids.min()}, {ids.max()}]")
        return route(ids, self.config.num_servers, self.config.shard_num)

    def _dense_part(self, name: str, s: int, flat: np.ndarray) -> np.ndarray:
        start, stop = self._dense_ranges[name][s]
        return flat[start:stop]

    @staticmethod
    def _merge(r: Route, grads: np.ndarray, dim: int) -> np.ndarray:
        """Per unique id (in the route's order): the sum of its gradients."""
        grads = np.ascontiguousarray(grads, np.float32).reshape(len(r.inverse), dim)
        if len(r.ids) < len(r.inverse):
            return kernels.segment_sum(r.inverse, grads, len(r.ids))
        if np.array_equal(r.inverse, np.arange(len(r.inverse))):
            return grads
        out = np.empty_like(grads)
        out[r.inverse] = grads
        return out

    # ------------------------------------------------------------------ operations

    def pull(self, sparse: Optional[Mapping[str, np.ndarray]] = None,
             dense: Sequence[str] = (), create: bool = True) -> Handle:
        """Read rows of sparse tables (any int64 ids, any shape) and/or whole dense tables.

        ``create=False``: unknown ids are not inserted (their would-be initial rows are
        returned), for evaluation and inference. The handle's result is a
        :class:`PullResult`. Never waits for other workers.
        """
        sparse = dict(sparse or {})
        routes = {n: self._route(n, ids) for n, ids in sparse.items()}
        values = {n: self._array(len(r.ids) * self.tables.get(n).dim).reshape(
            len(r.ids), self.tables.get(n).dim) for n, r in routes.items()}
        flat = {n: self._array(self.tables.get(n).numel) for n in dense}
        per_server = {}
        for s in self._servers():
            names = [n for n, r in routes.items() if r.offsets[s + 1] > r.offsets[s]]
            if not names and not dense:
                continue
            targets = [values[n][routes[n].offsets[s]:routes[n].offsets[s + 1]] for n in names]
            targets += [self._dense_part(n, s, flat[n]) for n in dense]
            per_server[s] = ({"sparse": names, "dense": list(dense), "create": create},
                             [routes[n].part(s) for n in names], targets)

        def finish(_):
            return PullResult({n: SparseRows(r.ids, values[n], r.inverse, np.shape(sparse[n]))
                               for n, r in routes.items()}, flat)
        return self._request(Kind.PULL, per_server, finish)

    def push(self, sparse: Optional[Mapping[str, tuple]] = None,
             dense: Optional[Mapping[str, np.ndarray]] = None, *, delta: bool = False,
             pull_dense: Sequence[str] = (), geo_pull: Optional[Sequence[str]] = None,
             out: Optional[Mapping[str, np.ndarray]] = None) -> Handle:
        """Send gradients (or GEO deltas with ``delta=True``): ``sparse[table] = (ids, grads)``
        with duplicates allowed (they are summed here), ``dense[table] = flat gradient``. For a
        show/click table each id's row is its gradient followed by show and click.

        In sync mode every server gets a push (possibly empty) so its round can complete.
        ``pull_dense``: the reply carries these dense tables' new weights (push and pull in one
        round trip). ``geo_pull``: the reply carries, per listed table, the rows changed since
        this worker's last exchange. The handle's result is ``(dense, geo)``: table -> flat
        weights, and table -> ``(ids, rows)``. ``out[table]``: a contiguous float32 array of the
        table's size to receive its weights into (no copy); nothing may read it until the
        handle is done.
        """
        meta = {"kind": "delta" if delta else "grad", "pull_dense": list(pull_dense)}
        if geo_pull is not None:
            meta["geo_pull"] = list(geo_pull)
        every = self.config.mode == PSMode.SYNC or geo_pull is not None or bool(pull_dense)
        flat = {n: _target(out, n, self.tables.get(n).numel, self._array) for n in pull_dense}
        # geo replies have a variable number of rows: let the transport allocate those
        direct = None if geo_pull is not None else flat
        per_server = self._push_parts(sparse, dense, meta, every, direct)
        order = list(per_server)

        def finish(replies):
            geo = {}
            for i, n in enumerate(geo_pull or ()):
                ids = [r.bufs[2 * i] for r in replies]
                dim = self.tables.get(n).dim
                rows = [r.bufs[2 * i + 1].reshape(len(k), dim) for r, k in zip(replies, ids)]
                geo[n] = (np.concatenate(ids), np.concatenate(rows))
            if direct is None:  # dense weights follow the geo rows in each reply
                k = 2 * len(geo_pull or ())
                for j, n in enumerate(pull_dense):
                    for s, r in zip(order, replies):
                        self._dense_part(n, s, flat[n])[:] = r.bufs[k + j]
            return flat, geo
        return self._request(Kind.PUSH, per_server, finish)

    def _push_parts(self, sparse, dense, meta: dict, every: bool,
                    pull_into: Optional[dict]) -> dict:
        """``per_server`` for a PUSH or INIT: each server's ids and merged rows per sparse
        table, then its slice of every dense table."""
        sparse, dense = dict(sparse or {}), dict(dense or {})
        merged = {}
        for n, (ids, grads) in sparse.items():
            r, spec = self._route(n, ids), self.tables.get(n)
            width = spec.push_width if "kind" in meta else spec.dim  # a PUSH, or INIT rows
            merged[n] = (r, self._merge(r, grads, width))
        dense = {n: np.asarray(v, np.float32).reshape(-1) for n, v in dense.items()}
        per_server = {}
        for s in self._servers():
            names = [n for n, (r, _) in merged.items() if r.offsets[s + 1] > r.offsets[s]]
            if not names and not dense and not every:
                continue
            bufs = []
            for n in names:
                r, g = merged[n]
                bufs += [r.part(s), g[r.offsets[s]:r.offsets[s + 1]]]
            bufs += [self._dense_part(n, s, v) for n, v in dense.items()]
            targets = None if pull_into is None else \
                [self._dense_part(n, s, v) for n, v in pull_into.items()]
            per_server[s] = ({**meta, "sparse": names, "dense": list(dense)}, bufs, targets)
        return per_server

    def init(self, sparse: Optional[Mapping[str, tuple]] = None,
             dense: Optional[Mapping[str, np.ndarray]] = None, force: bool = False) -> Handle:
        """Assign initial values (worker 0 at start: the model's parameters, and the weights of
        tables built from ``nn.Embedding``): ``sparse[table] = (ids, rows)``,
        ``dense[table] = flat weights``. Servers that already hold a table (loaded from a
        checkpoint) keep it unless ``force``. Result: the tables some server assigned."""
        per_server = self._push_parts(sparse, dense, {"force": bool(force)}, True, None)
        return self._request(Kind.INIT, per_server, lambda replies: {
            n for r in replies for n in r.meta.get("applied", ())})

    def set_lr(self, lr: float, tables: Optional[Sequence[str]] = None) -> Handle:
        """Change the learning rate of the listed tables' rules (all tables by default)."""
        meta = {"lr": float(lr), "tables": list(tables) if tables else None}
        return self._request(Kind.SET_LR, {s: (meta, [], None) for s in self._servers()}, None)

    def barrier(self, name: str = "") -> Handle:
        """Completes once every worker that has not stopped entered barrier ``name``. May wait
        long (a peer loading data); a dead peer makes it fail, naming that peer."""
        return self._request(Kind.BARRIER, {0: ({"name": name}, [], None)}, None)

    def save(self, dirname: str, save_id: str, mode=0) -> Handle:
        """Every server writes its shards into save ``save_id`` of checkpoint ``dirname``
        (:class:`fleetx.checkpoint.SaveWriter`), which the caller then commits; ``mode``: 0
        everything, 1 a base, 2 a delta, ``"export"`` weights for serving. Result:
        ``(rows saved per table, [FileEntry of every file the servers wrote])``."""
        def finish(replies):
            rows, files, _ = _saved(replies)
            return rows, files
        return self._save(dirname, save_id, mode, finish)

    def save_with_chain(self, dirname: str, save_id: str, mode=0) -> Handle:
        """:meth:`save`, with each server's reply meta as a third result (the delta chain each
        server continues: ``chain = {"base", "prev"}``)."""
        return self._save(dirname, save_id, mode, _saved)

    def _save(self, dirname: str, save_id: str, mode, finish) -> Handle:
        meta = {"dirname": os.path.abspath(dirname), "save_id": save_id, "mode": mode}
        return self._request(Kind.SAVE, {s: (meta, [], None) for s in self._servers()}, finish)

    def shrink(self, threshold: Optional[int] = None) -> Handle:
        """End a pass on every server (decay, evict, forget pending ids); ``threshold``
        replaces each table's ``delete_after_unseen_days``. Result: ``{table: {"removed",
        "forgotten", "rows"}}`` summed over the servers."""
        def finish(replies):
            out: dict = {}
            for r in replies:
                for n, d in r.meta.get("tables", {}).items():
                    acc = out.setdefault(n, {})
                    for k, v in d.items():
                        acc[k] = acc.get(k, 0) + v
            return out
        meta = {"threshold": threshold}
        return self._request(Kind.SHRINK, {s: (meta, [], None) for s in self._servers()},
                             finish)

    def turn_to_inference(self) -> Handle:
        """Tell every server that this worker only reads from now on (INFER): its writes are
        refused and the sync rounds go on without it."""
        self.infer = True
        return self._request(Kind.INFER, {s: ({}, [], None) for s in self._servers()}, None)

    def latency(self, histograms: bool = False):
        """Send-to-reply latency of this client's requests so far, per message kind name (the
        tracker's timing, :mod:`fleetx.ps.latency`): ``{"PULL": {"count", "p50", "p99",
        "p999"}, ...}`` in seconds; ``histograms=True``: a copy of the histograms themselves
        (:class:`~fleetx.ps.latency.Latencies`, to merge several workers' or subtract an
        earlier copy). A request failover sent again counts from its first send.

        Examples:
            >>> client.latency()["PULL"]["p99"]      # doctest: +SKIP
            0.00213
        """
        lat = self._tracker.latency()
        return lat if histograms else lat.summary()

    def traffic(self) -> dict:
        """Bytes this client sent to and received from the servers so far, whole frames
        (header, descriptors, meta and payload; heartbeats included), over every link it had
        (a link failover replaced counts too): ``{"sent": int, "received": int}``.

        Examples:
            >>> client.traffic()["received"]          # doctest: +SKIP
            1048576
        """
        # the ZeroMQ comparison transport counts nothing
        sent = sum(getattr(link, "bytes_sent", 0) for link in self._links)
        received = sum(getattr(link, "bytes_received", 0) for link in self._links)
        return {"sent": self._retired["sent"] + sent,
                "received": self._retired["received"] + received}

    def _retire(self, link) -> None:
        """Failover replaces ``link``: keep what it carried in :meth:`traffic`."""
        self._retired["sent"] += getattr(link, "bytes_sent", 0)
        self._retired["received"] += getattr(link, "bytes_received", 0)

    def stats(self) -> Handle:
        """Each server's :meth:`PSServer.stats`, in server order."""
        return self._request(Kind.STATS, {s: ({}, [], None) for s in self._servers()},
                             lambda replies: [r.meta for r in replies])


def _saved(replies) -> tuple[dict, list, list]:
    """``(rows per table, files, reply metas)`` of the servers' SAVE replies."""
    rows: dict = {}
    files = []
    for r in replies:
        for n, k in r.meta.get("rows", {}).items():
            rows[n] = rows.get(n, 0) + k
        files += [FileEntry.from_json(k, v) for k, v in r.meta.get("files", {}).items()]
    return rows, files, [r.meta for r in replies]


def _target(out: Optional[Mapping[str, np.ndarray]], name: str, numel: int,
            new) -> np.ndarray:
    """``out[name]`` as a flat view when it can receive a dense table in place, else
    ``new(numel)``."""
    given = out.get(name) if out else None
    if given is not None and given.dtype == np.float32 and given.size == numel \
            and given.flags.c_contiguous and given.flags.writeable:
        return given.reshape(-1)
    return new(numel)
