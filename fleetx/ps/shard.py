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
from typing import Optional

import numpy as np

from fleetx.ps import kernels
from fleetx.checkpoint import SaveWriter
from fleetx.ps import requests
from fleetx.ps.api import PSConfigError, PSMode, PSConfig, RuleConfig, Tables
from fleetx.ps.checkpoint import load_server, save_server
from fleetx.ps.partition import dense_ranges
from fleetx.ps.requests import Push
from fleetx.ps.rules import make_rule
from fleetx.ps.table import DenseTable, SparseTable

__all__ = ["Shard"]

log = logging.getLogger("fleetx.ps")


class Shard:
    """The tables of server ``index``: sparse rows it owns and its slice of each dense table.

    In GEO mode every table's rule is ``sum`` (workers push parameter deltas and run the
    optimizer themselves) and the shard remembers, per worker, which rows changed since that
    worker's last exchange.
    """

    def __init__(self, config: PSConfig, index: int, tables: Tables,
                 load_dir: Optional[str] = None, capacity: int = 1024) -> None:
        self.config, self.index = config, index
        geo = config.mode == PSMode.GEO

        def rule(r: RuleConfig):
            return make_rule(RuleConfig("sum") if geo else r)

        self.sparse = {t.name: SparseTable(t, rule(t.rule), capacity, config.max_rows)
                       for t in tables.sparse}
        self.dense = {t.name: DenseTable(t, rule(t.rule),
                                         *dense_ranges(t.numel, config.num_servers)[index])
                      for t in tables.dense}
        self.initialized: set[str] = set()  # assigned by INIT or loaded from a checkpoint
        self._geo_dirty = {t: collections.defaultdict(list) for t in self.sparse}
        if load_dir:
            counts = load_server(load_dir, index, config.num_servers, config.shard_num,
                                 self.sparse, self.dense)
            self.initialized |= set(counts)
            log.info("server %d: loaded %s from %s", index, counts, load_dir)

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
        out = [self.sparse[n].pull(ids, create) for n, ids in sparse]
        return out + [self.dense[n].pull() for n in dense]

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
            self.sparse[name].push(ids, grads)
            if self.config.mode == PSMode.GEO:
                for r in range(self.config.num_workers):
                    self._geo_dirty[name][r].append(ids)
        for name, grads in push.dense:
            self.dense[name].push(grads)

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
            summed *= scale
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
            out += [ids, self.sparse[name].pull(ids)]
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

    def save(self, writer: SaveWriter) -> dict:
        """Write this server's shards into ``writer``'s save; returns rows per table."""
        return save_server(writer, self.index, self.config.num_servers, self.config.shard_num,
                           self.sparse, self.dense)

    def stats(self) -> dict:
        """Rows and bytes per table, peak resident memory."""
        return {"rows": {n: len(t) for n, t in self.sparse.items()},
                "table_bytes": {n: t.nbytes for n, t in {**self.sparse, **self.dense}.items()},
                "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
