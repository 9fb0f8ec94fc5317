"""GEO mode: workers train locally and exchange parameter deltas every ``k_steps``.

The worker keeps a local copy of everything it trains: the dense parameters are the model's
own (the user's torch optimizer steps them), and sparse rows live in local tables with the
optimizer's rule, created by pulling from the servers on first touch. Each local row also
keeps its *base*, the value it had at the last exchange.

Every ``k_steps`` steps, one request per server carries ``(local - base) / num_workers`` for
every dense table and every sparse row touched since the last exchange; the server adds the
deltas (a ``sum`` rule) and replies, in the same round trip, with the new dense weights and
every row that changed on it since this worker's last exchange (its own and other workers'
pushes).

The exchange runs beside training, not on its thread: at step ``k`` the training thread takes
a snapshot (the touched rows' values and the dense weights, a few vectorised copies) and hands
it to a sender thread, which routes, sends and waits for the reply; training goes on. The reply
*lands* at the first step after it arrived (at the latest before the next exchange), on the
training thread: every row ``r`` it carries becomes ``server[r] + (local[r] - snapshot[r])``,
i.e. the server's value plus what this worker trained on it since the snapshot, and its base
becomes ``server[r]``; the dense weights likewise. (A row not in the snapshot has its base as
snapshot: it was not touched before it.) With one worker the server's value is the snapshot's,
so this is exactly local training, up to float rounding of ``base + (local - base)``.

Rows fetched from the servers (first touch) are inserted only where still absent (a row this
worker trained meanwhile keeps its value), and every fetch in flight is absorbed before an
exchange lands, so a row changed by others reaches this worker either through the exchange or
through the fetch, never neither. Lookups read the local tables when the forward uses them, so
rows prefetched for the next batch are as fresh as rows looked up without prefetch.
"""
from __future__ import annotations

import queue
import threading
from typing import Optional

import numpy as np

from fleetx.ps import kernels
from fleetx.ps.api import PSMode, PSError, PSTimeoutError
from fleetx.ps.client import PullResult, SparseRows
from fleetx.ps_torch.communicator import Communicator
from fleetx.ps.rules import Rule, make_rule
from fleetx.ps.table import SparseTable

__all__ = ["GeoCommunicator"]

_POLL = 0.1  # s: how often waiting threads look at their stop flag


class _WithBase(Rule):
    """The optimizer's rule, with ``dim`` more columns per row holding the base value."""

    def __init__(self, inner: Rule) -> None:
        super().__init__(inner.config)
        self.inner, self.name = inner, inner.name

    def set_lr(self, lr):
        self.inner.set_lr(lr)
        self.config = self.inner.config

    def state_width(self, dim):
        return self.inner.state_width(dim) + dim

    def init_state(self, state, dim):
        k = self.inner.state_width(dim)
        self.inner.init_state(state[:, :k], dim)
        state[:, k:] = 0.0

    def apply(self, slab, rows, grads, dim):
        self.inner.apply(slab, rows, grads, dim)  # the kernels leave trailing columns alone


class _Fetch:
    """Rows of ids not held locally, requested from the servers."""

    __slots__ = ("handle", "create", "absorbed")

    def __init__(self, handle, create: bool) -> None:
        self.handle, self.create, self.absorbed = handle, create, False


class _LocalRows:
    """A GEO pull's handle: the fetch of absent rows is in flight; ``wait()`` inserts them and
    reads every row from the local tables (so the values are those at the time of use)."""

    def __init__(self, comm: "GeoCommunicator", wanted: dict, fetch: Optional[_Fetch],
                 shapes: dict, create: bool) -> None:
        self._comm, self._wanted, self._fetch = comm, wanted, fetch
        self._shapes, self._create = shapes, create
        self._result: Optional[PullResult] = None

    def done(self) -> bool:
        return self._fetch is None or self._fetch.handle.done()

    def wait(self, timeout: Optional[float] = None) -> PullResult:
        if self._result is None:
            self._result = self._comm._read(self._wanted, self._fetch, self._shapes,
                                            self._create)
        return self._result


class _Exchange:
    """One exchange: its snapshot, and (once the sender thread got it) the reply."""

    __slots__ = ("sparse", "dense", "snapshot", "dense_snapshot", "reply", "error", "done")

    def __init__(self, sparse, dense, snapshot, dense_snapshot) -> None:
        self.sparse, self.dense = sparse, dense
        self.snapshot, self.dense_snapshot = snapshot, dense_snapshot
        self.reply, self.error = None, None
        self.done = threading.Event()


