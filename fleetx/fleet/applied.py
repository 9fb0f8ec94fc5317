"""What the plan in force applied, in Paddle's vocabulary: ``fleet._final_strategy()``,
``fleet._get_applied_meta_list()`` and ``fleet._get_applied_graph_list()``.

Paddle's static ``minimize`` chains *meta optimizers* (one class per strategy switch) and records
the chain; scripts and tests written for Paddle read it back to check what ran. fleetx applies
strategies, not meta optimizers, so these functions translate the plan: the strategy with every
meta-optimizer switch that did not apply turned off, and the Paddle class name of each applied
strategy, in the order fleetx applies them. Each strategy class names its Paddle class
(``paddle_name``, or ``paddle_graph_name`` for data parallel's graph optimizer).
"""
from __future__ import annotations

import copy
from typing import Any

from fleetx.strategy.api import Plan, registered
from fleetx.strategy.planner import load_strategies

__all__ = ["final_strategy", "meta_list", "graph_list"]

# Switches of Paddle meta optimizers that fleetx has no strategy for (each declared without
# effect): they never apply, so the final strategy turns them off as it does any meta
# optimizer's switch that did not apply.
_SWITCHES_WITHOUT_STRATEGY = ("pipeline", "tensor_parallel", "without_graph_optimization", "asp")


def _strategies() -> dict[str, type]:
    """The registered strategy classes by name (the plan's names)."""
    load_strategies()
    return {cls.name: cls for cls in registered()}


def final_strategy(strategy: Any, plan: Plan) -> Any:
    """A copy of ``strategy`` with each meta-optimizer switch that the plan did not apply off.

    Args:
        strategy: the ``DistributedStrategy`` in force.
        plan: the plan built from it.
    """
    final = copy.deepcopy(strategy)
    applied = set(plan.applied)
    switches = [name for name, cls in _strategies().items() if cls.paddle_name]
    for name in switches + list(_SWITCHES_WITHOUT_STRATEGY):
        # ``parameter_server`` has no switch of its own (a_sync chooses its mode, not whether
        # it runs), so only real switches are turned off.
        if hasattr(final, name) and getattr(final, name) is True and name not in applied:
            setattr(final, name, False)
    return final


def meta_list(plan: Plan) -> list[str]:
    """Paddle's class names of the applied meta optimizers, in application order."""
    known = _strategies()
    return [known[name].paddle_name for name in plan.applied
            if name in known and known[name].paddle_name]


def graph_list(plan: Plan) -> list[str]:
    """Paddle's class names of the applied graph optimizers."""
    known = _strategies()
    return [known[name].paddle_graph_name for name in plan.applied
            if name in known and known[name].paddle_graph_name]
