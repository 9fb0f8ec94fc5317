"""The strategy contract: what a distributed strategy is, how the planner judges it, and the
training context it changes.

A *strategy* is one algorithm a user switches on through :class:`DistributedStrategy`
(``strategy.amp = True``...). Each lives in its own module as a :class:`Strategy` subclass
registered with :func:`register`. It declares

* ``name``: the ``DistributedStrategy`` switch it answers to, and ``config``: its typed
  ``*_configs`` class, where it has one,
* ``requires`` / ``conflicts``: other strategy classes it needs or cannot run beside,
* ``runs_after`` / ``runs_before``: strategies that, when both apply, must install their hooks
  before / after it (a strategy also runs after what it ``requires``, unless it says
  ``runs_before`` of it); ``runs_last``: after every other applied strategy,
* ``paddle_name`` / ``paddle_graph_name``: the class Paddle 2.2 runs for the switch (a meta or
  a graph optimizer), which ``fleet._get_applied_meta_list()`` and ``_graph_list()`` report,
* ``can_apply(world)``: a *pure* judgement (:class:`Verdict`) from the :class:`PlanInput`,
* ``apply(ctx)``: the change it makes, only through the hook points of :class:`TrainingContext`.

The strategies themselves live in :mod:`fleetx.strategy.algorithms`, one module each. The
planner (``planner.py``) turns a strategy object and a world into a :class:`Plan` without
running anything; the fleet engine then calls ``apply`` on each planned strategy in order. The
order comes from the declared relations alone (:func:`sort_strategies`: a topological sort,
ties broken by name); a cycle is an :class:`OrderError` naming it. The planner's inputs and
outputs (:class:`WorldInfo` ... :class:`Plan`) are defined in ``plan.py`` and imported from
here.

A model type that trains by its own schedule (a pipeline stage) is claimed by the module that
knows it with :func:`register_model_type`: ``fleet.distributed_model`` then returns that
module's wrapper, built from the training context, and names no model type itself.
"""
from __future__ import annotations

import abc
import contextlib
import heapq
from typing import Any, Callable, ClassVar, ContextManager, Iterator, Optional

import torch

# The planner's inputs and outputs live in plan.py; they are part of this contract.
from fleetx.strategy.plan import (Mode, ModelInfo, OptimizerInfo, Plan, PlanEntry, PlanInput,
                                  Verdict, WorldInfo)

__all__ = [
    "Mode", "WorldInfo", "ModelInfo", "OptimizerInfo", "PlanInput", "Verdict", "PlanEntry",
    "Plan", "Strategy", "StrategyError", "TrainingContext", "register", "registered",
    "RegistryError", "OrderError", "train_only", "sort_strategies", "unregister",
    "register_model_type", "model_builder",
]


class StrategyError(ValueError):
    """A strategy the user enabled cannot run here (its message names the strategy and why)."""


class RegistryError(KeyError):
    """A strategy name is registered twice, or an unknown name is looked up."""


class OrderError(RegistryError):
    """The declared ``runs_after`` / ``runs_before`` / ``requires`` relations form a cycle."""


