"""Tensor parallelism's settings (``strategy.tensor_parallel_configs``).

``tensor_parallel_degree`` fills ``hybrid_configs['mp_degree']`` when that is unset
(:func:`fleetx.strategy.topology.resolve`; two different values are an error naming both), and
``tensor_init_seed`` seeds the model-parallel random streams that ``fleet.init`` sets up when
the model-parallel degree is above 1 (:func:`init_seed`). As in Paddle 2.2's dynamic graph no
switch is needed: ``strategy.tensor_parallel`` itself is the static-graph switch.

With ``mp_degree`` above 1, :class:`TensorParallelPlanStrategy` splits a model that carries its
own tensor-parallel plan (a Hugging Face model's ``_tp_plan``) when it is given to
``fleet.distributed_model``: :func:`fleetx.parallel.tp_plan.parallelize` over the topology's
model-parallel group, in place, before data parallel wraps it. A model without a plan is used
as it is (built from ``fleet.meta_parallel`` layers, or split by ``parallelize`` with a plan of
the user's). A fleetx extension: Paddle has no model plans.

What the settings mean in Paddle: weight matrices are split over ``tensor_parallel_degree``
ranks by columns or rows, slices initialised from streams seeded by ``tensor_init_seed``.
"""
import warnings
from typing import Any, Optional

from dataclasses import dataclass

from fleetx.strategy.api import (Mode, PlanInput, Strategy, StrategyError, TrainingContext,
                                 Verdict, register)
from fleetx.strategy.config import Config, option
from fleetx.strategy.topology import resolve

__all__ = ["TensorParallelConfig", "TensorParallelPlanStrategy", "init_seed"]


@dataclass
class TensorParallelConfig(Config):
    """``strategy.tensor_parallel_configs``: the group size and initialisation seed.

    Example:
        >>> TensorParallelConfig(tensor_parallel_degree=2).tensor_init_seed
        -1
    """

    section = "tensor_parallel_configs"

    tensor_parallel_degree: int = option(1, "Ranks a weight matrix is split across.", ge=1)
    tensor_init_seed: int = option(
        -1, "Seed of the model-parallel random streams (with mp_degree > 1): the global stream "
        "gets it on every rank, the 'model_parallel_rng' stream a seed derived from it per "
        "model-parallel rank; -1 draws one on rank 0 and sends it to every rank.", ge=-1)


def init_seed(strategy: Any, mp_degree: int) -> Optional[int]:
    """The seed ``fleet.init`` gives the model-parallel streams, or None when ``mp_degree`` is 1
    (nothing is seeded then, as in Paddle); ``-1`` means "draw one".

    Args:
        strategy: a :class:`~fleetx.strategy.distributed_strategy.DistributedStrategy`.
        mp_degree: the resolved model-parallel degree.
    """
    if mp_degree <= 1:
        return None
    return strategy.typed_config("tensor_parallel").tensor_init_seed


def _mp_degree(strategy: Any, world_size: int) -> int:
    try:
        return resolve(strategy, world_size).mp_degree
    except StrategyError:
        return 1  # the topology's own error is reported where the world is built


@register
class TensorParallelPlanStrategy(Strategy):
    """Apply the model's own tensor-parallel plan when ``mp_degree`` is above 1."""

    name = "tensor_parallel_plan"
    heal_fallback = ("each rank holds the only copy of its tensor-parallel shards, which die with "
                     "it")
    implicit = True
    shapes_model = True

    def can_apply(self, plan_input: PlanInput) -> Verdict:
        world = plan_input.world
        if world.mode is not Mode.COLLECTIVE:
            return Verdict.skip("parameter-server mode")
        degree = _mp_degree(plan_input.strategy, world.world_size)
        if degree <= 1:
            return Verdict.skip("mp_degree=1: nothing is split")
        return Verdict.ok(f"mp_degree={degree}: the model's own plan (_tp_plan) split over the "
                          f"model-parallel group, when it carries one")

    def apply(self, ctx: TrainingContext) -> None:
        """Split ``ctx.model`` by its plan, in place (once; a re-plan finds it split).

        Raises:
            StrategyError: the optimizer was built over the unsplit parameters.
            PlanError: the plan cannot apply (naming the layer and the numbers).
        """
        from fleetx.parallel.layers import sharded_parameters
        from fleetx.parallel.tp_plan import model_plan, parallelize
        model = ctx.model
        if model is None or model_plan(model) is None:
            if model is not None and not sharded_parameters(model):
                warnings.warn(f"mp_degree > 1 but {type(model).__name__} carries no "
                              f"tensor-parallel plan (_tp_plan) and has no fleet.meta_parallel "
                              f"layers: every model-parallel rank holds the whole model; split "
                              f"it with fleet.meta_parallel.parallelize(model, plan)",
                              stacklevel=2)
            return
        parallelize(model)
        _check_optimizer(ctx)


def _check_optimizer(ctx: TrainingContext) -> None:
    if ctx.optimizer is None:
        return
    mine = {id(p) for p in ctx.model.parameters()}
    for group in ctx.optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in mine:
                raise StrategyError(
                    f"tensor_parallel_plan: the {type(ctx.optimizer).__name__} holds a parameter "
                    f"of shape {tuple(p.shape)} that is not one of the split model's; "
                    f"fleet.distributed_model replaces the planned layers by their shards, so "
                    f"build the optimizer from model.parameters() after it")