class GeoCommunicator(Communicator):
    """Local training with a delta exchange every ``comm.k_steps`` steps, sent and awaited by
    a sender thread while training goes on."""

    mode = PSMode.GEO

    def _started(self, dense):
        self._local = {t.name: SparseTable(t, _WithBase(make_rule(t.rule)))
                       for t in self.tables.sparse}
        self._base = {n: np.array(v, np.float32) for n, v in dense.items()}
        self._touched = {n: np.zeros(1024, bool) for n in self._local}  # per local row
        self._known: dict = {n: [] for n in self._local}  # unique ids lookups returned
        self._fetches: list[_Fetch] = []
        self._steps = self._unsent = 0
        self._params: dict = {}
        self._inflight: Optional[_Exchange] = None
        self._jobs: queue.Queue = queue.Queue(maxsize=1)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._send_loop, name="ps-geo-send", daemon=True)
        self._thread.start()

    def _base_cols(self, table: SparseTable) -> slice:
        return slice(table.width - table.dim, table.width)

    # -- lookups -----------------------------------------------------------------------------
    def pull_sparse(self, ids, create=True):
        """Rows from the local tables; ids not held are fetched from the servers (one request
        per server, in flight until the handle is waited for)."""
        wanted = {n: kernels.unique_inverse(i) for n, i in ids.items()}
        missing = {}
        for n, (uniq, _) in wanted.items():
            absent = uniq[self._local[n].index.find(uniq) < 0]
            if len(absent):
                missing[n] = absent
        fetch = _Fetch(self.client.pull(missing, create=create), create) if missing else None
        if fetch is not None and create:
            self._fetches.append(fetch)
        return _LocalRows(self, wanted, fetch, {n: np.shape(i) for n, i in ids.items()}, create)

    def _read(self, wanted: dict, fetch: Optional[_Fetch], shapes: dict,
              create: bool) -> PullResult:
        fetched = {}
        if fetch is not None:
            fetched = self._absorb(fetch) if create else fetch.handle.wait().sparse
        out = {}
        for n, (uniq, inv) in wanted.items():
            table = self._local[n]
            values = table.pull(uniq, create=False)
            if not create and n in fetched:  # evaluation: use, but do not keep, fetched rows
                absent = table.index.find(uniq) < 0
                pos = np.searchsorted(uniq, fetched[n].ids)
                keep = absent[pos]
                values[pos[keep]] = fetched[n].values[keep]
            if create:
                self._known[n].append(uniq)
            out[n] = SparseRows(uniq, values, inv, shapes[n])
        return PullResult(out, {})

    def _absorb(self, fetch: _Fetch) -> dict:
        """Insert a fetch's rows where still absent (weights and base); returns its rows."""
        sparse = fetch.handle.wait().sparse
        if not fetch.absorbed:
            fetch.absorbed = True
            self._fetches.remove(fetch)
            for n, f in sparse.items():
                table = self._local[n]
                absent = table.index.find(f.ids) < 0
                if absent.any():
                    ids, rows = f.ids[absent], f.values[absent]
                    table.assign(ids, rows)
                    table.slab[table.index.find(ids), self._base_cols(table)] = rows
        return sparse

    # -- steps -------------------------------------------------------------------------------
    def step(self, params, grads, sparse_grads):
        """Apply the sparse gradients locally (the dense ones were applied by the user's
        optimizer); land an exchange that arrived; start one every ``k_steps`` steps.

        Raises:
            PSError: the last exchange failed (the message names the server).
        """
        for n, (ids, g) in sparse_grads.items():
            self._train_rows(n, ids, g)
        for known in self._known.values():
            known.clear()
        self._steps += 1
        self._unsent += 1
        self._params = params
        if self._inflight is not None and self._inflight.done.is_set():
            self._land(params)
        if self._steps % self.comm.k_steps == 0:
            self._exchange(params)

    def _train_rows(self, name: str, ids: np.ndarray, grads: np.ndarray) -> None:
        table = self._local[name]
        if any(ids is k for k in self._known[name]):  # a lookup's own unique ids: no sorting
            uniq, summed = ids, np.asarray(grads, np.float32).reshape(len(ids), table.dim)
        else:
            uniq, inv = kernels.unique_inverse(ids)
            summed = kernels.segment_sum(inv, np.asarray(grads, np.float32).reshape(
                len(inv), table.dim), len(uniq))
        rows = table.index.find(uniq)
        if (rows < 0).any():  # rows never looked up: fetch their base first
            self.pull_sparse({name: uniq}).wait()
            rows = table.index.find(uniq)
        table.push(uniq, summed)
        touched = self._touched[name]
        if len(touched) < len(table):
            grown = np.zeros(max(len(table), 2 * len(touched)), bool)
            grown[:len(touched)] = touched
            touched = self._touched[name] = grown
        touched[rows] = True

    def flush(self):
        """Exchange now if local steps are pending, and wait until it landed (at save, barrier
        and stop)."""
        if not hasattr(self, "_thread"):  # never started
            return
        if self._inflight is not None:
            self._land(self._params)
        if self._unsent:
            self._exchange(self._params)
            self._land(self._params)

    def set_lr(self, lr, tables=None):
        """The optimizer runs here in GEO mode: change the local rules' lr (the fleet layer
        changes the torch optimizer's)."""
        for n, t in self._local.items():
            if not tables or n in tables:
                t.rule.set_lr(lr)

    def stop(self):
        try:
            self.flush()
        finally:
            if hasattr(self, "_thread"):
                self._stopping.set()
                self._thread.join(timeout=self.config.dead_after)
            self.client.stop()

    # -- exchanges ---------------------------------------------------------------------------
    def _exchange(self, params) -> None:
        """Snapshot the deltas on this thread and hand them to the sender thread."""
        if self._inflight is not None:
            self._land(params)
        scale = np.float32(1.0 / self.config.num_workers)
        sparse, snapshot = {}, {}
        for n, table in self._local.items():
            rows = np.flatnonzero(self._touched[n][:len(table)])
            if not len(rows):
                continue
            self._touched[n][rows] = False
            block = table.slab[rows]
            local = block[:, :table.dim]
            sparse[n] = (table.index.keys[rows], (local - block[:, self._base_cols(table)]) * scale)
            snapshot[n] = (rows, local)
        dense_snapshot = {n: np.array(params[n], np.float32).reshape(-1) for n in self._base}
        dense = {n: (v - self._base[n]) * scale for n, v in dense_snapshot.items()}
        job = _Exchange(sparse, dense, snapshot, dense_snapshot)
        self._inflight, self._unsent = job, 0
        self._jobs.put(job)  # never blocks: at most one exchange is in flight

    def _land(self, params) -> None:
        """Wait for the exchange in flight (bounded by the servers' liveness) and apply its
        reply: ``local += server - snapshot``, ``base = server``."""
        job, self._inflight = self._inflight, None
        while not job.done.wait(_POLL):
            if not self._thread.is_alive():
                raise PSError("GEO exchange: the sender thread ended without an answer")
        if job.error is not None:
            raise PSError(f"GEO exchange failed: {job.error}") from job.error
        for fetch in list(self._fetches):  # rows requested before the exchange come first
            self._absorb(fetch)
        flat, geo = job.reply
        for n, (ids, server) in geo.items():
            self._land_rows(self._local[n], ids, server, job.snapshot.get(n))
        for n, values in flat.items():
            target = params[n]  # in place, whatever its shape: it is the model's (or its copy)
            target += (values - job.dense_snapshot[n]).reshape(np.shape(target))
            self._base[n] = values.copy()

    def _land_rows(self, table: SparseTable, ids, server, snapshot) -> None:
        local = table.index.find(ids)
        held = local >= 0
        rows, server = local[held], server[held]
        base = self._base_cols(table)
        reference = table.slab[rows, base]  # rows untouched at the snapshot: their base
        if snapshot is not None:
            snap_rows, snap_values = snapshot
            at = np.minimum(np.searchsorted(snap_rows, rows), len(snap_rows) - 1)
            hit = snap_rows[at] == rows
            reference[hit] = snap_values[at[hit]]
        table.slab[rows, :table.dim] += server - reference
        table.slab[rows, base] = server

    def _send_loop(self) -> None:
        """The sender thread: one exchange at a time; every wait bounded (a poll of the stop
        flag, and the link's liveness fails a reply that cannot come)."""
        while not self._stopping.is_set():
            try:
                job = self._jobs.get(timeout=_POLL)
            except queue.Empty:
                continue
            try:
                handle = self.client.push(job.sparse, job.dense, delta=True,
                                          pull_dense=list(job.dense),
                                          geo_pull=list(self._local))
                while not handle.done():
                    if self._stopping.is_set():
                        raise PSTimeoutError("GEO exchange abandoned: the worker is stopping")
                    try:
                        handle.wait(_POLL)
                    except PSTimeoutError:
                        pass  # not answered yet (a failed handle is done: raised below)
                job.reply = handle.wait()
            except BaseException as e:  # surfaced by the next step or flush
                job.error = e
            finally:
                job.done.set()
