"""The parameter-server runtime: what ``fleet.init_worker / init_server / run_server /
stop_worker / save_persistables`` and a training step do, for a torch model and optimizer.

The fleet's parameter-server strategy builds one :class:`PSRuntime` per job and hooks it into
the training context; this module knows nothing of the fleet. Every role runs the same script,
so every role builds the same model and optimizer, and :meth:`ModelLayout.of` turns them into
the same tables (converting ``nn.Embedding(sparse=True)`` / ``nn.EmbeddingBag(sparse=True)``
in place). Then:

* a **server** (``init_server(dirname)`` + ``run_server()``) serves those tables, from a
  checkpoint when given one, until every worker stopped;
* a **worker** (``init_worker()``) connects a communicator for the job's mode; each optimizer
  step goes through :class:`PSOptimizer`: sync/async send the gradients and load the servers'
  weights, GEO steps the user's optimizer locally and lets the communicator exchange deltas;
* with **no servers** (a script run without a launcher) the process trains alone: sparse
  tables live in-process (:class:`LocalSparseBackend`) with the servers' rules, and dense
  parameters are stepped by the user's optimizer.

A worker prints ``samples/s`` and the mean loss every ``log_interval`` seconds, and says where
it saved (``saved to <path>``) and, alone, where it loaded from (``loaded from <path>``).

:meth:`PSRuntime.init_inference` (``DistributedInfer.init_distributed_infer_env``) turns any
role to inference (:mod:`.inference`): servers of an inference-only job serve a save read-only,
workers read with lookups that never create rows, and a worker that trained first sends what it
holds and meets the others before it reads.

A script run alone (plain ``python``, no servers) that calls ``init_server(dirname)`` only in
its server branch never loads the checkpoint: that branch does not run. Evaluating such a
never-trained, never-loaded model would silently score the initial weights, so the first
evaluation forward raises :class:`StateError` naming the fix instead.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional

import torch
from torch import nn

from fleetx.optim.wrapper import OptimizerWrapper
from fleetx.ps import kernels
from fleetx.ps.api import CommunicatorConfig, PSConfig, StateError
from fleetx.ps_torch.heter_sections import heter_device
from fleetx.ps_torch.heter_worker import HeterWorker
from fleetx.ps_torch.inference import NO_STEP, InferenceSession
from fleetx.ps_torch.layout import ModelLayout
from fleetx.ps_torch.prefetch import PrefetchLoader, prefetch_groups, table_ids
from fleetx.ps_torch.progress import CountedModel, Progress
from fleetx.ps.server import run_server
from fleetx.ps.shard import check_growth
from fleetx.ps_torch import saving
from fleetx.ps_torch.table_ops import TableCalls
from fleetx.ps_torch.sessions import LocalSession, RemoteSession, say as _say

__all__ = ["PSRuntime", "PSOptimizer"]

log = logging.getLogger("fleetx.ps")


class PSRuntime(TableCalls):
    """One process's part of a parameter-server job (the fleet's ``runtime``).

    Args:
        model: the user's module (converted in place), or None until it is known.
        optimizer: the user's torch optimizer.
        config: the cluster; None for a job without servers (local training).
        is_server: this process is a server.
        index: this worker's rank, or this server's index.
        comm: the worker's sending knobs (``a_sync_configs``).
        log_interval: seconds between a worker's progress lines (0: none).
        heter_device: on a heter worker, ``heter_worker_device_guard`` (``index`` is then its
            index among the heter workers); None on every other role.

    Example:
        >>> runtime = PSRuntime(model, opt, config, is_server=False, index=0)  # doctest: +SKIP
        >>> runtime.init_worker(); runtime.optimizer.step(); runtime.stop_worker()
    """

    def __init__(self, model: Optional[nn.Module], optimizer: torch.optim.Optimizer,
                 config: Optional[PSConfig], *, is_server: bool, index: int,
                 comm: Optional[CommunicatorConfig] = None, log_interval: float = 10.0,
                 heter_device: Optional[str] = None) -> None:
        self.model, self.inner, self.config = model, optimizer, config
        self.is_server, self.index, self.heter_device = is_server, index, heter_device
        self.comm = comm or CommunicatorConfig()
        self.layout = ModelLayout.of(model, optimizer) if model is not None else None
        if config is not None and self.layout is not None:  # every role fails at once
            check_growth(self.layout.tables, config.mode)
        self.progress = Progress(index, log_interval)
        self.optimizer = PSOptimizer(self)
        self._session: Any = None
        self._load_dir: Any = None  # a save folder, or a base and its deltas
        self._var_names: Optional[list] = None
        self._lrs: dict[int, float] = {}
        self._stepped = False  # a step since the last evaluation forward
        self._trained = False  # any step at all
        self._start_chosen = False  # init_server was called: the starting weights are chosen
        self._delta_blocked = False  # a save failed: no delta until a full save
        self._inference = False  # init_inference was called: reads only

    # -- the fleet's runtime interface -----------------------------------------------------
    def init_worker(self) -> None:
        """Connect to the servers (or set up local tables) and load the starting weights.

        Raises:
            StateError: on a server, twice, or before ``fleet.distributed_model``.
        """
        if self.is_server or self.is_heter:
            raise StateError(f"init_worker() runs on workers; this process is a "
                             f"{'heter worker' if self.is_heter else 'server'} (call "
                             "fleet.init_server() and fleet.run_server())")
        if self._session is not None:
            raise StateError("init_worker() was already called")
        layout = self._layout("init_worker")
        _log_to_stderr()  # the worker's log names its kernel backend, as a server's does
        if self.config is None:
            kernels.log_backend(log, "local tables")  # a job without servers has no KVClient
            self._session = LocalSession(layout, self._load_dir, self._var_names)
        else:
            self._session = RemoteSession(layout, self.config, self.index, self.comm)
        layout.bind(self._session.backend)
        layout.release_initial_sparse()
        self._lrs = {g: self._group_lr(g) for g in layout.lr_groups()}

    def init_server(self, dirname: Any = None, var_names: Any = None) -> None:
        """Prepare to serve, from the save in ``dirname`` when given (written by
        ``save_persistables`` with the same number of servers, or any number).

        Args:
            dirname: a save folder; or a list: a base save (mode 0 or 1) and the deltas
                (mode 2) written after it, in order, replayed one after the other.
            var_names: load only these tables (sparse table names, ``dense.<group>``); the
                others start as in a fresh job.

        In a job without servers this loads the checkpoint into the local tables instead
        (call it before ``init_worker``).

        The checkpoint is read by ``run_server``: it must lie under the save root
        (``FLEETX_PS_SAVE_ROOT``, default the working directory), and every file is verified
        against its manifest; ``run_server`` raises ``PSConfigError`` for a folder outside the
        root or a ``var_names`` entry that is not a table of the save, and
        :class:`fleetx.checkpoint.CheckpointError` naming any file that is missing, damaged or
        from another save, and the manifests of saves that are not one chain.

        Raises:
            StateError: on a worker of a job with servers, or after the job started.
            ValueError: ``var_names`` is not a list of names.
        """
        if var_names is not None and (isinstance(var_names, str) or not all(
                isinstance(n, str) for n in var_names)):
            raise ValueError(f"init_server(var_names={var_names!r}): expected a list of table "
                             "names")
        if not self.is_server and not self.is_heter and self.config is not None:
            raise StateError("init_server() runs on servers; this process is a worker")
        self._layout("init_server")
        if self.config is None and self._session is not None:
            raise StateError("init_server() after the job started: in a job without servers "
                             "it loads the local tables, so call it before fleet.init_worker() "
                             "and before the first forward")
        self._load_dir = list(dirname) if isinstance(dirname, (list, tuple)) else dirname
        self._var_names = None if var_names is None else list(var_names)
        self._start_chosen = True

    def run_server(self, read_only: bool = False) -> None:
        """Serve until every worker stopped (``read_only``: an inference-only job). Raises the
        error naming a lost worker."""
        if self.is_heter:
            return self._run_heter()
        if not self.is_server:
            if self.config is None:
                return  # no servers: this process trains alone
            raise StateError("run_server() runs on servers; this process is a worker")
        _log_to_stderr()
        run_server(self.config, self.index, self._layout("run_server").tables,
                   load_dir=self._load_dir, load_tables=self._var_names,
                   read_only=read_only)

    def init_inference(self, dirname: Optional[str] = None) -> None:
        """Turn this process to inference (``DistributedInfer.init_distributed_infer_env``).

        * a server of a job that has not served yet serves ``dirname`` read-only until every
          worker stopped (it returns then);
        * a worker that has not started joins such a job as a reader (no servers: it loads
          ``dirname`` into its local tables); one that trained sends what it holds, tells the
          servers, and meets the other workers before it reads (:mod:`.inference`);
        * from then on lookups never create rows and an optimizer step raises ``StateError``.

        Raises:
            StateError: a server without ``dirname`` (it would serve untrained tables), or a
                worker of a one-process job given ``dirname`` after it started.
        """
        if self.is_heter:  # inference runs the sections on the workers
            _log_to_stderr()
            log.info("heter worker %d: inference runs the heter sections on the workers; "
                     "nothing to serve", self.index)
            return
        if self.is_server:
            if not dirname:
                raise StateError("init_distributed_infer_env(dirname=None) on a server of an "
                                 "inference-only job: it would serve untrained tables; pass "
                                 "the folder save_persistables wrote")
            self.init_server(dirname)
            return self.run_server(read_only=True)
        if self._inference:
            return
        if self._session is None:
            if self.config is None:
                if dirname:
                    self.init_server(dirname)
                self.init_worker()
            else:
                self._session = InferenceSession.connect(self._layout("init_inference"),
                                                         self.config, self.index)
                self.layout.bind(self._session.backend)
        elif isinstance(self._session, RemoteSession):
            self._session = self._started("init_inference").to_inference()
            self.layout.bind(self._session.backend)
        elif dirname:  # a one-process job that started: too late to load (init_server says so)
            self.init_server(dirname)
        self._inference = True

    def latency_ms(self, kind: str, quantile: str) -> Optional[float]:
        """A quantile (``"p50"``, ``"p99"``) of this worker's ``kind`` requests (``"PULL"``,
        ``"PUSH"``) to the servers so far, in ms (:meth:`fleetx.ps.client.KVClient.latency`);
        None before any such request, or without servers."""
        client = getattr(getattr(self._session, "comm", None), "client", None)
        summary = client.latency().get(kind) if client is not None else None
        return summary[quantile] * 1e3 if summary and summary.get("count") else None

    def traffic_mb(self, direction: str) -> Optional[float]:
        """MB (10^6 bytes) this worker ``"sent"`` to or ``"received"`` from the servers so far
        (:meth:`fleetx.ps.client.KVClient.traffic`); None without servers."""
        client = getattr(getattr(self._session, "comm", None), "client", None)
        return client.traffic()[direction] / 1e6 if client is not None else None

    def stop_worker(self) -> None:
        """Send what is queued, tell the servers this worker is done, disconnect."""
        if self._session is not None and not getattr(self._session, "stopped", False):
            self._session.stop()

    def save_persistables(self, dirname: str, mode: int = 0) -> None:
        """The first worker asks every server to write its shards and writes the dense
        weights; on the other workers this does nothing. Saving again to ``dirname`` replaces
        the checkpoint atomically (until the new one is complete the previous one stays).

        Args:
            dirname: the save's folder (give each save of a base-and-deltas chain its own).
            mode: 0 everything (each row's optimizer state, show/click statistics, pending
                admission counts); 1 a base (weights); 2 a delta: the rows changed since the
                previous save, and the ids removed since (``docs/ps_tables.md``).

        Raises:
            ValueError: another ``mode``.
            StateError: a delta with no full save (or load) before it, or after a save that
                failed.
            PSConfigError: ``dirname`` is outside the servers' save root.
            fleetx.checkpoint.CheckpointError: a file of this worker or the commit cannot be
                written (the previous checkpoint is kept).
            fleetx.ps.RemoteError: a server refused (remote type ``CheckpointError``: a table
                holds NaN or inf, or its files cannot be written; the previous checkpoint is
                kept).
        """
        mode = saving.check_mode(mode)
        if self.index != 0 or self.is_server:
            return
        if mode == 2 and self._delta_blocked:
            raise StateError("save_persistables(mode=2): the previous save failed, so a delta "
                             "would follow a save that was never committed; make a full save "
                             "(mode 0 or 1) first")
        try:
            self._started("save_persistables").save(dirname, mode)
        except BaseException:
            self._delta_blocked = True
            raise
        if mode != 2:
            self._delta_blocked = False
        _say(f"saved to {os.path.abspath(dirname)}")

    def prefetch(self, batches: Iterable, ids_of: Callable[[Any], Mapping]) -> PrefetchLoader:
        """``fleet.prefetch``: iterate ``batches``; while batch ``i`` trains, the rows of batch
        ``i + 1`` are on their way (:mod:`fleetx.ps_torch.prefetch` says when they are read
        in each mode). Nothing to do in a job without servers.

        Args:
            batches: any iterable of batches (a ``DataLoader``, a generator...).
            ids_of: ``batch -> {embedding module or table name: ids}``: the ids each sparse
                table's lookup will get in the forward of that batch (a tensor or array; a list
                of them, in lookup order, for a table looked up several times).

        Raises:
            StateError: on a server, or before ``init_worker`` in a job with servers (at the
                first batch).
            PSConfigError: ``ids_of`` named a table the model does not have (the message lists
                the tables).
        """
        return PrefetchLoader(batches, ids_of, self._prefetch_rows)

    def _prefetch_rows(self, ids: Mapping, after_step: bool) -> None:
        if self.is_server:
            raise StateError("fleet.prefetch runs on workers; this process is a server")
        if self._session is None and self.config is None:
            return  # a job without servers has its rows at hand
        session = self._started("fleet.prefetch")
        if not hasattr(session, "prefetch"):
            return
        layout = self._layout("prefetch")
        for create, group in prefetch_groups(layout.sparse, table_ids(layout, ids)).items():
            session.prefetch(group, after_step, create)

    def barrier(self, name: str = "") -> None:
        """Wait for every worker that has not stopped (through server 0)."""
        session = self._started("barrier")
        if hasattr(session, "barrier"):
            session.barrier(name)

    @property
    def is_heter(self) -> bool:
        """This process is a heter worker."""
        return self.heter_device is not None

    def _run_heter(self) -> None:
        """A heter worker's ``run_server``: serve the sections until its trainers stopped."""
        _log_to_stderr()
        device, note = heter_device(self.heter_device)
        log.info("heter worker %d: %s", self.index, note)
        HeterWorker(self.config, self.index, self._layout("run_server"), self.comm,
                    device).run()

    # -- hooks the strategy installs ---------------------------------------------------------
    def step(self) -> None:
        """One optimizer step (called by :class:`PSOptimizer`)."""
        session = self._started("step")
        if self._inference:
            raise StateError(NO_STEP)
        self._sync_lr()
        session.step(self.inner)
        self._stepped = self._trained = True
        self.progress.step()

    def set_lr(self, lr: float) -> None:
        """``fleet.set_lr`` / ``optimizer.set_lr`` reached the torch optimizer's groups; tell
        the servers (or the local rules)."""
        if self._session is not None:
            self._sync_lr()

    @contextlib.contextmanager
    def forward_scope(self) -> Iterator[None]:
        """Entered around every forward: a local job starts on its first forward; the first
        evaluation forward after training steps sees every one of them."""
        if self._session is None and self.config is None and not self.is_server:
            self.init_worker()
        session = self._started("forward")
        training = self.model is not None and self.model.training and torch.is_grad_enabled()
        if not training and self.config is None and not (self._trained or self._start_chosen):
            raise StateError(_UNLOADED)
        if not training and self._stepped and hasattr(session, "refresh"):
            session.refresh()
            self._stepped = False
        yield

    def wrap_model(self, module: nn.Module) -> nn.Module:
        return CountedModel(module, self.progress)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)
        if self.layout is not None:
            self.layout.clear_sparse_grads()

    # -- internals ---------------------------------------------------------------------------
    def _layout(self, what: str) -> ModelLayout:
        if self.layout is None:
            raise StateError(f"{what}(): the parameter server needs the model; call "
                             f"fleet.distributed_model(model) before fleet.distributed_optimizer")
        return self.layout

    def _started(self, what: str) -> Any:
        if self._session is None:
            raise StateError(f"{what}: call fleet.init_worker() first (the worker is not "
                             f"connected to the parameter servers)")
        if getattr(self._session, "stopped", False):
            raise StateError(f"{what}: this worker called fleet.stop_worker() and is "
                             f"disconnected; train and evaluate before stopping")
        return self._session

    def _group_lr(self, group: int) -> float:
        return float(self.inner.param_groups[group]["lr"])

    def _sync_lr(self) -> None:
        """Send every learning rate that changed since the last step (``set_lr`` or an LR
        scheduler writes the groups' ``lr``)."""
        for group, tables in self.layout.lr_groups().items():
            lr = self._group_lr(group)
            if self._lrs.get(group) != lr:
                self._session.set_lr(lr, tables)
                self._lrs[group] = lr


