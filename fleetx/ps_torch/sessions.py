"""What a worker holds between ``init_worker`` and ``stop_worker``: a *session*.

* :class:`LocalSession`: no servers (a script run alone): the sparse tables live in this
  process with the servers' rules, the dense parameters are stepped by the user's optimizer,
  and saves are one-server checkpoints.
* :class:`RemoteSession`: a worker connected to the servers through the communicator of the
  job's mode (and, in a heter job, to its heter worker).

Both answer ``step``, ``set_lr``, ``save`` and ``stop``; a remote session also ``prefetch``,
``barrier``, ``refresh`` and ``to_inference``. :class:`fleetx.ps_torch.runtime.PSRuntime`
builds one and calls it; an :class:`~fleetx.ps_torch.inference.InferenceSession` replaces it
when the worker turns to inference.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from fleetx.ps import checkpoint
from fleetx.ps.api import CommunicatorConfig, PSMode, PSConfig
from fleetx.ps_torch import saving
from fleetx.ps_torch.heter import attach, detach
from fleetx.ps_torch.inference import InferenceSession
from fleetx.ps_torch.layout import LocalSparseBackend, ModelLayout, RemoteSparseBackend
from fleetx.ps_torch.worker import make_communicator

__all__ = ["LocalSession", "RemoteSession", "say"]


def say(message: str) -> None:
    """A line on this worker's console (worker 0's is fleetrun's)."""
    print(f"fleetx ps worker 0: {message}", flush=True)


class LocalSession:
    """No servers: sparse tables in this process, dense parameters stepped by the optimizer."""

    def __init__(self, layout: ModelLayout, load_dir: Any, var_names: Any = None) -> None:
        self.layout = layout
        self.backend = LocalSparseBackend(layout.tables)
        self.backend.assign(layout.initial_sparse())
        self.saves = saving.LocalChain(self.backend.tables)
        if load_dir:
            loaded = checkpoint.load_server(load_dir, 0, 1, 1, self.backend.tables, {},
                                            var_names)
            dense = checkpoint.load_dense(load_dir)
            if var_names is not None:
                dense = {n: v for n, v in dense.items() if n in var_names}
            if dense:
                layout.load_dense(dense)
            self.saves.restart(loaded.chain)
            where = " + ".join(os.path.abspath(str(d)) for d in (
                [load_dir] if isinstance(load_dir, str) else load_dir))
            say(f"loaded from {where} ({sum(loaded.rows.values())} sparse row(s), "
                 f"{len(dense)} dense table(s))")

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()
        self.backend.step(self.layout.sparse_grads())

    def set_lr(self, lr: float, tables: list) -> None:
        for name in tables:
            if name in self.backend.tables:
                self.backend.tables[name].rule.set_lr(lr)

    def save(self, dirname: str, mode: int = 0) -> None:
        """A one-server checkpoint: sparse rows (with their state in mode 0); dense weights
        (the torch optimizer's state is not part of it) both as worker 0 and as server 0 write
        them."""
        self.saves.save(dirname, mode, self.layout.dense_values(), self.layout.tables.dense)

    def stop(self) -> None:
        """Nothing to disconnect."""


class RemoteSession:
    """A worker connected to the servers through the communicator of the job's mode (and, in a
    heter job, to its heter worker, which runs the model's sections and pushes their tables)."""

    def __init__(self, layout: ModelLayout, config: PSConfig, rank: int,
                 comm: CommunicatorConfig) -> None:
        heter = bool(config.num_heter_workers and layout.heter)
        self.full, self.mode, self.stopped = layout, config.mode, False
        self.layout = layout.restricted([n for n, _ in layout.dense
                                         if n not in layout.heter_tables()]) if heter else layout
        self.comm = make_communicator(config, rank, layout.tables, comm)
        self.backend = RemoteSparseBackend(self.comm, exact=config.mode == PSMode.SYNC)
        layout.flatten_dense()  # the communicator then reads and writes the model in place
        initial = layout.initial_sparse() if rank == 0 else None
        # worker 0 assigns every table's start, the heter sections' too
        self._params = self.comm.start(layout.dense_values(), initial)
        self.layout.load_dense(self._params)
        self.heter = attach(layout.heter, config, rank, layout.tables) if heter else None

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        geo = self.mode == PSMode.GEO
        if geo:  # GEO trains locally; the communicator sends the parameter change every k steps
            optimizer.step()
        params = self.layout.dense_values()  # the model's own memory: written in place
        self.comm.step(params, {} if geo else self.layout.dense_grads(),
                       self.layout.sparse_grads())
        # nothing to copy: the flat arrays are the model's, or (async) new arrays it adopts
        self.layout.load_dense(params, adopt=True)
        self._params = params
        self.backend.clear()
        if self.heter is not None:  # after the servers' round: a stalled peer is named there
            self.heter.step()

    def prefetch(self, ids: dict, after_step: bool, create: bool = True) -> None:
        self.backend.prefetch(ids, create=create, after_step=after_step)

    def set_lr(self, lr: float, tables: list) -> None:
        self.comm.set_lr(lr, tables)

    def save(self, dirname: str, mode: int = 0) -> None:
        self.flush_heter()
        saving.save_remote(self.comm, self.comm.dense_names, dirname, mode)
        self._reload()

    def barrier(self, name: str) -> None:
        self.flush_heter()
        self.comm.barrier(name)
        self._reload()

    def flush_heter(self) -> None:
        """The sections' steps this trainer reported reach the servers before a save or a
        barrier (an async heter worker queues its pushes, as an async trainer does)."""
        if self.heter is not None:
            self.heter.flush()

    def refresh(self) -> None:
        """Async: wait until this worker's queued steps are applied and load the servers'
        dense weights (the last reply may lag several steps). Sync steps already return them;
        a GEO worker's own model is what it evaluates."""
        if self.mode == PSMode.ASYNC:
            self.flush_heter()
            self._load_servers_dense()

    def _load_servers_dense(self) -> None:
        names = [t.name for t in self.layout.tables.dense]
        weights = self.comm.refresh(names)
        if names:
            self.layout.load_dense(weights)

    def to_inference(self) -> InferenceSession:
        """Flush, tell the servers, meet the other workers; then read only (the heter
        sections run here from now on)."""
        if self.heter is not None:
            self.heter.stop()
            detach(self.full.heter)
        return InferenceSession.after_training(
            self.full, self.comm, lambda dirname, mode: saving.save_remote(
                self.comm, self.comm.dense_names, dirname, mode))

    def _reload(self) -> None:
        if self.mode == PSMode.GEO:  # a flush exchanged pending steps into the last params
            self.layout.load_dense(self._params)

    def stop(self) -> None:
        self.stopped = True
        try:
            if self.heter is not None:
                self.heter.stop()
            if self.mode == PSMode.ASYNC:  # the model ends with the servers' weights, not with
                self._load_servers_dense()  # the last reply's (up to recv_every pushes older)
        finally:
            self.comm.stop()
        self._reload()
