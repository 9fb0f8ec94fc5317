"""GEO mode: workers train locally and exchange parameter deltas every ``k_steps``.

The worker keeps a local copy of everything it trains: the dense parameters are the model's
own (the user's torch optimizer steps them), and sparse rows live in local tables with the
optimizer's rule, created by pulling from the servers on first touch. Each local row also
keeps its *base*, the value it had at the last exchange.

Every ``k_steps`` steps, one request per server carries ``(local - base) / num_workers`` for
every dense table and every sparse row touched since the last exchange; the server adds the
deltas (a ``sum`` rule) and replies, in the same round trip, with the new dense weights and
every row that changed on it since this worker's last exchange (its own and other workers'
pushes). The worker adopts those values as its local values and new base. With one worker this
is exactly local training (up to float rounding of ``base + (local - base)``).
"""
from __future__ import annotations

import collections

import numpy as np

from fleetx.ps import kernels
from fleetx.ps.api import PSMode
from fleetx.ps.client import PullResult, SparseRows
from fleetx.ps_torch.communicator import Communicator
from fleetx.ps.rules import Rule, make_rule
from fleetx.ps.table import SparseTable
from fleetx.ps.tracker import Handle

__all__ = ["GeoCommunicator"]


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


class GeoCommunicator(Communicator):
    """Local training with a delta exchange every ``comm.k_steps`` steps."""

    mode = PSMode.GEO

    def _started(self, dense):
        self._local = {t.name: SparseTable(t, _WithBase(make_rule(t.rule)))
                       for t in self.tables.sparse}
        self._base = {n: np.array(v, np.float32) for n, v in dense.items()}
        self._dirty = collections.defaultdict(list)
        self._steps = 0

    def _base_cols(self, table: SparseTable) -> slice:
        return slice(table.width - table.dim, table.width)

    def pull_sparse(self, ids, create=True):
        """Rows from the local tables; ids never seen before are fetched from the servers in
        one request per server."""
        wanted = {n: kernels.unique_inverse(i) for n, i in ids.items()}
        missing = {}
        for n, (uniq, _) in wanted.items():
            absent = uniq[self._local[n].index.find(uniq) < 0]
            if len(absent):
                missing[n] = absent
        fetched = self.client.pull(missing, create=create).wait().sparse if missing else {}
        out = {}
        for n, (uniq, inv) in wanted.items():
            table = self._local[n]
            if n in fetched and create:
                f = fetched[n]
                table.assign(f.ids, f.values)
                table.slab[table.index.find(f.ids), self._base_cols(table)] = f.values
            values = table.pull(uniq, create=False)
            if n in fetched and not create:  # evaluation: use, but do not keep, fetched rows
                pos = np.searchsorted(uniq, fetched[n].ids)
                values[pos] = fetched[n].values
            out[n] = SparseRows(uniq, values, inv, np.shape(ids[n]))
        return Handle.resolved(PullResult(out, {}))

    def step(self, params, grads, sparse_grads):
        """Apply the sparse gradients locally (the dense ones were applied by the user's
        optimizer); exchange deltas every ``k_steps`` steps."""
        for n, (ids, g) in sparse_grads.items():
            table = self._local[n]
            uniq, inv = kernels.unique_inverse(ids)
            if (table.index.find(uniq) < 0).any():  # rows never looked up: fetch their base
                self.pull_sparse({n: uniq})
            summed = kernels.segment_sum(inv, np.asarray(g, np.float32).reshape(
                len(inv), table.dim), len(uniq))
            table.push(uniq, summed)
            self._dirty[n].append(uniq)
        self._steps += 1
        self._params = params
        if self._steps % self.comm.k_steps == 0:
            self._exchange(params)

    def flush(self):
        """Exchange now if local steps are pending (at save and stop)."""
        if getattr(self, "_steps", 0) % self.comm.k_steps:
            self._steps = 0
            self._exchange(self._params)

    def set_lr(self, lr, tables=None):
        """The optimizer runs here in GEO mode: change the local rules' lr (the fleet layer
        changes the torch optimizer's)."""
        for n, t in self._local.items():
            if not tables or n in tables:
                t.rule.set_lr(lr)

    def _exchange(self, params) -> None:
        scale = np.float32(1.0 / self.config.num_workers)
        sparse = {}
        for n, parts in self._dirty.items():
            table = self._local[n]
            ids = np.unique(np.concatenate(parts))
            block = table.slab[table.index.find(ids)]
            sparse[n] = (ids, (block[:, :table.dim] - block[:, self._base_cols(table)]) * scale)
        dense = {n: (np.asarray(params[n], np.float32).reshape(-1) - self._base[n]) * scale
                 for n in self._base}
        flat, geo = self.client.push(sparse, dense, delta=True, pull_dense=list(dense),
                                     geo_pull=list(self._local)).wait()
        for n, (ids, rows) in geo.items():
            table = self._local[n]
            local = table.index.find(ids)
            held = local >= 0
            table.slab[local[held], :table.dim] = rows[held]
            table.slab[local[held], self._base_cols(table)] = rows[held]
        for n, values in flat.items():
            params[n][...] = values.reshape(np.shape(params[n]))
            self._base[n] = values.copy()
        self._dirty.clear()
