"""The ``Fleet`` object: one distributed job as seen from one process.

``fleetx.fleet`` exposes the methods of a default instance as module functions; tests build fresh
instances. The object resolves the role (through a role maker), owns the communicator, asks the
planner which strategies apply, and hands the user wrappers that run them. It never names a
strategy: everything a strategy changes goes through the training context.
"""
from __future__ import annotations

import atexit
import copy
import functools
import sys
import warnings
import weakref
from typing import Any, Optional

import torch

from fleetx import env
from fleetx.comm.groups import ProcessGroups, join_alone, leave_alone, pick_backend
from fleetx.fleet import applied, consolidate
from fleetx.fleet.api import FleetError, RuntimeHandlerError  # RuntimeHandlerError: re-exported
from fleetx.fleet.checkpoints import CheckpointCalls
from fleetx.fleet.delegation import OptimizerCalls, RoleQueries, RuntimeCalls
from fleetx.fleet.export import ExportCalls
from fleetx.fleet.healing import HealCalls
from fleetx.fleet.hybrid import HybridQueries
from fleetx.fleet.loaders import LoaderCalls
from fleetx.fleet.memory import MemoryQueries
from fleetx.fleet.model import DistributedModel, state_dict_entry
from fleetx.fleet.optimizer import DistributedOptimizer
from fleetx.fleet.trial import apply_plan, run_trial
from fleetx.role_maker import PaddleCloudRoleMaker, RoleMakerBase
from fleetx.fleet.util import UtilBase
from fleetx.strategy.api import (Mode, Plan, StrategyError, TrainingContext, WorldInfo,
                                 model_builder, registered)
from fleetx.strategy.distributed_strategy import DistributedStrategy
from fleetx.strategy.planner import load_strategies, plan_for

__all__ = ["Fleet", "FleetError", "RuntimeHandlerError"]


def _shutdown_at_exit(fleet: "Fleet") -> None:
    """Leave the world at exit without keeping the fleet alive: a fleet dropped earlier (a new
    ``Fleet()`` in the same process) frees its process groups and their sockets with it."""
    ref = weakref.ref(fleet)

    def shutdown() -> None:
        live = ref()
        if live is not None:
            live._shutdown()
    atexit.register(shutdown)


