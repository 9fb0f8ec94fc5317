"""What the planner reads and what it returns: pure data, printable, with no process behind it.

The inputs: :class:`WorldInfo` (where this process stands, built by the fleet from its role
maker), :class:`ModelInfo` and :class:`OptimizerInfo` (what the planner may know of the user's
objects without running them), gathered in a :class:`PlanInput`. A strategy's ``can_apply``
answers with a :class:`Verdict`; the planner collects one :class:`PlanEntry` per strategy into
a :class:`Plan`, whose ``str`` is the plan printed at start-up. All of these are part of the
strategy contract and are imported from :mod:`fleetx.strategy.api`.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from fleetx import env

__all__ = ["Mode", "WorldInfo", "ModelInfo", "OptimizerInfo", "PlanInput", "Verdict",
           "PlanEntry", "Plan"]


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
        is_heter_worker: this process is a heter worker (``rank`` is then ``world_size`` plus
            its index among the heter workers, as Paddle numbers them).
        heter_endpoints: ``ip:port`` of every heter worker, in index order.
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
    is_heter_worker: bool = False
    heter_endpoints: tuple[str, ...] = ()
    environ: Mapping[str, str] = field(default_factory=lambda: _contract_environ(),
                                       repr=False, compare=False, hash=False)


def _contract_environ() -> dict[str, str]:
    """The declared variables that are set, secrets included (held, never printed)."""
    return {name: env.get(name) for name in env.VARIABLES if env.is_set(name)}


@dataclass(frozen=True)
class ModelInfo:
    """What the planner needs to know about the model, extracted without running it."""

    param_names: tuple[str, ...] = ()
    param_numels: tuple[int, ...] = ()
    sparse_modules: tuple[str, ...] = ()  # qualified names of sparse embeddings
    module_names: tuple[str, ...] = ()  # qualified names of every sub-module (named_modules)
    param_bytes: tuple[int, ...] = ()  # bytes of each parameter (numel * element size)
    trainable: tuple[bool, ...] = ()  # whether each parameter requires a gradient
    # beside module_names: each module's class (FSDP2's wrapper class seen through), and its
    # container kind ("ModuleList", "ModuleDict", "Sequential" or ""), for the sharding units
    module_classes: tuple[str, ...] = ()
    containers: tuple[str, ...] = ()
    tied: tuple[tuple[str, ...], ...] = ()  # the names of each parameter known by several
    no_split: tuple[str, ...] = ()  # classes a module lists in its ``_no_split_modules`` (HF)

    @property
    def numel(self) -> int:
        return sum(self.param_numels)

    @classmethod
    def of(cls, model: Any) -> "ModelInfo":
        if model is None:
            return cls()
        names, numels, sparse, modules, sizes, trainable = [], [], [], [], [], []
        for name, p in model.named_parameters():
            names.append(name)
            numels.append(p.numel())
            sizes.append(p.numel() * p.element_size())
            trainable.append(p.requires_grad)
        for name, m in model.named_modules():
            modules.append(name)
            if getattr(m, "sparse", False) is True:
                sparse.append(name)
        return cls(tuple(names), tuple(numels), tuple(sparse), tuple(modules), tuple(sizes),
                   tuple(trainable), *_tree_facts(model))


def module_class_name(module: Any) -> str:
    """The class name a module was written as: ``fully_shard`` swaps a module's class for
    ``FSDP<cls>(FSDPModule, cls)``, and a name given by the user is the original's."""
    mro = type(module).__mro__
    return mro[2].__name__ if len(mro) > 2 and mro[1].__name__ == "FSDPModule" else mro[0].__name__


def _tree_facts(model: Any) -> tuple:
    """``module_classes``, ``containers``, ``tied`` and ``no_split`` of :class:`ModelInfo`."""
    from torch import nn  # the model is a torch module; plan.py itself stays torch-free

    classes, kinds, no_split = [], [], set()
    for _, m in model.named_modules():
        classes.append(module_class_name(m))
        kinds.append(next((k.__name__ for k in (nn.ModuleList, nn.ModuleDict, nn.Sequential)
                           if isinstance(m, k)), ""))
        no_split.update(getattr(m, "_no_split_modules", None) or ())
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    tied = tuple(tuple(n) for n in aliases.values() if len(n) > 1)
    return tuple(classes), tuple(kinds), tied, tuple(sorted(no_split))


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
    """Everything a ``can_apply`` may look at: the strategy, world, model and optimizer.

    ``planner`` is the function planning this input, ``fn(plan_input) -> Plan``:
    :func:`~fleetx.strategy.planner.make_plan` hands itself over here, so a strategy that weighs
    whole plans (``auto``) plans its candidates without importing the planner, which imports
    every strategy. It takes no part in comparisons or the ``repr``.
    """

    strategy: Any  # DistributedStrategy
    world: WorldInfo
    model: ModelInfo = ModelInfo()
    optimizer: OptimizerInfo = OptimizerInfo()
    planner: Optional[Callable[["PlanInput"], "Plan"]] = field(default=None, compare=False,
                                                               repr=False)


@dataclass(frozen=True)
class Verdict:
    """A strategy's judgement of a plan input.

    ``apply`` and ``reason``: apply it, or why not. ``warn``: a skip worth a warning (the user
    asked for it, but it is pointless here, e.g. DGC on one process). ``error``: the user asked for
    it and a precondition is unmet; the planner raises :class:`~fleetx.strategy.api.StrategyError`. ``notice``: not a
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
    #: expected state bytes per rank (a ``footprint.Footprint``); None when the model is unknown
    footprint: Any = None

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
        if self.footprint is not None:
            lines.append(f"  {self.footprint}")
        if w.mode is Mode.PS:  # the server-side update rules run on one of two backends
            from fleetx.ps import kernels
            lines.append(f"  parameter-server kernels: {kernels.describe()}")
        return "\n".join(lines)
