"""Lay a torch model and optimizer out as parameter-server tables; move values between them.

This is the seam the fleet layer uses (with :mod:`.runtime` and :mod:`.progress`, the modules of
the parameter server that import torch):

* :meth:`ModelLayout.of` turns ``nn.Embedding(sparse=True)`` and ``nn.EmbeddingBag(sparse=True)``
  modules into bounded :class:`~fleetx.nn.SparseEmbedding` / ``SparseEmbeddingBag`` tables that
  start from the module's own weights (their weights leave the optimizer: the servers update
  them), names every sparse table after its module path, and makes one dense table per optimizer
  param group (the group's parameters flattened in order, its hyper-parameters as the rule).
  Servers and workers call it on the same model and optimizer and get the same
  :class:`~fleetx.ps.api.Tables`; calling it again on the converted model gives them again.
  The parameters of :class:`~fleetx.nn.HeterSection` blocks go to tables of their own
  (``heter.<group>``), which a heter worker pushes in a heter job (``docs/heter.md``);
  :meth:`ModelLayout.restricted` is the layout of one side of that split.
* ``dense_values`` / ``dense_grads`` / ``load_dense`` / ``sparse_grads`` / ``initial_sparse``
  convert between the model and the communicator's flat numpy arrays.
* :class:`RemoteSparseBackend` serves ``SparseEmbedding`` lookups through a communicator, with
  ``prefetch`` to fetch every table's rows for a batch in one request per server (and
  ``defer``, through which the modules batch their lookups of one forward pass by themselves);
  :class:`LocalSparseBackend` serves them from local tables in a one-process run.
"""
from __future__ import annotations

from typing import Mapping, Optional

import numpy as np
import torch
from torch import nn

from fleetx.nn.heter import HeterSection, sections
from fleetx.nn.sparse_embedding import SparseEmbedding, SparseEmbeddingBag
from fleetx.ps import kernels
from fleetx.ps.api import DenseTableSpec, RuleConfig, SparseTableSpec, Tables
from fleetx.ps.client import SparseRows
from fleetx.ps.rules import make_rule
from fleetx.ps.table import SparseTable
from fleetx.ps_torch.prefetch import PrefetchQueue

__all__ = ["ModelLayout", "convert_embeddings", "RemoteSparseBackend", "LocalSparseBackend",
           "HETER_PREFIX"]

#: dense tables of heter sections are named ``heter.<param group>``
HETER_PREFIX = "heter"


def convert_embeddings(model: nn.Module) -> dict[int, SparseEmbedding]:
    """Replace every ``nn.Embedding(sparse=True)`` and ``nn.EmbeddingBag(sparse=True)`` in
    ``model`` by a bounded sparse table module; returns ``{id(original weight): new module}``."""
    out = {}
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            kind = _CONVERTED.get(type(child))
            if kind is not None and child.sparse:
                path = f"{parent_name}.{child_name}" if parent_name else child_name
                new = kind.from_embedding(child, name=path)
                setattr(parent, child_name, new)
                out[id(child.weight)] = new
    return out


_CONVERTED = {nn.Embedding: SparseEmbedding, nn.EmbeddingBag: SparseEmbeddingBag}


def _release(optimizer: torch.optim.Optimizer, converted: dict) -> None:
    """Drop converted weights from the optimizer's groups (the servers own them now); each new
    module remembers the group its weight was in."""
    for i, group in enumerate(optimizer.param_groups):
        kept = []
        for p in group["params"]:
            if id(p) in converted:
                converted[id(p)].param_group = i
                optimizer.state.pop(p, None)
            else:
                kept.append(p)
        group["params"] = kept


@torch.no_grad()
def _flatten(params: list) -> tuple[torch.Tensor, list[int]]:
    """One flat tensor holding ``params``' values, which become views of it; with the
    parameters' data pointers (to notice when one is given other storage)."""
    return _views(torch.cat([p.detach().reshape(-1) for p in params]), params)


def _views(flat: torch.Tensor, params: list) -> tuple[torch.Tensor, list[int]]:
    """Make ``params`` views of consecutive slices of ``flat`` (their values are flat's)."""
    offset = 0
    for p in params:
        p.data = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    return flat, [p.data_ptr() for p in params]


