"""One server's slice of every table, and the data operations requests map to.

No networking and no threads: the server's handler thread calls these methods one at a time,
so the tables need no locks. Messages are decoded to ``(meta, buffers)`` by the server; the
buffer order per request kind is the wire format of ``docs/parameter_server.md`` §3. Every
request is checked by :mod:`fleetx.ps.requests` before it touches a table, and an update that
would take a table past ``PSConfig.max_rows`` is refused before any table changes.
"""
from __future__ import annotations

import collections
import logging
import resource
from typing import Any, Optional, Sequence

import numpy as np

from fleetx.ps import kernels
from fleetx.checkpoint import SaveWriter
from fleetx.ps import requests
from fleetx.ps.api import PSConfigError, PSMode, PSConfig, RequestError, RuleConfig, Tables
from fleetx.ps.checkpoint import Chain, load_server, save_server
from fleetx.ps.partition import dense_ranges
from fleetx.ps.requests import Push
from fleetx.ps.rules import make_rule
from fleetx.ps.table import DenseTable, SparseTable

__all__ = ["Shard", "table_report", "check_growth"]

log = logging.getLogger("fleetx.ps")


class Shard:
    """The tables of server ``index``: sparse rows it owns and its slice of each dense table.

    In GEO mode every table's rule is ``sum`` (workers push parameter deltas and run the
    optimizer themselves) and the shard remembers, per worker, which rows changed since that
    worker's last exchange.
    """

    def __init__(self, config: PSConfig, index: int, tables: Tables,
                 load_dir: Any = None, capacity: int = 1024,
                 load_tables: Optional[Sequence[str]] = None) -> None:
        self.config, self.index = config, index
        geo = config.mode == PSMode.GEO
        check_growth(tables, config.mode)

        def rule(r: RuleConfig):
            return make_rule(RuleConfig("sum") if geo else r)

        self.sparse = {t.name: SparseTable(t, rule(t.rule), capacity, config.max_rows)
                       for t in tables.sparse}
        self.dense = {t.name: DenseTable(t, rule(t.rule),
                                         *dense_ranges(t.numel, config.num_servers)[index])
                      for t in tables.dense}
        self.initialized: set[str] = set()  # assigned by INIT or loaded from a checkpoint
        self._geo_dirty = {t: collections.defaultdict(list) for t in self.sparse}
        self.chain: Optional[Chain] = None  # the saves a delta (mode 2) would follow
        if load_dir:
            loaded = load_server(load_dir, index, config.num_servers, config.shard_num,
                                 self.sparse, self.dense, load_tables)
            self.initialized |= set(loaded.rows)
            self._new_chain(loaded.chain)
            log.info("server %d: loaded %s from %s", index, loaded.rows, load_dir)

    def table(self, name: str):
        t = self.sparse.get(name)
        t = self.dense.get(name) if t is None else t
        if t is None:
            raise PSConfigError(f"server {self.index} has no table {name!r}")
        return t

    def pull(self, meta: dict, bufs: list) -> list:
        """PULL: rows of each sparse table's ids, then each dense slice.

        Raises:
            RequestError: a malformed request, or new rows beyond ``max_rows``.
        """
        sparse, dense, create = requests.parse_pull(meta, bufs, self.sparse, self.dense)
        out = [self.sparse[n].pull(ids, create and not self._sights_at_update(n))
               for n, ids in sparse]
        return out + [self.dense[n].pull() for n in dense]

    def _sights_at_update(self, name: str) -> bool:
        """Sync mode counts a table's admission sightings at the updates, not at the pulls: a
        round's merged update holds each id of the step once, however many workers saw it, as
        one worker's batch of the whole step would (the data-parallel contract)."""
        return self.config.mode == PSMode.SYNC and self.sparse[name].admission is not None

    def _sight(self, name: str, ids: np.ndarray) -> None:
        """Sync: one sighting of each of ``ids`` (distinct) without a row, before the update
        that may then create the rows of those it admitted."""
        table = self.sparse[name]
        if self._sights_at_update(name) and len(ids):
            table.admission.sight(ids[table.index.find(ids) < 0], table.passes)

    def parse_push(self, kind: str, meta: dict, bufs: list) -> Push:
        """A PUSH's or INIT's tables and arrays, checked against the tables (a PUSH's
        ``geo_pull`` and ``pull_dense`` lists too).

        Raises:
            RequestError: the first mismatch, naming the table.
        """
        push = requests.parse_push(kind, meta, bufs, self.sparse, self.dense)
        if kind == "PUSH":
            requests.geo_names(meta, self.sparse, self.dense)
        return push

    def apply(self, push: Push) -> None:
        """Async/GEO: apply one worker's push as it comes.

        Raises:
            RequestError: it would take a table past ``max_rows`` (nothing is applied).
        """
        for name, ids, _ in push.sparse:
            self.sparse[name].check_capacity(ids)
        for name, ids, grads in push.sparse:
            self._sight(name, ids)  # sync: a heter worker's update, applied on arrival
            self.sparse[name].push(ids, grads)
            if self.config.mode == PSMode.GEO:
                for r in range(self.config.num_workers):
                    self._geo_dirty[name][r].append(ids)
        for name, grads in push.dense:
            self.dense[name].push(grads)

    def geo_resend_all(self) -> int:
        """GEO, after a restart from a snapshot: every row counts as changed for every worker,
        so each worker's next exchange brings back all of this shard's rows and its local copy
        agrees with the restored values again (rows it never hears of would otherwise keep
        updates the server lost, and its later deltas would be measured from them). Returns
        the rows marked."""
        marked = 0
        for name, table in self.sparse.items():
            ids = np.array(table.index.keys[:len(table)], np.int64)
            marked += len(ids)
            for r in range(self.config.num_workers):
                self._geo_dirty[name][r] = [ids]
        return marked

    def apply_mean(self, pushes: list) -> None:
        """Sync: apply the mean of several workers' pushes (a skipped push counts as zero).

        Raises:
            RequestError: the round would take a table past ``max_rows`` (nothing is applied).
        """
        scale = np.float32(1.0 / len(pushes))
        merged = {}
        for name, table in self.sparse.items():
            parts = [(ids, g) for p in pushes for n, ids, g in p.sparse if n == name]
            if not sum(len(ids) for ids, _ in parts):
                continue
            ids = np.concatenate([p[0] for p in parts])
            grads = np.concatenate([p[1] for p in parts])
            uniq, inv = kernels.unique_inverse(ids)
            table.check_capacity(uniq)
            merged[name] = (uniq, inv, grads)
        for name, (uniq, inv, grads) in merged.items():
            summed = kernels.segment_sum(inv, grads, len(uniq))
            summed[:, :self.sparse[name].dim] *= scale  # show and click are sums, not means
            self._sight(name, uniq)
            self.sparse[name].push(uniq, summed)
        for name, table in self.dense.items():
            parts = [g for p in pushes for n, g in p.dense if n == name]
            if parts:
                total = np.sum(parts, axis=0, dtype=np.float32) if len(parts) > 1 else parts[0]
                table.push(total * scale)

    def push_reply(self, meta: dict, rank: int) -> list:
        """A PUSH reply's buffers: GEO rows changed since ``rank``'s last exchange (ids, rows
        per table), then the requested dense weights."""
        out = []
        for name in meta.get("geo_pull") or ():
            pending = self._geo_dirty[name].pop(rank, [])
            ids = np.unique(np.concatenate(pending)) if pending else np.empty(0, np.int64)
            table = self.sparse[name]
            ids = ids[table.index.find(ids) >= 0]  # rows a shrink removed since: not sent
            out += [ids, table.pull(ids, create=False)]
        return out + [self.table(n).pull() for n in meta.get("pull_dense", [])]

    def init(self, push: Push, force: bool) -> list[str]:
        """INIT: assign values to tables not yet initialised (all with ``force``)."""
        applied = []
        for name, ids, _ in push.sparse:
            if force or name not in self.initialized:
                self.sparse[name].check_capacity(ids)
        for name, ids, rows in push.sparse:
            if force or name not in self.initialized:
                self.sparse[name].assign(ids, rows)
                applied.append(name)
        for name, values in push.dense:
            if force or name not in self.initialized:
                self.dense[name].assign(values)
                applied.append(name)
        self.initialized |= set(applied)
        return applied

    def set_lr(self, lr: float, names: list) -> None:
        for n in names:
            self.table(n).rule.set_lr(lr)

    def save(self, writer: SaveWriter, mode: Any = 0) -> dict:
        """Write this server's shards into ``writer``'s save in ``mode`` (0 everything, 1 a
        base, 2 a delta since the last save, ``"export"`` weights); returns the reply meta:
        rows per table, and the chain a delta continues (``base``, ``prev``).

        Raises:
            RequestError: a delta without a base save or load before it, or after a load of
                some of the chain's tables only.
            CheckpointError: a table holds NaN or inf, or a file cannot be written.
        """
        if mode == 2 and self.chain is None:
            raise RequestError("SAVE: a delta (mode 2) needs a base: make a full save (mode 0 "
                               "or 1) first, or start the servers from one (init_server)")
        if mode == 2:
            self.chain.check_delta(RequestError, "SAVE")
        chain = self.chain
        rows = save_server(writer, self.index, self.config.num_servers, self.config.shard_num,
                           self.sparse, self.dense, mode, chain)
        if mode in (0, 1):
            self._new_chain(Chain(writer.save_id, writer.save_id, mode == 0))
        elif mode == 2:
            self._new_chain(chain._replace(prev=writer.save_id))
        out = {"rows": rows}
        if mode == 2:
            out["chain"] = {"base": chain.base, "prev": chain.prev}
        return out

    def _new_chain(self, chain: Chain) -> None:
        """The saves so far end with ``chain.prev``: changes count from here."""
        self.chain = chain
        for t in self.sparse.values():
            t.changes.start(len(t))

    def shrink(self, threshold: Optional[int]) -> dict:
        """End of a pass for every sparse table (:meth:`SparseTable.shrink`); returns
        ``{table: {"removed", "forgotten", "rows"}}``."""
        out = {}
        for name, t in self.sparse.items():
            out[name] = {**t.shrink(threshold), "rows": len(t)}
        log.info("server %d: shrink (pass %d ended): %s", self.index,
                 next(iter(self.sparse.values())).passes - 1 if self.sparse else 0, out)
        return out

    def stats(self) -> dict:
        """Rows and bytes per table, peak resident memory, and per sparse table the memory
        report: rows, bytes by part, passes, rows created and removed, updates dropped, pending
        ids and admission counts."""
        return {"rows": {n: len(t) for n, t in self.sparse.items()},
                "table_bytes": {n: t.nbytes for n, t in {**self.sparse, **self.dense}.items()},
                "tables": {n: table_report(t) for n, t in self.sparse.items()},
                "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def check_growth(tables: Tables, mode: PSMode) -> None:
    """Refuse entries GEO mode cannot honour: its workers create and update rows locally and
    send deltas every ``k_steps``, so the servers neither see each lookup (admission counts)
    nor each sample's show and click.

    Raises:
        PSConfigError: a table with an entry in GEO mode (names it).
    """
    if PSMode(mode) != PSMode.GEO:
        return
    for t in tables.sparse:
        if t.entry is not None:
            raise PSConfigError(f"sparse table {t.name!r}: entry={type(t.entry).__name__}(...) "
                                "needs sync or async mode: in GEO mode workers create and update "
                                "rows locally and exchange deltas every k_steps, so servers see "
                                "neither each lookup nor each sample's show and click (an "
                                "accessor= for eviction works in every mode)")


def table_report(t: SparseTable) -> dict:
    """One sparse table's part of the memory report (plain JSON)."""
    out = {"rows": len(t), "bytes": t.memory(), "passes": t.passes, **t.counters,
           "pending": len(t.admission) if t.admission is not None else 0,
           "entry": type(t.spec.entry).__name__ if t.spec.entry is not None else None,
           "row_bytes": 4 * t.width}
    if t.admission is not None:
        out.update({f"pending_{k}": v for k, v in t.admission.counters.items()})
    return out