class PSOptimizer(OptimizerWrapper):
    """The training context's optimizer in parameter-server mode: the user's optimizer held by
    composition (its ``param_groups``, state and state dict are the user's), with ``step``
    going through the runtime.

    Args:
        runtime: the :class:`PSRuntime` whose ``step`` runs.
    """

    def __init__(self, runtime: PSRuntime) -> None:  # noqa: D107
        super().__init__()
        self._runtime = runtime

    @property
    def inner(self) -> torch.optim.Optimizer:
        return self._runtime.inner

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = closure() if closure is not None else None
        self._runtime.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._runtime.zero_grad(set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        raise StateError("parameter-server tables are laid out when the optimizer is wrapped; "
                         "add every param group before fleet.distributed_optimizer")


_UNLOADED = (
    "evaluating a model that was neither trained nor loaded: this process runs alone (no "
    "parameter servers: TRAINING_ROLE is not set, as under plain python), so an "
    "init_server(dirname) in the server branch never ran and these are the initial weights. "
    "To evaluate a checkpoint in one process, call fleet.init_server(dirname) before "
    "fleet.init_worker() when fleet.server_num() == 0 (it loads the checkpoint into this "
    "process); to score the initial weights on purpose, call fleet.init_server() first; or "
    "start the job with fleetrun --server_num N --worker_num M")


def _log_to_stderr() -> None:
    """Servers log their rows, memory and requests/s, workers their kernel backend; show them
    unless logging is set up."""
    if not logging.getLogger().handlers and not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