class TrainingContext:
    """The seams through which strategies change training. The engine owns one per job.

    Strategies never reach into the engine; they add to these hook points:

    * ``model``: the user's module (None until distributed_model). Strategies never replace
      it; only a ``shapes_model`` strategy changes it, in place.
    * ``optimizer``: the inner torch optimizer (a strategy may replace it, e.g. LARS).
    * ``ddp_options``: keyword arguments for ``DistributedDataParallel`` (bucket size...).
    * ``model_wrappers``: ``fn(module) -> module`` applied in order when the model is built;
      a wrapper marked with :func:`train_only` (gradient synchronisation) is skipped in eval mode.
    * ``comm_hooks``: ``(state, hook)`` pairs composed into the one DDP comm hook.
    * ``forward_contexts``: context-manager factories entered around every forward.
    * ``backward``: ``fn(loss) -> None`` that runs the backward pass. Strategies wrap the one in
      place (``lambda loss: prev(loss * scale)``) so that several can change it.
    * ``backward_from``: ``fn(tensors, grads) -> None`` that runs the backward of a pipeline
      stage other than the last from the gradients of its outputs. Those came from the next
      stage's backward, so they already carry what ``backward`` applied to the loss (amp's
      scale): a strategy that wraps ``backward`` wraps this one only to note that a backward ran
      or to enter its backward region, never to change the gradients again.
    * ``step_guards``: ``fn() -> bool`` run before ``optimizer.step``; any ``False`` skips it.
      They run in plan order and stop at the first ``False``, so a guard only runs on steps the
      earlier ones allowed (an accumulation-boundary check placed before an overflow check).
    * ``after_step``: ``fn() -> None`` run after every (taken or skipped) optimizer step.
    * ``zero_grad_guards``: ``fn() -> bool`` run by ``zero_grad``; any ``False`` keeps the
      gradients (they are still being accumulated).
    * ``partial_gradients``: ``fn() -> bool``; any ``True`` says the gradients after this
      backward are only part of an update, neither complete nor synchronised (a gradient-merge
      micro-step before its last): ``clip_grad_norm_`` then leaves them alone.
    * ``before_clip``: ``fn(params) -> None`` run in plan order by the optimizer wrapper's
      ``clip_grad_norm_`` before anything else, with the parameters whose gradients it clips: a
      strategy whose gradients do not hold the model's values yet brings them there (unscales
      them, as ``GradScaler.unscale_`` does) or raises when it cannot (amp refuses today).
    * ``sync_gradients``: ``fn() -> bool``; ``False`` runs the next backward under ``no_sync``.
      Strategies wrap the one in place (``prev() and mine()``) rather than replace it.
    * ``loss_listeners``: ``fn(loss) -> None`` told the loss of every backward run through the
      optimizer wrapper (``minimize`` / ``backward``), before the backward runs.
    * ``lr_listeners``: ``fn(lr) -> None`` told when the user sets a new learning rate.
    * ``optimizer_methods``: extra methods of the optimizer wrapper, by name (Paddle's
      ``get_loss_scaling`` for example); the wrapper calls none of them itself.
    * ``state``: per-strategy state, keyed by strategy name (saved with the optimizer).
    * ``scalars``: ``fn() -> float | None`` by column name of :data:`fleetx.observe.COLUMNS`
      (``loss_scale``, ``dgc_sparsity``, ``ps_pull_p50_ms``...): what ``fleet.observe`` logs
      besides the loss; read only on logged steps.
    * ``runtime``: an object serving ``init_worker`` / ``init_server`` / ``run_server`` /
      ``stop_worker`` / ``save_persistables`` (the parameter-server strategy installs one).
    * ``first_batch``: ``fn(args, kwargs) -> None`` run once, with the inputs of the first
      training forward of the model, before its engine is built (``auto`` measures there).
    * ``trial``: set by the engine: ``fn(strategy, args, kwargs) -> Measurement`` runs a few
      training steps of ``strategy``'s plan on copies of the model and optimizer.
    * ``replan``: set by the engine: ``fn(strategy, report) -> None`` replaces the strategy in
      force and rebuilds the training context from it (``report`` is shown by explain).
    * ``planner``: set by the engine: ``fn(plan_input) -> Plan``, the planner that made this
      context's plan (``auto`` plans its candidates with it, as ``PlanInput.planner``).
    * ``restore_checkpoint``: set by ``fleet.auto_checkpoint``: ``fn() -> int | None`` loads
      the job's last checkpoint of its folder (every rank calls: a collective) and returns its
      step, None when none was saved yet (the anomaly guard rolls back with it).
    """

    def __init__(self, world: WorldInfo, strategy: Any, optimizer: Any = None,
                 model: Any = None) -> None:
        self.world = world
        self.strategy = strategy
        self.model = model
        self.optimizer = optimizer
        self.ddp_options: dict[str, Any] = {}
        self.model_wrappers: list[Callable[[Any], Any]] = []
        self.comm_hooks: list[tuple[Any, Callable]] = []
        self.forward_contexts: list[Callable[[], ContextManager]] = []
        self.backward: Callable[[Any], None] = lambda loss: loss.backward()
        self.backward_from: Callable[[Any, Any], None] = torch.autograd.backward
        self.step_guards: list[Callable[[], bool]] = []
        self.after_step: list[Callable[[], None]] = []
        self.zero_grad_guards: list[Callable[[], bool]] = []
        self.partial_gradients: list[Callable[[], bool]] = []
        self.before_clip: list[Callable[[list], None]] = []
        self.sync_gradients: Callable[[], bool] = lambda: True
        self.loss_listeners: list[Callable[[Any], None]] = []
        self.lr_listeners: list[Callable[[float], None]] = []
        self.optimizer_methods: dict[str, Callable[..., Any]] = {}
        self.state: dict[str, Any] = {}
        self.scalars: dict[str, Callable[[], Optional[float]]] = {}
        self.runtime: Any = None
        self.first_batch: list[Callable[[tuple, dict], None]] = []
        self.trial: Optional[Callable[[Any, tuple, dict], Any]] = None
        self.replan: Optional[Callable[[Any, Any], None]] = None
        self.planner: Optional[Callable[[PlanInput], Plan]] = None
        self.restore_checkpoint: Optional[Callable[[], Optional[int]]] = None

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for factory in self.forward_contexts:
                stack.enter_context(factory())
            yield


