"""Decide, then do: turn a strategy and a world into a :class:`~fleetx.strategy.api.Plan`.

:func:`make_plan` is a pure function: it asks every registered strategy for its verdict on the
same :class:`~fleetx.strategy.api.PlanInput`, checks the declared ``conflicts`` between the ones
switched on and the ``requires`` of the ones that apply, sorts the applied ones by their declared
``runs_after`` / ``runs_before`` relations and returns the plan with a reason for every strategy. It
never communicates, so ``fleet.explain()`` and ``fleetrun --dry-run`` can show it up front and
unit tests can call it with no processes.
"""
from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from typing import Any, Optional, Sequence

import fleetx.strategy.algorithms
from fleetx.strategy.api import (Mode, ModelInfo, OptimizerInfo, Plan, PlanEntry, PlanInput,
                                 StrategyError, WorldInfo, registered, sort_strategies)
from fleetx.strategy.footprint import Footprint

__all__ = ["make_plan", "plan_for", "load_strategies"]


def load_strategies() -> None:
    """Import every module of :mod:`fleetx.strategy.algorithms`; each registers its
    ``Strategy`` class (and claims the model types it wraps).

    Adding a strategy therefore touches only its own module (and its ``DistributedStrategy``
    field): nothing here lists them. A strategy defined elsewhere is planned once its module
    is imported (``@register`` runs then).
    """
    for info in pkgutil.iter_modules(fleetx.strategy.algorithms.__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"fleetx.strategy.algorithms.{info.name}")


def make_plan(plan_input: PlanInput, strategies: Optional[Sequence[type]] = None) -> Plan:
    """The ordered strategies to apply to ``plan_input`` and the reason for each one not applied.

    ``strategies`` defaults to every registered strategy. The applied ones are put in the order
    their declared relations give (:func:`~fleetx.strategy.api.sort_strategies`); the others
    follow in the same order over all candidates.

    Conflicts are judged between the strategies the user switched on, whether or not they apply
    at this world size, so a one-process run fails as the same job on N processes would.

    Raises:
        StrategyError: an enabled strategy's precondition is unmet, two enabled strategies
            conflict, or an applicable one misses a requirement. The message names every such
            strategy, why, and the fix.
        OrderError: the declared relations form a cycle.
    """
    if strategies is None:
        load_strategies()
    if plan_input.planner is None:  # what a strategy weighing other plans plans them with
        plan_input = dataclasses.replace(plan_input, planner=make_plan)
    candidates = sort_strategies(registered() if strategies is None else strategies)
    entries: dict[str, PlanEntry] = {}
    errors: list[str] = []
    for cls in candidates:
        if not cls.enabled(plan_input.strategy):
            entries[cls.name] = PlanEntry(cls.name, False, "off", enabled=False)
            continue
        verdict = cls(plan_input.strategy).can_apply(plan_input)
        if verdict.error:
            errors.append(f"{cls.name}: {verdict.reason}")
        entries[cls.name] = PlanEntry(cls.name, verdict.apply, verdict.reason, warn=verdict.warn,
                                     notice=verdict.notice)
    errors += _conflicts(candidates, entries)
    if errors:
        raise StrategyError("the distributed strategy cannot run as configured:\n  "
                            + "\n  ".join(errors))
    _defer(candidates, entries)
    applied = sort_strategies(c for c in candidates if entries[c.name].applied)
    rest = [entries[c.name] for c in candidates if not entries[c.name].applied]
    return Plan(plan_input.world, tuple(entries[c.name] for c in applied) + tuple(rest),
                _footprint(plan_input, applied))


def _footprint(plan_input: PlanInput, applied: Sequence[type]) -> Optional[Footprint]:
    """Expected state bytes per rank: a full copy, changed by each applied strategy in order;
    None before the model is known, and in parameter-server mode (the servers hold the
    tables)."""
    if not plan_input.model.param_names or plan_input.world.mode is Mode.PS:
        return None
    expected = Footprint.of(plan_input.model, plan_input.optimizer)
    for cls in applied:
        expected = cls(plan_input.strategy).footprint(plan_input, expected)
    return expected


def _defer(candidates: Sequence[type], entries: dict[str, PlanEntry]) -> None:
    """When a strategy that ``replaces_plan`` applies, the other applicable ones wait for its
    choice: they are listed as not applied, naming it."""
    deciders = [c for c in candidates if c.replaces_plan and entries[c.name].applied]
    if not deciders:
        return
    decider = deciders[0].name
    for cls in candidates:
        entry = entries[cls.name]
        if entry.applied and cls.name != decider:
            entries[cls.name] = PlanEntry(cls.name, False, f"deferred: {decider} chooses the plan "
                                          f"at the first training forward",
                                          enabled=entry.enabled)


def _conflicts(candidates: Sequence[type], entries: dict[str, PlanEntry]) -> list[str]:
    """Declared conflicts between switched-on strategies, and unmet requirements of applied
    ones, in words."""
    errors = []
    by_class = {c: entries[c.name] for c in candidates}
    for cls in candidates:
        entry = by_class[cls]
        if entry.applied:
            for need in cls.requires:
                if need in by_class and not by_class[need].applied:
                    errors.append(f"{cls.name}: requires {need.name}, which does not apply here "
                                  f"(set strategy.{need.name} = True)")
        if not entry.enabled or cls.implicit:
            continue
        for other in cls.conflicts:
            if other in by_class and by_class[other].enabled and not other.implicit:
                errors.append(f"{cls.name}: cannot be combined with {other.name} (at any "
                              f"number of processes); switch one of them off: "
                              f"strategy.{cls.name} = False or strategy.{other.name} = False")
    return errors


def plan_for(strategy: Any, world: WorldInfo, model: Optional[Any] = None,
             optimizer: Optional[Any] = None) -> Plan:
    """:func:`make_plan` for live objects: extracts the model and optimizer facts first."""
    return make_plan(PlanInput(strategy, world, ModelInfo.of(model), OptimizerInfo.of(optimizer)))
