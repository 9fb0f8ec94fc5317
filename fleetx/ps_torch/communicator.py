"""Worker-side communicators: what one training step sends and receives, per mode.

A communicator is the worker's whole interface to the parameter servers. The fleet layer
drives it with plain numpy arrays (views of the model's tensors):

* ``start(dense, sparse)`` connects; worker 0 assigns the initial values (the model's dense
  parameters, and the weights of tables that come from ``nn.Embedding``); everyone meets at a
  barrier and gets back the servers' dense weights to load into the model.
* ``pull_sparse({table: ids})`` returns a handle for the rows of a batch: one request per
  server for every table.
* ``step(params, grads, sparse_grads)`` after ``backward()``: ``grads[table]`` is the flat
  gradient of a dense table, ``params[table]`` a writable flat view of its weights (fresh
  values are written there, or the entry is replaced by a new array holding them, which the
  caller then owns), ``sparse_grads[table] = (ids, grads)`` with repeated ids allowed.
  The communicator may keep the gradient arrays (async queues them uncopied): pass fresh ones
  every step and do not change them afterwards.
* ``set_lr``, ``barrier``, ``save``, ``flush``, ``stop``.

Modes: :class:`SyncCommunicator` here; ``AsyncCommunicator`` and ``GeoCommunicator`` in their
own modules; :func:`fleetx.ps_torch.worker.make_communicator` picks by ``PSConfig.mode``.
"""
from __future__ import annotations

import abc
import logging
from typing import ClassVar, Mapping, Optional, Sequence

import numpy as np

from fleetx.checkpoint import SaveWriter
from fleetx.ps.api import CommunicatorConfig, PSMode, PSConfig, Tables
from fleetx.ps.checkpoint import save_dense
from fleetx.ps.client import KVClient
from fleetx.ps.rounds import START_BARRIER
from fleetx.ps.tracker import Handle

__all__ = ["Communicator", "SyncCommunicator"]

log = logging.getLogger("fleetx.ps")


class Communicator(abc.ABC):
    """Base class: connection, start-up, lookups, lr, barrier, save, stop.

    Args:
        config: the cluster.
        rank: this worker's index.
        tables: every table (the same on every process).
        comm: sending knobs (``a_sync_configs``).
    """

    mode: ClassVar[PSMode]

    def __init__(self, config: PSConfig, rank: int, tables: Tables,
                 comm: Optional[CommunicatorConfig] = None) -> None:
        self.config, self.rank, self.tables = config, rank, tables
        self.comm = comm or CommunicatorConfig()
        self.client = KVClient(config, rank, tables)
        self.dense_names = [t.name for t in tables.dense]

    def start(self, dense: Optional[Mapping[str, np.ndarray]] = None,
              sparse: Optional[Mapping[str, tuple]] = None, *,
              assign: Optional[bool] = None, meet: bool = True) -> dict[str, np.ndarray]:
        """Connect, let worker 0 assign initial values, meet the other workers.

        Args:
            dense: table -> flat initial weights (only worker 0's are used).
            sparse: table -> ``(ids, rows)`` initial rows of bounded tables (worker 0's).
            assign: send ``dense`` / ``sparse`` (default: on worker 0 only). Tables a server
                already holds keep their values, so every process of a job may assign the
                same initial values and the first one counts (a heter worker does).
            meet: wait at the start barrier for the other workers (a heter worker, not
                counted in barriers, assigns its tables itself instead).

        A worker that fleetrun restarted under failover rejoins a job under way: its INIT is a
        no-op (the servers keep every table they already hold, the trained values), and it
        does not wait at the start barrier the others passed long ago.

        Returns:
            table -> the servers' flat dense weights (a checkpoint's, if one was loaded; the
            trained ones for a worker that rejoins).
        """
        self.client.start()
        if (self.rank == 0 if assign is None else assign) and (dense or sparse):
            self.client.init(sparse, dense).wait()
        if self.client.rejoined or self.client.started:
            log.warning("worker %d: rejoined the job under way (restart %d): the servers kept "
                        "their tables; training starts from their current values", self.rank,
                        self.config.restart_count)
        if meet and not self.client.started:
            self.client.barrier(START_BARRIER).wait()
        values = self.client.pull(dense=self.dense_names).wait().dense if self.dense_names \
            else {}
        self._started(values)
        return values

    def _started(self, dense: Mapping[str, np.ndarray]) -> None:
        """Hook: the initial dense weights are known."""

    def pull_sparse(self, ids: Mapping[str, np.ndarray], create: bool = True) -> Handle:
        """Rows for a batch: ``ids[table]`` any shape. Result: :class:`~fleetx.ps.client.
        PullResult`. Never waits for other workers. ``create=False`` (evaluation) does not
        insert unknown ids."""
        return self.client.pull(ids, create=create)

    @abc.abstractmethod
    def step(self, params: Mapping[str, np.ndarray], grads: Mapping[str, np.ndarray],
             sparse_grads: Mapping[str, tuple]) -> None:
        """Send one training step's gradients; write fresh dense weights into ``params`` (or
        replace its entries with new arrays holding them)."""

    def flush(self) -> None:
        """Block until everything queued has reached the servers."""

    def set_lr(self, lr: float, tables: Optional[Sequence[str]] = None) -> None:
        """New learning rate for the server-side rules (every table by default)."""
        self.client.set_lr(lr, tables).wait()

    def barrier(self, name: str = "") -> None:
        """Wait for every worker that has not stopped (no time limit while peers are alive)."""
        self.flush()
        self.client.barrier(name).wait()

    def save(self, dirname: str) -> dict:
        """Servers write their shards; this worker writes the dense weights and commits the
        save (call it on the first worker). Saving again to ``dirname`` replaces the
        checkpoint atomically: until the commit, the previous one stays whole. Returns rows
        saved per sparse table.

        Raises:
            fleetx.checkpoint.CheckpointError: this worker's files or the commit could not be
                written (nothing is committed).
            fleetx.ps.RemoteError: a server refused (remote type ``CheckpointError``: a table
                holds NaN or inf, or its files could not be written; nothing is committed).
        """
        self.flush()
        writer = SaveWriter(dirname)
        rows, files = self.client.save(writer.dirname, writer.save_id).wait()
        writer.add(files)
        if self.dense_names:
            save_dense(writer, self.client.pull(dense=self.dense_names).wait().dense)
        writer.commit()
        return rows

    def stop(self) -> None:
        """Flush, tell the servers this worker is done, disconnect."""
        try:
            self.flush()
        finally:
            self.client.stop()


class SyncCommunicator(Communicator):
    """Every step: one push per server carrying all tables; the reply comes after the server
    applied the mean of all workers' gradients and carries the new dense weights."""

    mode = PSMode.SYNC

    def step(self, params, grads, sparse_grads):
        flat, _ = self.client.push(sparse_grads, grads, pull_dense=list(grads),
                                   out=params).wait()  # the reply lands in params when it can
        for name, values in flat.items():
            if not _same_memory(values, params[name]):
                params[name][...] = values.reshape(np.shape(params[name]))


def _same_memory(a: np.ndarray, b: np.ndarray) -> bool:
    """True when ``a`` starts where ``b`` does (a reply received into ``b`` in place)."""
    return a.__array_interface__["data"][0] == np.asarray(b).__array_interface__["data"][0]