def train_only(wrapper: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Mark a model wrapper as needed for training only: eval-mode forwards bypass it, so they
    never wait for other processes (e.g. DDP's buffer broadcast)."""
    wrapper.train_only = True  # type: ignore[attr-defined]
    return wrapper


class Strategy(abc.ABC):
    """Base class of every distributed strategy.

    Subclasses set ``name`` (the ``DistributedStrategy`` switch) and optionally:

    * ``config``: its typed config class (``AmpConfig``, read as ``strategy.amp_configs``);
    * ``paddle_name``: the meta optimizer Paddle 2.2 runs for the switch (``"AMPOptimizer"``),
      listed by ``fleet._get_applied_meta_list()`` when the strategy applies, and whose switch
      ``fleet._final_strategy()`` turns off when it does not; ``paddle_graph_name``: Paddle's
      graph optimizer instead (``_get_applied_graph_list()``);
    * ``requires``: strategies that must apply with it (it also runs after them);
    * ``conflicts``: strategies it cannot be switched on beside, at any world size (declare
      the pair on one side; the planner checks both directions);
    * ``runs_after`` / ``runs_before``: strategies whose hooks must be installed before / after
      its own when both apply (the planner sorts by these relations, never by a number);
    * ``runs_last``: after every applied strategy that does not run last itself (options that
      act on the final optimizer, whichever strategy replaced or wrapped it);
    * ``implicit``: enabled without a switch, like data parallel;
    * ``replaces_plan``: when it applies, it is the plan's only applied strategy: it chooses
      the others itself (``auto``), which are listed as deferred to it;
    * ``shapes_model``: its ``apply`` changes the model in place (sharding swaps parameters for
      shards), so the fleet applies the plan as soon as the model is given to
      ``distributed_model``: an optimizer built from ``model.parameters()`` afterwards sees the
      changed parameters.
    * ``heal_fallback``: why a job using it cannot heal in place under ``fleetrun
      --fault_tolerance heal`` (state that only its rank holds dies with it, or collectives
      outside the healing ones); the job then restarts its whole group on a failure, saying so.
    """

    name: ClassVar[str]
    config: ClassVar[Optional[type]] = None
    paddle_name: ClassVar[str] = ""
    paddle_graph_name: ClassVar[str] = ""
    requires: ClassVar[tuple[type["Strategy"], ...]] = ()
    conflicts: ClassVar[tuple[type["Strategy"], ...]] = ()
    runs_after: ClassVar[tuple[type["Strategy"], ...]] = ()
    runs_before: ClassVar[tuple[type["Strategy"], ...]] = ()
    runs_last: ClassVar[bool] = False
    implicit: ClassVar[bool] = False
    replaces_plan: ClassVar[bool] = False
    shapes_model: ClassVar[bool] = False
    heal_fallback: ClassVar[str] = ""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy

    @classmethod
    def enabled(cls, strategy: Any) -> bool:
        """Whether the user switched it on (implicit strategies always are).

        Raises:
            RegistryError: the strategy object has no switch of this strategy's name (a
                misnamed strategy would otherwise never run, silently).
        """
        if cls.implicit:
            return True
        if not hasattr(strategy, cls.name):
            raise RegistryError(f"strategy {cls.name!r} ({cls.__module__}.{cls.__name__}) has no "
                                f"switch of that name on {type(strategy).__name__}")
        return bool(getattr(strategy, cls.name))

    @abc.abstractmethod
    def can_apply(self, plan_input: PlanInput) -> Verdict:
        """Pure: judge the plan input. Never communicates or mutates anything."""

    @abc.abstractmethod
    def apply(self, ctx: TrainingContext) -> None:
        """Install this strategy through the context's hook points."""

    def footprint(self, plan_input: PlanInput, expected: Any) -> Any:
        """Pure: the per-rank state bytes (a :class:`~fleetx.strategy.footprint.Footprint`)
        once this strategy applies, given ``expected`` from the strategies before it. Most
        strategies hold what plain training holds and return it unchanged; one that partitions
        or adds state (sharding) says how."""
        return expected


_REGISTRY: dict[str, type[Strategy]] = {}


def register(cls: type[Strategy]) -> type[Strategy]:
    """Class decorator: add a strategy to the registry. A second class under a taken name is
    refused."""
    name = getattr(cls, "name", None)
    if not name:
        raise RegistryError(f"{cls.__name__} has no name")
    if name in _REGISTRY and _REGISTRY[name] is not cls:
        raise RegistryError(f"strategy name {name!r} is already registered by "
                            f"{_REGISTRY[name].__module__}.{_REGISTRY[name].__name__}")
    _REGISTRY[name] = cls
    return cls


def unregister(cls: type[Strategy]) -> None:
    """Remove a registered strategy (a test that registered its own cleans up with it).

    Raises:
        RegistryError: ``cls`` is not the class registered under its name.
    """
    if _REGISTRY.get(getattr(cls, "name", None)) is not cls:
        raise RegistryError(f"{cls.__name__} is not registered")
    del _REGISTRY[cls.name]


_MODEL_TYPES: dict[type, Callable[..., Any]] = {}


def register_model_type(model_type: type, build: Callable[..., Any]) -> None:
    """Claim a model type for a module's own wrapper: ``fleet.distributed_model(model)`` of an
    instance returns ``build(model, strategy, context)`` instead of a ``DistributedModel``.

    ``strategy`` is the ``DistributedStrategy`` in force and ``context()`` returns the training
    context (built on first call, and rebuilt when the plan changes: call it each time). The
    model is planned as the job's model, so the plan's strategies reach it through the context
    (amp's autocast through ``forward_contexts``).

    Raises:
        RegistryError: the type is claimed already.
    """
    if model_type in _MODEL_TYPES:
        raise RegistryError(f"model type {model_type.__name__} is already claimed by "
                            f"{_MODEL_TYPES[model_type].__module__}")
    _MODEL_TYPES[model_type] = build


def model_builder(model: Any) -> Optional[Callable[..., Any]]:
    """The builder that claims ``model``'s type (or its nearest base), or None."""
    for base in type(model).__mro__:
        if base in _MODEL_TYPES:
            return _MODEL_TYPES[base]
    return None


def _edges(classes: list[type[Strategy]]) -> dict[str, set[str]]:
    """name -> names that must come before it, among ``classes`` only."""
    present = {c.name for c in classes}
    before: dict[str, set[str]] = {c.name: set() for c in classes}
    for cls in classes:
        if cls.runs_last:
            before[cls.name] |= {c.name for c in classes if not c.runs_last}
        ahead = {o.name for o in cls.runs_before}
        for other in cls.runs_after + tuple(r for r in cls.requires if r.name not in ahead):
            if other.name in present:
                before[cls.name].add(other.name)
        for other in cls.runs_before:
            if other.name in present:
                before[other.name].add(cls.name)
    return before


def _cycle(before: dict[str, set[str]]) -> list[str]:
    """One cycle of the (cyclic) graph, as a closed path of names."""
    path: list[str] = []
    seen: set[str] = set()

    def visit(name: str) -> Optional[list[str]]:
        if name in path:
            return path[path.index(name):] + [name]
        if name in seen:
            return None
        seen.add(name)
        path.append(name)
        for prev in sorted(before[name]):
            found = visit(prev)
            if found:
                return found
        path.pop()
        return None

    for start in sorted(before):
        found = visit(start)
        if found:
            return found[::-1]  # "a runs after b" edges point backwards: print in run order
    return []


def sort_strategies(classes) -> list[type[Strategy]]:
    """``classes`` in application order: every declared relation among them holds, and
    strategies no relation orders are taken by name (so the order is deterministic).

    Relations to classes not in ``classes`` are ignored: a strategy that does not apply installs
    nothing for another to come before or after. A ``runs_last`` strategy comes after every one
    that is not.

    Raises:
        OrderError: the relations form a cycle (the message names it, ``a -> b -> a``).
    """
    classes = list(classes)
    by_name = {c.name: c for c in classes}
    before = _edges(classes)
    ready = [n for n, prev in before.items() if not prev]
    heapq.heapify(ready)
    done: list[str] = []
    while ready:
        name = heapq.heappop(ready)
        done.append(name)
        for other, prev in before.items():
            if name in prev:
                prev.discard(name)
                if not prev:
                    heapq.heappush(ready, other)
    if len(done) < len(classes):
        cycle = _cycle(_edges(classes))
        raise OrderError("the strategies' runs_after / runs_before / requires / runs_last "
                         "relations form a cycle: " + " -> ".join(cycle) + " (each must run "
                         "after the one before it); remove one of these relations")
    return [by_name[n] for n in done]


def registered(name: Optional[str] = None):
    """All registered strategy classes in application order, or the one named ``name``.

    Raises:
        RegistryError: an unknown name. OrderError: the relations form a cycle.
    """
    if name is None:
        return sort_strategies(_REGISTRY.values())
    try:
        return _REGISTRY[name]
    except KeyError:
        raise RegistryError(f"unknown strategy {name!r}; known: "
                            f"{', '.join(sorted(_REGISTRY))}") from None

