"""The strategy contract: what a distributed strategy is, how the planner judges it, and the
training context it changes.

A *strategy* is one algorithm a user switches on through :class:`DistributedStrategy`
(``strategy.amp = True``...). Each lives in its own module as a :class:`Strategy` subclass
registered with :func:`register`. It declares

* ``name``: the ``DistributedStrategy`` switch it answers to,
* ``requires`` / ``conflicts``: other strategy classes it needs or cannot run beside,
* ``runs_after`` / ``runs_before``: strategies that, when both apply, must install their hooks
  before / after it (a strategy also runs after what it ``requires``, unless it says
  ``runs_before`` of it),
* ``can_apply(world)``: a *pure* judgement (:class:`Verdict`) from the :class:`PlanInput`,
* ``apply(ctx)``: the change it makes, only through the hook points of :class:`TrainingContext`.

The planner (``planner.py``) turns a strategy object and a world into a :class:`Plan` without
running anything; the fleet engine then calls ``apply`` on each planned strategy in order. The
order comes from the declared relations alone (:func:`sort_strategies`: a topological sort,
ties broken by name); a cycle is an :class:`OrderError` naming it.
"""
from __future__ import annotations

import abc
import contextlib
import enum
import heapq
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, ContextManager, Iterator, Mapping, Optional

from fleetx import env

__all__ = [
    "Mode", "WorldInfo", "ModelInfo", "OptimizerInfo", "PlanInput", "Verdict", "PlanEntry",
    "Plan", "Strategy", "StrategyError", "TrainingContext", "register", "registered",
    "RegistryError", "OrderError", "train_only", "sort_strategies",
]


class StrategyError(ValueError):
    """A strategy the user enabled cannot run here (its message names the strategy and why)."""


class RegistryError(KeyError):
    """A strategy name is registered twice, or an unknown name is looked up."""


class OrderError(RegistryError):
    """The declared ``runs_after`` / ``runs_before`` / ``requires`` relations form a cycle."""


class Mode(str, enum.Enum):
    """The architecture a job runs in."""

    COLLECTIVE = "collective"
    PS = "ps"


