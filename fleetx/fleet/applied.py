"""What the plan in force applied, in Paddle's vocabulary: ``fleet._final_strategy()``,
``fleet._get_applied_meta_list()`` and ``fleet._get_applied_graph_list()``.

Paddle's static ``minimize`` chains *meta optimizers* (one class per strategy switch) and records
the chain; scripts and tests written for Paddle read it back to check what ran. fleetx applies
strategies, not meta optimizers, so these functions translate the plan: the strategy with every
meta-optimizer switch that did not apply turned off, and the Paddle class name of each applied
strategy, in the order fleetx applies them.
"""
from __future__ import annotations

import copy
from typing import Any

from fleetx.strategy.api import Plan

__all__ = ["META_OPTIMIZERS", "GRAPH_OPTIMIZERS", "final_strategy", "meta_list", "graph_list"]

#: plan name -> Paddle 2.2 meta-optimizer class (python/paddle/distributed/fleet/meta_optimizers).
META_OPTIMIZERS = {
    "amp": "AMPOptimizer",
    "recompute": "RecomputeOptimizer",
    "gradient_merge": "GradientMergeOptimizer",
    "lars": "LarsOptimizer",
    "lamb": "LambOptimizer",
    "dgc": "DGCOptimizer",
    "localsgd": "LocalSGDOptimizer",
    "adaptive_localsgd": "AdaptiveLocalSGDOptimizer",
    "fp16_allreduce": "FP16AllReduceOptimizer",
    "pipeline": "PipelineOptimizer",
    "sharding": "ShardingOptimizer",
    "tensor_parallel": "TensorParallelOptimizer",
    "without_graph_optimization": "RawProgramOptimizer",
    "asp": "ASPOptimizer",
    "parameter_server": "ParameterServerOptimizer",
}

#: plan name -> Paddle's graph optimizer: data parallel is its GraphExecutionOptimizer.
GRAPH_OPTIMIZERS = {"data_parallel": "GraphExecutionOptimizer"}


def final_strategy(strategy: Any, plan: Plan) -> Any:
    """A copy of ``strategy`` with each meta-optimizer switch that the plan did not apply off.

    Args:
        strategy: the ``DistributedStrategy`` in force.
        plan: the plan built from it.
    """
    final = copy.deepcopy(strategy)
    applied = set(plan.applied)
    for name in META_OPTIMIZERS:
        # ``parameter_server`` has no switch of its own (a_sync chooses its mode, not whether
        # it runs), so only real switches are turned off.
        if hasattr(final, name) and getattr(final, name) is True and name not in applied:
            setattr(final, name, False)
    return final


def meta_list(plan: Plan) -> list[str]:
    """Paddle's class names of the applied meta optimizers, in application order."""
    return [META_OPTIMIZERS[name] for name in plan.applied if name in META_OPTIMIZERS]


def graph_list(plan: Plan) -> list[str]:
    """Paddle's class names of the applied graph optimizers."""
    return [GRAPH_OPTIMIZERS[name] for name in plan.applied if name in GRAPH_OPTIMIZERS]