class Fleet(RoleQueries, OptimizerCalls, RuntimeCalls, MemoryQueries, CheckpointCalls,
            ExportCalls, HybridQueries, LoaderCalls, HealCalls):
    """One process's view of a distributed job.

    Example:
        >>> from fleetx import fleet
        >>> fleet.init(is_collective=True)
        >>> model = fleet.distributed_model(Net())
        >>> opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    """

    def __init__(self) -> None:
        self._role_maker: Optional[RoleMakerBase] = None
        self._strategy: Optional[DistributedStrategy] = None
        self._comm: Optional[ProcessGroups] = None
        self._alone = False  # this fleet created the one-rank group of a one-process job
        self._backend: Optional[str] = None
        self._models: list = []
        # models a strategy module wrapped itself (register_model_type: a pipeline's stage)
        self._claimed: list = []
        self._optimizer: Optional[torch.optim.Optimizer] = None
        self._dist_optimizer: Optional[DistributedOptimizer] = None
        self._ctx: Optional[TrainingContext] = None
        self._plan: Optional[Plan] = None
        self._search: Any = None  # what strategy.auto measured and chose, once it has
        self._util = UtilBase(self)
        self._skeletons: dict = {}  # id(DistributedModel) -> its model's skeleton
        self._warned: set = set()

    @property
    def util(self) -> UtilBase:
        """Host-side collectives among workers (:class:`UtilBase`)."""
        return self._util

    @util.setter
    def util(self, value: Any) -> None:
        """Replace the util, as Paddle allows (``fleet.util = MyUtil()``): a :class:`UtilBase`
        built without a fleet (``super().__init__()``) serves this one. Any object is accepted,
        as in Paddle (metrics only need its ``all_reduce``)."""
        if isinstance(value, UtilBase) and value._fleet is None:
            value._fleet = self
        self._util = value

    # -- set-up --------------------------------------------------------------------------------
    def init(self, role_maker: Optional[RoleMakerBase] = None, is_collective: bool = False,
             strategy: Optional[DistributedStrategy] = None) -> None:
        """Resolve this process's role and, in a launched collective job, join the world.

        Args:
            role_maker: where the role comes from; default ``PaddleCloudRoleMaker`` (environment).
            is_collective: collective (allreduce) job rather than parameter server. Under a
                collective launcher with no parameter servers (``WORLD_SIZE``, ``RANK`` or
                ``PADDLE_TRAINER_ENDPOINTS`` set) the job is collective either way. A
                collective job of one process (``python script.py``) gets a one-rank default
                process group, as torchrun's single process has, unless the script made one.
            strategy: the :class:`DistributedStrategy` (copied; later edits do not reach fleet).

        Raises:
            ValueError: ``is_collective`` is not a bool, or ``role_maker`` is not a role maker.
            TypeError: ``strategy`` is not a ``DistributedStrategy``.
            fleetx.env.EnvError: the launcher environment is missing or inconsistent, or
                ``is_collective=True`` in a parameter-server launch.
            fleetx.strategy.api.StrategyError: in a collective job, ``hybrid_configs``' degrees
                cannot fill the world (each named as ``name=value``, with the world size) or
                two places set one degree to different values.
        """
        if role_maker is None:
            if not isinstance(is_collective, bool):
                raise ValueError(f"`is_collective` should be instance of `bool`, "
                                 f"but got {type(is_collective).__name__}")
            role_maker = PaddleCloudRoleMaker(is_collective=is_collective)
        elif not isinstance(role_maker, RoleMakerBase):
            raise ValueError(f"`role_maker` should be subclass of `RoleMakerBase`, "
                             f"but got {type(role_maker).__name__}")
        self._strategy = self._checked_strategy(strategy, "init")
        role_maker._ensure()
        if self._comm is not None and (self._comm.rank, self._comm.world_size) != (
                role_maker._worker_index(), role_maker._worker_num()):
            self._shutdown()  # a re-init into another world leaves the old one
        if role_maker._worker_num() > 1:
            leave_alone()  # a one-process fleet's one-rank group (this one's or another's)
            self._alone = False
        self._role_maker = role_maker
        self._ctx, self._plan, self._models, self._search = None, None, [], None
        self._claimed = []
        self._optimizer, self._dist_optimizer = None, None
        self._warned = set()
        self._loaders, self._unrestored_loaders = (), 0
        if role_maker.is_collective:
            # nccl (one GPU per process) whenever CUDA is usable, also for a 1-process job.
            self._backend = pick_backend()
            if self._backend == "nccl":
                torch.cuda.set_device(role_maker._get_local_rank() % torch.cuda.device_count())
            topology = self._resolve_hybrid(role_maker._worker_num())
            launched = isinstance(role_maker, PaddleCloudRoleMaker)
            if launched and role_maker._worker_num() > 1 and not self._dry_run():
                self._communicator()
            elif role_maker._worker_num() == 1 and not self._dry_run():
                self._join_alone()
            self._init_hybrid(topology)
        else:
            self._clear_hybrid()
            self._backend = "gloo"  # parameter-server workers only need host-side collectives

    @staticmethod
    def _checked_strategy(strategy: Any, where: str) -> DistributedStrategy:
        if strategy is None:
            return DistributedStrategy()
        if not isinstance(strategy, DistributedStrategy):
            raise TypeError(f"fleet.{where}(strategy=...) expects a DistributedStrategy, "
                            f"got {type(strategy).__name__}")
        return copy.deepcopy(strategy)

    @staticmethod
    def _dry_run() -> bool:
        return env.get("FLEETX_DRY_RUN") == "1"

    def _rm(self, what: str) -> RoleMakerBase:
        if self._role_maker is None:
            use = "using fleet.util" if what == "util" else f"fleet.{what}()"
            raise FleetError(f"call fleet.init() before {use}")
        return self._role_maker

    def _communicator(self) -> Optional[ProcessGroups]:
        """The worker communicator, joined on first use; None for a one-worker job."""
        rm = self._rm("util")
        if rm._is_server() or rm._is_heter_worker():
            raise FleetError("fleet.util collectives run among workers; this is a "
                             f"{'server' if rm._is_server() else 'heter worker'}")
        if rm._worker_num() <= 1:
            return None
        if self._comm is None and env.get("FLEETX_FAULT_TOLERANCE") == "heal" and \
                not self._dry_run():
            if self._healer is None:  # fleetrun's store: the generations of the live ranks
                self._start_healing(rm)
                _shutdown_at_exit(self)
            return self._comm
        if self._comm is None and self._dry_run():
            raise FleetError("dry run: the script communicates (fleet.util, barrier_worker or a "
                             "forward pass) before fleet.distributed_optimizer(...) printed the "
                             "plan; a dry run stops before any communication")
        if self._comm is None:
            self._comm = ProcessGroups.join(rm._worker_index(), rm._worker_num(),
                                           rm._get_trainer_endpoints(), backend=self._backend,
                                           master=rm._get_master())
            _shutdown_at_exit(self)
            if not rm._get_trainer_endpoints():
                rm._set_trainer_endpoints(self._comm.endpoints)
        return self._comm

    def _join_alone(self) -> None:
        """A one-process collective job gets a one-rank default group, as under torchrun."""
        if join_alone(self._backend):
            self._alone = True
            _shutdown_at_exit(self)

    def _shutdown(self) -> None:
        """Leave the world: destroy the process groups and release the store (also at exit)."""
        try:
            self._wait_for_save()  # a pending save's thread commits through these groups
        finally:
            self._leave()

    def _leave(self) -> None:
        self._clear_hybrid()  # its groups go with the world's
        if self._comm is not None:
            self._comm.close()
            self._comm = None
        if self._alone:
            leave_alone()
            self._alone = False

    # -- role queries --------------------------------------------------------------------------
    def barrier_worker(self) -> None:
        """Wait for every worker (a missing one is named after ``FLEETX_TIMEOUT`` seconds)."""
        self._rm("barrier_worker")
        self.util.barrier("worker")

    def local_device(self) -> torch.device:
        """The device this process trains on: its GPU under NCCL, else the CPU."""
        self._rm("local_device")
        if self._backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _world(self, what: str = "distributed_model") -> WorldInfo:
        rm = self._rm(what)
        return WorldInfo(
            rank=rm._worker_index(), world_size=rm._worker_num(),
            local_rank=rm._get_local_rank(), local_world_size=rm._get_local_world_size(),
            nnodes=rm._node_num(),
            mode=Mode.COLLECTIVE if rm.is_collective else Mode.PS,
            is_server=rm._is_server(), server_num=rm._server_num(),
            device=self.local_device().type,
            server_endpoints=tuple(rm._get_pserver_endpoints()),
            is_heter_worker=rm._is_heter_worker(),
            heter_endpoints=tuple(rm._get_heter_worker_endpoints()))

    # -- planning and wrapping ----------------------------------------------------------------
    def _build_context(self) -> TrainingContext:
        world = self._world()
        model = self._models[-1].module if self._models else (
            self._claimed[-1] if self._claimed else None)
        plan = plan_for(self._strategy, world, model, self._optimizer)
        if self._dry_run() and self._optimizer is not None:
            print(plan, flush=True)
            print("fleetx dry run: stopping before any communication", flush=True)
            sys.exit(0)
        if world.mode is Mode.COLLECTIVE and world.world_size > 1:
            self._communicator()
            self._heal_check(plan, self._strategy, world.world_size)
        ctx = apply_plan(plan, self._strategy, world, model, self._optimizer,
                         trial=functools.partial(self._trial, world, model),
                         replan=self._replan)
        for entry in plan.warnings:
            if (entry.name, entry.reason) not in self._warned:  # once per job, not per re-plan
                self._warned.add((entry.name, entry.reason))
                warnings.warn(f"fleetx: {entry.warning_text}", stacklevel=3)
        self._ctx, self._plan = ctx, plan
        return ctx

    def _trial(self, world: WorldInfo, model: Any, strategy: DistributedStrategy,
               args: tuple, kwargs: dict) -> Any:
        """A few training steps of ``strategy``'s plan on copies (``ctx.trial``, for auto)."""
        return run_trial(world, strategy, model, self._optimizer, args, kwargs)

    def _replan(self, strategy: DistributedStrategy, report: Any) -> None:
        """Put ``strategy`` in force and rebuild the context both wrappers use (``ctx.replan``:
        auto's choice); ``report`` is shown by :meth:`explain`."""
        self._strategy, self._search = strategy, report
        ctx = self._build_context()
        if self._dist_optimizer is not None:
            self._dist_optimizer._ctx = ctx

    def _context(self) -> TrainingContext:
        return self._ctx if self._ctx is not None else self._build_context()

    def distributed_model(self, model: torch.nn.Module) -> DistributedModel:
        """Wrap ``model`` so the plan's strategies run on it (DDP with more than one process).

        A model whose type a strategy module claims gets that module's wrapper instead: a
        ``PipelineLayer`` gets a ``PipelineParallel`` (``train_batch`` / ``eval_batch``) run with
        ``pipeline_configs``.

        The wrapper builds its engine at the first forward, so it may still be moved to a device;
        a strategy that shards the model (sharding stage 2 or 3) changes it here, in place, so
        build the optimizer from ``model.parameters()`` afterwards (or before: it is rebuilt
        over the shards). Its ``state_dict`` has the plain model's keys and full tensors.

        Raises:
            ValueError: ``model`` is None or not an ``nn.Module``.
        """
        self._rm("distributed_model")
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"fleet.distributed_model expects a torch.nn.Module, "
                             f"got {type(model).__name__}")
        load_strategies()  # the strategy modules claim their model types as they load
        build = model_builder(model)
        if build is not None:  # it runs by its own schedule (a pipeline's stage)
            self._claimed.append(model)
            self._ctx = None  # re-plan with it as the model (amp's op lists hook it)
            if self._dist_optimizer is not None:  # both must share one context
                self._dist_optimizer._ctx = self._build_context()
            return build(model, self._strategy, self._context)
        wrapped = DistributedModel(model, self._context)
        # before a strategy changes the model in place: what consolidated_model rebuilds
        self._skeletons[id(wrapped)] = consolidate.skeleton(model)
        # the entry of save_pretrained and of a sharded state_dict (a copy drops it)
        wrapped.__dict__["_enter_collective"] = self._enter
        wrapped.register_state_dict_pre_hook(state_dict_entry)
        self._models.append(wrapped)
        self._ctx = None  # re-plan with the model known
        if self._dist_optimizer is not None:
            # distributed_optimizer came first: both wrappers must share one context.
            self._dist_optimizer._ctx = self._build_context()
        elif self._shapes_model():
            self._build_context()  # the model changes now, before its parameters are read
        return wrapped

    def consolidated_model(self, model: Any) -> torch.nn.Module:
        """A plain copy of a distributed model, to evaluate or ``generate`` on one rank.

        Every rank calls it (at sharding stages 2 and 3 the full state is gathered, a
        collective); the copy is a module of the model's own class holding whole tensors on the
        model's device, with no fleetx hook, so any one rank may then run it alone (the others
        may drop it). It is a copy: training the distributed model does not change it.

        Args:
            model: what ``fleet.distributed_model`` returned (or the model given to it).

        Returns:
            The plain model, in the training mode of ``model``.

        Raises:
            ValueError: ``model`` did not come from ``fleet.distributed_model``.
            fleetx.comm.api.CommError: another rank did not call it (named within seconds).

        Example:
            >>> plain = fleet.consolidated_model(model)        # every rank
            >>> if fleet.worker_index() == 0:
            ...     print(plain.eval().generate(ids, max_new_tokens=20))
        """
        self._rm("consolidated_model")
        wrapped = consolidate.find_wrapped(self._models, model, "consolidated_model")
        self._enter("fleet.consolidated_model")
        state = wrapped.state_dict()
        return consolidate.plain_copy(self._skeletons[id(wrapped)], state, wrapped.training)

    def _shapes_model(self) -> bool:
        """Whether an applied strategy changes the model in place (a dry run changes
        nothing: it stops at distributed_optimizer). A strategy that cannot run as configured
        is reported by distributed_optimizer, where every precondition is checked with the
        optimizer known (and a strategy given there may still replace this one)."""
        if self._dry_run():
            return False
        try:
            plan = plan_for(self._strategy, self._world(), self._models[-1].module,
                            self._optimizer)
        except StrategyError:
            return False
        return any(registered(name).shapes_model for name in plan.applied)

    def distributed_optimizer(self, optimizer: torch.optim.Optimizer,
                              strategy: Optional[DistributedStrategy] = None
                              ) -> DistributedOptimizer:
        """Wrap ``optimizer`` so every step runs through the plan's strategies.

        Args:
            optimizer: a ``torch.optim.Optimizer`` over the model's parameters.
            strategy: replaces the strategy given to ``fleet.init`` (copied).

        Raises:
            TypeError: ``optimizer`` is not a torch optimizer, or ``strategy`` is not a
                ``DistributedStrategy``.
            fleetx.strategy.api.StrategyError: an enabled strategy cannot run here.
        """
        rm = self._rm("distributed_optimizer")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"fleet.distributed_optimizer expects a torch.optim.Optimizer, "
                            f"got {type(optimizer).__name__}")
        if isinstance(optimizer, DistributedOptimizer):
            raise TypeError("this optimizer is already a fleetx DistributedOptimizer")
        if strategy is not None:
            if rm.is_collective:
                warnings.warn("the strategy given to distributed_optimizer replaces the one "
                              "given to fleet.init(); prefer passing it to fleet.init()",
                              stacklevel=2)
            self._strategy = self._checked_strategy(strategy, "distributed_optimizer")
        self._optimizer = optimizer
        ctx = self._build_context()
        self._dist_optimizer = DistributedOptimizer(
            ctx, modules=lambda: [m.module for m in self._models] + self._claimed)
        self._track_steps(self._dist_optimizer)
        self._heal_attach(self._dist_optimizer)
        return self._dist_optimizer

    def observe(self, **options: Any) -> Any:
        """A progress bar (worker 0) and per-rank scalars for this process's training loop
        (:func:`fleetx.fleet.observing.observe` lists the options; ``docs/observability.md``)."""
        from fleetx.fleet.observing import observe

        return observe(self, **options)

    def explain(self, file: Any = None) -> Plan:
        """Print (and return) the plan: which strategies apply, in what order, and why not.

        Once ``strategy.auto`` has chosen, the plan is the winner's, followed by every measured
        candidate with its figures and why the winner won.
        """
        plan = plan_for(self._strategy, self._world("explain"),
                        self._models[-1].module if self._models else None, self._optimizer)
        out = file if file is not None else sys.stdout
        print(plan, file=out, flush=True)
        if self._search is not None:
            print(self._search, file=out, flush=True)
        return plan

    @property
    def plan(self) -> Optional[Plan]:
        """The plan in force (None before ``distributed_model`` / ``distributed_optimizer``)."""
        return self._plan

    def applied_strategies(self) -> tuple:
        """Names of the strategies the plan in force applies, in order (empty before any)."""
        return self._plan.applied if self._plan is not None else ()

    def _applied_plan(self, what: str) -> Optional[Plan]:
        if self._dist_optimizer is None or self._plan is None:
            # Paddle's words and its empty answer before its minimize.
            print(f"WARNING: You may need to call minimize function before {what} called",
                  flush=True)
            return None
        return self._plan

    def _final_strategy(self) -> Any:
        """The strategy as applied (Paddle's "valid strategy"): a copy with every meta-optimizer
        switch the plan did not apply turned off; ``{}`` before ``distributed_optimizer``."""
        plan = self._applied_plan("_final_strategy")
        return {} if plan is None else applied.final_strategy(self._strategy, plan)

    def _get_applied_meta_list(self) -> list:
        """Paddle's meta-optimizer class names of the applied strategies (``"AMPOptimizer"``...),
        in application order; ``[]`` before ``distributed_optimizer``."""
        plan = self._applied_plan("_get_applied_meta_list")
        return [] if plan is None else applied.meta_list(plan)

    def _get_applied_graph_list(self) -> list:
        """``["GraphExecutionOptimizer"]`` when data parallel applies (Paddle's graph optimizer
        for it); ``[]`` before ``distributed_optimizer``."""
        plan = self._applied_plan("_get_applied_graph_list")
        return [] if plan is None else applied.graph_list(plan)