@dataclass(frozen=True)
class WorldInfo:
    """Where this process stands. Pure data; built by the fleet from its role maker.

    Attributes:
        rank: global rank among workers.
        world_size: number of workers.
        local_rank / local_world_size: rank and process count on this node.
        nnodes: number of nodes holding workers.
        mode: collective or parameter server.
        is_server: this process is a parameter server (``rank`` is then its server index).
        server_num: number of parameter servers (0 in collective mode).
        device: ``"cpu"`` or ``"cuda"``.
        server_endpoints: ``ip:port`` of every parameter server, in server-index order.
        environ: the launcher contract's variables (``fleetx.env``) that are set, read when the
            world is made; strategies take settings from here, never from the process
            environment in ``apply``. Left out of ``repr`` (it may hold a secret) and of
            comparisons.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    nnodes: int = 1
    mode: Mode = Mode.COLLECTIVE
    is_server: bool = False
    server_num: int = 0
    device: str = "cpu"
    server_endpoints: tuple[str, ...] = ()
    environ: Mapping[str, str] = field(default_factory=lambda: _contract_environ(),
                                       repr=False, compare=False, hash=False)


def _contract_environ() -> dict[str, str]:
    """The declared variables that are set, secrets included (held, never printed)."""
    return {name: env.get(name) for name in env.VARIABLES if env.get(name) is not None}


@dataclass(frozen=True)
class ModelInfo:
    """What the planner needs to know about the model, extracted without running it."""

    param_names: tuple[str, ...] = ()
    param_numels: tuple[int, ...] = ()
    sparse_modules: tuple[str, ...] = ()  # qualified names of sparse embeddings

    @property
    def numel(self) -> int:
        return sum(self.param_numels)

    @classmethod
    def of(cls, model: Any) -> "ModelInfo":
        if model is None:
            return cls()
        names, numels, sparse = [], [], []
        for name, p in model.named_parameters():
            names.append(name)
            numels.append(p.numel())
        for name, m in model.named_modules():
            if getattr(m, "sparse", False) is True:
                sparse.append(name)
        return cls(tuple(names), tuple(numels), tuple(sparse))


@dataclass(frozen=True)
class OptimizerInfo:
    """The user's optimizer as the planner sees it: its class name and first group's options."""

    class_name: str = ""
    defaults: tuple[tuple[str, Any], ...] = ()

    def get(self, key: str, default: Any = None) -> Any:
        return dict(self.defaults).get(key, default)

    @classmethod
    def of(cls, optimizer: Any) -> "OptimizerInfo":
        if optimizer is None:
            return cls()
        group = optimizer.param_groups[0] if getattr(optimizer, "param_groups", None) else {}
        items = tuple((k, v) for k, v in group.items() if k != "params"
                      and isinstance(v, (int, float, bool, str, tuple, type(None))))
        return cls(type(optimizer).__name__, items)


@dataclass(frozen=True)
class PlanInput:
    """Everything a ``can_apply`` may look at: the strategy, world, model and optimizer."""

    strategy: Any  # DistributedStrategy
    world: WorldInfo
    model: ModelInfo = ModelInfo()
    optimizer: OptimizerInfo = OptimizerInfo()


@dataclass(frozen=True)
class Verdict:
    """A strategy's judgement of a plan input.

    ``apply`` and ``reason``: apply it, or why not. ``warn``: a skip worth a warning (the user
    asked for it, but it is pointless here, e.g. DGC on one process). ``error``: the user asked for
    it and a precondition is unmet; the planner raises :class:`StrategyError`. ``notice``: not a
    strategy but a warning about the settings (values without effect, a config without its
    switch): shown as ``WARNING``, never as a skipped strategy.
    """

    apply: bool
    reason: str
    warn: bool = False
    error: bool = False
    notice: bool = False

    @classmethod
    def ok(cls, reason: str = "") -> "Verdict":
        return cls(True, reason)

    @classmethod
    def skip(cls, reason: str, warn: bool = False) -> "Verdict":
        return cls(False, reason, warn=warn)

    @classmethod
    def fail(cls, reason: str) -> "Verdict":
        return cls(False, reason, error=True)

    @classmethod
    def warning(cls, reason: str) -> "Verdict":
        """A notice about the settings, warned about; nothing is skipped."""
        return cls(False, reason, warn=True, notice=True)


@dataclass(frozen=True)
class PlanEntry:
    """One line of a plan: a strategy, whether it applies, and why."""

    name: str
    applied: bool
    reason: str
    warn: bool = False
    enabled: bool = True  # the user switched it on (or it is implicit, like data parallel)
    notice: bool = False  # a warning about the settings, not a strategy

    @property
    def warning_text(self) -> str:
        """The warning this entry raises: a notice says its reason, a strategy its skip."""
        return self.reason if self.notice else f"{self.name} skipped: {self.reason}"


@dataclass(frozen=True)
class Plan:
    """The ordered strategies to apply, and the reason for every one that is not applied."""

    world: WorldInfo
    entries: tuple[PlanEntry, ...]

    @property
    def applied(self) -> tuple[str, ...]:
        return tuple(e.name for e in self.entries if e.applied)

    @property
    def warnings(self) -> tuple[PlanEntry, ...]:
        return tuple(e for e in self.entries if e.warn)

    def __contains__(self, name: str) -> bool:
        return name in self.applied

    def __str__(self) -> str:
        w = self.world
        lines = [f"fleetx plan: mode={w.mode.value} world_size={w.world_size} "
                 f"nnodes={w.nnodes} device={w.device}"]
        order = 0
        for e in self.entries:
            if e.applied:
                order += 1
                lines.append(f"  {order}. {e.name:<26} applied   {e.reason}".rstrip())
        for e in self.entries:
            if not e.applied and (e.enabled or e.warn):
                tag = "WARNING" if e.notice else "WARNING skipped" if e.warn else "skipped"
                lines.append(f"  -  {e.name:<26} {tag}   {e.reason}".rstrip())
        if not self.applied:
            lines.append("  (no strategy applies: plain local training)")
        if w.mode is Mode.PS:  # the server-side update rules run on one of two backends
            from fleetx.ps import kernels
            lines.append(f"  parameter-server kernels: {kernels.describe()}")
        return "\n".join(lines)


class TrainingContext:
    """The seams through which strategies change training. The engine owns one per job.

    Strategies never reach into the engine; they add to these hook points:

    * ``model``: the user's module (read-only for strategies; None until distributed_model).
    * ``optimizer``: the inner torch optimizer (a strategy may replace it, e.g. LARS).
    * ``ddp_options``: keyword arguments for ``DistributedDataParallel`` (bucket size...).
    * ``model_wrappers``: ``fn(module) -> module`` applied in order when the model is built;
      a wrapper marked with :func:`train_only` (gradient synchronisation) is skipped in eval mode.
    * ``comm_hooks``: ``(state, hook)`` pairs composed into the one DDP comm hook.
    * ``forward_contexts``: context-manager factories entered around every forward.
    * ``backward``: ``fn(loss) -> None`` that runs the backward pass. Strategies wrap the one in
      place (``lambda loss: prev(loss * scale)``) so that several can change it.
    * ``step_guards``: ``fn() -> bool`` run before ``optimizer.step``; any ``False`` skips it.
      They run in plan order and stop at the first ``False``, so a guard only runs on steps the
      earlier ones allowed (an accumulation-boundary check placed before an overflow check).
    * ``after_step``: ``fn() -> None`` run after every (taken or skipped) optimizer step.
    * ``zero_grad_guards``: ``fn() -> bool`` run by ``zero_grad``; any ``False`` keeps the
      gradients (they are still being accumulated).
    * ``sync_gradients``: ``fn() -> bool``; ``False`` runs the next backward under ``no_sync``.
      Strategies wrap the one in place (``prev() and mine()``) rather than replace it.
    * ``loss_listeners``: ``fn(loss) -> None`` told the loss of every backward run through the
      optimizer wrapper (``minimize`` / ``backward``), before the backward runs.
    * ``lr_listeners``: ``fn(lr) -> None`` told when the user sets a new learning rate.
    * ``optimizer_methods``: extra methods of the optimizer wrapper, by name (Paddle's
      ``get_loss_scaling`` for example).
    * ``state``: per-strategy state, keyed by strategy name (saved with the optimizer).
    * ``runtime``: an object serving ``init_worker`` / ``init_server`` / ``run_server`` /
      ``stop_worker`` / ``save_persistables`` (the parameter-server strategy installs one).
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
        self.step_guards: list[Callable[[], bool]] = []
        self.after_step: list[Callable[[], None]] = []
        self.zero_grad_guards: list[Callable[[], bool]] = []
        self.sync_gradients: Callable[[], bool] = lambda: True
        self.loss_listeners: list[Callable[[Any], None]] = []
        self.lr_listeners: list[Callable[[float], None]] = []
        self.optimizer_methods: dict[str, Callable[..., Any]] = {}
        self.state: dict[str, Any] = {}
        self.runtime: Any = None

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

    * ``requires``: strategies that must apply with it (it also runs after them);
    * ``conflicts``: strategies it cannot be switched on beside, at any world size (declare
      the pair on one side; the planner checks both directions);
    * ``runs_after`` / ``runs_before``: strategies whose hooks must be installed before / after
      its own when both apply (the planner sorts by these relations, never by a number);
    * ``implicit``: enabled without a switch, like data parallel.
    """

    name: ClassVar[str]
    requires: ClassVar[tuple[type["Strategy"], ...]] = ()
    conflicts: ClassVar[tuple[type["Strategy"], ...]] = ()
    runs_after: ClassVar[tuple[type["Strategy"], ...]] = ()
    runs_before: ClassVar[tuple[type["Strategy"], ...]] = ()
    implicit: ClassVar[bool] = False

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


def _edges(classes: list[type[Strategy]]) -> dict[str, set[str]]:
    """name -> names that must come before it, among ``classes`` only."""
    present = {c.name for c in classes}
    before: dict[str, set[str]] = {c.name: set() for c in classes}
    for cls in classes:
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
    nothing for another to come before or after.

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
        raise OrderError("the strategies' runs_after / runs_before / requires relations form a "
                         "cycle: " + " -> ".join(cycle) + " (each must run after the one "
                         "before it); remove one of these relations")
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