class ModelLayout:
    """How one model's parameters map onto tables. Build it with :meth:`of`."""

    def __init__(self, tables: Tables, sparse: dict, dense: list,
                 heter: Optional[dict] = None) -> None:
        self.tables = tables
        self.sparse: dict[str, SparseEmbedding] = sparse
        self.dense: list[tuple[str, list[torch.Tensor]]] = dense
        self.heter: dict[str, HeterSection] = heter or {}  # the model's sections, by name
        self._flat: dict[str, tuple[torch.Tensor, list[int]]] = {}  # flatten_dense

    @classmethod
    def of(cls, model: nn.Module, optimizer: torch.optim.Optimizer,
           convert: bool = True) -> "ModelLayout":
        """Lay out ``model`` (modified in place when ``convert``) under ``optimizer``'s rules.

        Raises:
            PSConfigError: the optimizer has no server-side rule.
        """
        converted = convert_embeddings(model) if convert else {}
        _release(optimizer, converted)
        opt_name = type(optimizer).__name__
        sparse, specs = {}, []
        for path, m in model.named_modules():
            if not isinstance(m, SparseEmbedding):
                continue
            m.table_name = m.table_name or path
            group = optimizer.param_groups[m.param_group or 0]
            rule = m.rule or RuleConfig.from_param_group(opt_name, group)
            specs.append(SparseTableSpec(m.table_name, m.embedding_dim, rule, m.init,
                                         m.num_embeddings, m.entry, m.accessor))
            sparse[m.table_name] = m
        heter = sections(model)
        in_heter = {id(p) for m in heter.values() for p in m.parameters()}
        dense, dense_specs = [], []
        for i, group in enumerate(optimizer.param_groups):
            params = [p for p in group["params"] if p.requires_grad]
            for prefix, part in (("dense", [p for p in params if id(p) not in in_heter]),
                                 (HETER_PREFIX, [p for p in params if id(p) in in_heter])):
                if part:
                    name = f"{prefix}.{i}"
                    dense.append((name, part))
                    dense_specs.append(DenseTableSpec(name, sum(p.numel() for p in part),
                                                      RuleConfig.from_param_group(opt_name,
                                                                                  group)))
        return cls(Tables(tuple(specs), tuple(dense_specs)), sparse, dense, heter)

    def heter_tables(self) -> list[str]:
        """The dense tables of the heter sections' parameters."""
        return [n for n, _ in self.dense if n.startswith(HETER_PREFIX + ".")]

    def restricted(self, dense: list[str]) -> "ModelLayout":
        """The same tables and sparse modules, with only the dense tables named in ``dense``
        moved by ``dense_values`` / ``dense_grads`` / ``load_dense`` (one side of a heter
        job: the trainers' tables or the heter worker's)."""
        keep = set(dense)
        return ModelLayout(self.tables, self.sparse, [(n, ps) for n, ps in self.dense
                                                      if n in keep], self.heter)

    def lr_groups(self) -> dict[int, list[str]]:
        """``{optimizer param group: tables whose learning rate is that group's}``: its dense
        table and the sparse tables converted from its embeddings (or, for a SparseEmbedding
        without its own rule, group 0)."""
        out: dict[int, list[str]] = {}
        for name, _ in self.dense:
            out.setdefault(int(name.split(".")[1]), []).append(name)
        for name, m in self.sparse.items():
            if m.rule is None:
                out.setdefault(m.param_group or 0, []).append(name)
        return out

    def bind(self, backend) -> None:
        """Serve every SparseEmbedding's lookups from ``backend``."""
        for m in self.sparse.values():
            m.bind(backend)

    def flatten_dense(self) -> None:
        """Give each dense table's parameters one flat storage, the parameters becoming views
        of it (as DDP's gradient buckets or FSDP's flat parameters do), so that
        :meth:`dense_values` is the model's own memory: a communicator reads and writes the
        weights in place instead of a copy out and a copy in per step. Tables whose parameters
        are not all float32 on the CPU keep their own storage (and the copies)."""
        self._flat = {n: _flatten(ps) for n, ps in self.dense
                      if all(p.device.type == "cpu" and p.dtype == torch.float32 for p in ps)}

    def _flat_of(self, name: str, params: list) -> Optional[torch.Tensor]:
        """The table's flat storage, if it has one; a parameter given new storage since
        (``p.data = ...``, ``load_state_dict(assign=True)``) gets the table flattened again."""
        entry = self._flat.get(name)
        if entry is None:
            return None
        if [p.data_ptr() for p in params] != entry[1]:
            entry = self._flat[name] = _flatten(params)
        return entry[0]

    def dense_values(self) -> dict[str, np.ndarray]:
        """Each dense table's weights, flattened: after :meth:`flatten_dense` the model's own
        memory (writing into it changes the model), otherwise a copy."""
        out = {}
        for n, ps in self.dense:
            flat = self._flat_of(n, ps)
            out[n] = flat.numpy() if flat is not None else \
                torch.cat([p.detach().reshape(-1).cpu() for p in ps]).numpy()
        return out

    def dense_grads(self) -> dict[str, np.ndarray]:
        """Each dense table's gradient, flattened into a new array (zeros where a parameter has
        none): the caller may keep it."""
        return {n: torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p))
                              .detach().reshape(-1).cpu() for p in ps]).numpy()
                for n, ps in self.dense}

    def load_dense(self, values: Mapping[str, np.ndarray], adopt: bool = False) -> None:
        """Copy flat dense weights into the model's parameters (nothing to do for the arrays
        :meth:`dense_values` returned after :meth:`flatten_dense`: they are the model's).

        ``adopt=True``: the caller gives the arrays up; a flattened table whose new values
        come as a contiguous float32 array of its size takes that array as its storage (the
        parameters become views of it) instead of copying it.
        """
        for n, ps in self.dense:
            source = np.asarray(values[n], np.float32)
            flat = self._flat_of(n, ps)
            if flat is not None and source.__array_interface__["data"][0] == flat.data_ptr():
                continue  # the model's own memory (every step after flatten_dense)
            if flat is not None and adopt and source.size == flat.numel() \
                    and source.flags.c_contiguous and source.flags.writeable:
                self._flat[n] = _views(torch.from_numpy(source.reshape(-1)), ps)
                continue
            with torch.no_grad():
                if flat is not None:
                    flat.copy_(torch.from_numpy(source.reshape(-1)))
                    continue
                flat_in, offset = torch.from_numpy(source), 0
                for p in ps:
                    p.copy_(flat_in[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()

    def initial_sparse(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """``(ids, rows)`` of tables that start from a module's weights (``nn.Embedding``)."""
        return {n: (np.arange(m.num_embeddings, dtype=np.int64),
                    m.initial_weight.numpy().astype(np.float32))
                for n, m in self.sparse.items() if m.initial_weight is not None}

    def release_initial_sparse(self) -> None:
        """Free the copies of the original embedding weights (after worker 0 assigned them)."""
        for m in self.sparse.values():
            m.initial_weight = None

    def clear_sparse_grads(self) -> None:
        """Forget sparse gradients not sent yet (``zero_grad`` without a step)."""
        for m in self.sparse.values():
            m.clear_gradients()

    def sparse_grads(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Every table's ``(ids, grads)`` since the last call (repeated ids possible). A table
        looked up once per step hands over that lookup's own arrays, uncopied: its ids are the
        unique ids of the pull that served it (communicators recognise them, see
        :class:`~fleetx.ps_torch.geo.GeoCommunicator`)."""
        out = {}
        for n, m in self.sparse.items():
            parts = m.pop_gradients()
            if len(parts) == 1:
                out[n] = parts[0]
            elif parts:
                out[n] = (np.concatenate([i for i, _ in parts]),
                          np.concatenate([g for _, g in parts]))
        return out


class RemoteSparseBackend:
    """Lookups through a communicator.

    ``defer(table, ids, create)`` only notes a lookup's ids; the first ``lookup`` of a noted
    array pulls every noted array of every table together (the client de-duplicates them and
    sends one request per server) and answers each from the reply's own mapping, without
    sorting the ids again. The sparse modules defer their lookups, so the lookups of one forward
    pass made before the first use of any of them cost one request per server.

    ``prefetch`` requests a batch's rows before its forward (:mod:`.prefetch`): a later batched
    pull whose ids for a table are exactly a prefetch's uses its rows instead of asking again.

    Args:
        communicator: the worker's communicator (its ``pull_sparse``).
        create: training lookups create missing rows.
        exact: sync mode: prefetched rows must be read after the last step's update.
    """

    def __init__(self, communicator, create: bool = True, exact: bool = False) -> None:
        self.communicator, self.create = communicator, create
        self.prefetched = PrefetchQueue(communicator.pull_sparse, exact)
        self._deferred: list[tuple[str, np.ndarray]] = []
        self._deferred_create = False
        self._answers: dict[int, tuple[np.ndarray, SparseRows]] = {}

    def prefetch(self, ids: Mapping[str, np.ndarray], create: Optional[bool] = None,
                 after_step: bool = False) -> None:
        """Start pulling ``ids[table]`` for every table (returns at once) for the next forward,
        or, with ``after_step``, for the forward after the next step."""
        self.prefetched.add(ids, self.create if create is None else create, after_step)

    def defer(self, table: str, ids: np.ndarray, create: bool = True) -> None:
        """Note the lookup of ``ids`` (this very array) in ``table`` for the next batched pull."""
        self._deferred.append((table, ids))
        self._deferred_create = self._deferred_create or create

    def clear(self) -> None:
        """A step was taken: forget noted lookups (their rows are stale now); in sync mode
        prefetched rows read before the step are dropped and held prefetches are sent."""
        self._deferred, self._answers = [], {}
        self._deferred_create = False
        self.prefetched.stepped()

    def lookup(self, table: str, ids: np.ndarray, create: Optional[bool] = None) -> SparseRows:
        """The rows of ``ids``; ``create`` (default: the backend's) for a pull on demand."""
        create = self.create if create is None else create
        if self._deferred:
            self._pull_deferred()
        answer = self._answers.pop(id(ids), None)
        if answer is not None and answer[0] is ids:
            return answer[1]
        flat = np.ascontiguousarray(ids, np.int64).reshape(-1)
        rows = self.prefetched.take({table: flat}, create).get(table)
        if rows is None:
            rows = self.communicator.pull_sparse({table: flat}, create=create).wait() \
                .sparse[table]
        return SparseRows(rows.ids, rows.values, rows.inverse, np.shape(ids))

    def _pull_deferred(self) -> None:
        parts: dict[str, list[np.ndarray]] = {}
        for table, ids in self._deferred:
            parts.setdefault(table, []).append(ids)
        wanted = {n: np.concatenate([np.asarray(i, np.int64).reshape(-1) for i in arrays])
                  if len(arrays) > 1 else np.asarray(arrays[0], np.int64).reshape(-1)
                  for n, arrays in parts.items()}
        create = self.create and self._deferred_create
        self._deferred, self._deferred_create = [], False
        reply = self.prefetched.take(wanted, create)
        rest = {n: ids for n, ids in wanted.items() if n not in reply}
        if rest:
            reply.update(self.communicator.pull_sparse(rest, create=create).wait().sparse)
        for n, arrays in parts.items():
            rows, offset = reply[n], 0
            for ids in arrays:
                size = np.size(ids)
                if len(arrays) == 1:
                    answer = SparseRows(rows.ids, rows.values, rows.inverse, np.shape(ids))
                else:  # several lookups of one table: each gets only its own rows
                    used, inverse = np.unique(rows.inverse[offset:offset + size],
                                              return_inverse=True)
                    answer = SparseRows(rows.ids[used], rows.values[used], inverse,
                                        np.shape(ids))
                self._answers[id(ids)] = (ids, answer)
                offset += size


class LocalSparseBackend:
    """Sparse tables in this process, with the servers' rows, initialisation and rules."""

    def __init__(self, tables: Tables) -> None:
        self.tables = {t.name: SparseTable(t, make_rule(t.rule)) for t in tables.sparse}

    def lookup(self, table: str, ids: np.ndarray, create: bool = True) -> SparseRows:
        """Rows of ``ids``; ``create=False`` (evaluation) neither creates rows nor counts
        sightings."""
        uniq, inv = kernels.unique_inverse(ids)
        return SparseRows(uniq, self.tables[table].pull(uniq, create), inv, np.shape(ids))

    def assign(self, rows: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> None:
        for n, (ids, values) in rows.items():
            self.tables[n].assign(ids, values)

    def step(self, sparse_grads: Mapping[str, tuple[np.ndarray, np.ndarray]],
             lr: Optional[float] = None) -> None:
        """Apply each table's rule to ``(ids, grads)`` (repeated ids are summed)."""
        for n, (ids, grads) in sparse_grads.items():
            t = self.tables[n]
            if lr is not None:
                t.rule.set_lr(lr)
            uniq, inv = kernels.unique_inverse(ids)
            t.push(uniq, kernels.segment_sum(inv, np.asarray(grads, np.float32)
                                             .reshape(len(inv), t.spec.push_width), len(uniq)))
