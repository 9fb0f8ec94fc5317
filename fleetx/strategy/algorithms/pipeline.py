"""Pipeline parallelism's settings (``pipeline_configs``).

As in Paddle 2.2's dynamic graph, they apply whenever ``hybrid_configs['pp_degree'] > 1``: the
model is a ``fleet.meta_parallel.PipelineLayer`` (each process builds only its stage's layers)
and ``fleet.distributed_model`` returns a ``PipelineParallel`` whose ``train_batch`` cuts each
mini-batch into ``accumulate_steps`` micro-batches of ``micro_batch_size`` samples and runs them
``1F1B`` or ``FThenB`` (:mod:`fleetx.parallel.schedule`). The ``strategy.pipeline`` switch is the
static graph's and has no effect (declared in ``fields.py``).

This module claims ``PipelineLayer`` for that wrapper
(:func:`~fleetx.strategy.api.register_model_type`): the stage is planned as the job's model and
every forward runs in the training context's forward context, so ``amp`` reaches the pipeline
as it reaches any model (its autocast and op lists), without the pipeline reading its switch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Optional

from fleetx.comm.groups import default_timeout
from fleetx.parallel.hcg import get_hcg
from fleetx.parallel.pipeline import PipelineLayer
from fleetx.parallel.pipeline_parallel import PipelineParallel
from fleetx.strategy.api import TrainingContext, register_model_type
from fleetx.strategy.config import Config, option

__all__ = ["PipelineConfig", "pipeline_model"]


@dataclass
class PipelineConfig(Config):
    """``strategy.pipeline_configs``: micro-batching and schedule.

    ``micro_batch`` (the 2.0 name for the number of micro-batches) is accepted as an alias of
    ``accumulate_steps``.

    Example:
        >>> PipelineConfig(accumulate_steps=4).schedule_mode
        '1F1B'
    """

    section = "pipeline_configs"
    aliases = {"micro_batch": "accumulate_steps"}

    micro_batch_size: int = option(1, "Samples per micro-batch.", ge=1)
    accumulate_steps: int = option(1, "Micro-batches per mini-batch.", ge=1)
    schedule_mode: str = option(
        "1F1B", "Pipeline schedule: 1F1B (at most pp_degree micro-batches alive per stage) or "
        "FThenB (all forwards, then all backwards); F-then-B is an alias of FThenB.",
        choices=("1F1B", "FThenB", "F-then-B"))
    p2p_cache_shape: bool = option(
        True, "Send the tensor shapes between stages once per mini-batch (the first "
        "micro-batch's), not with every micro-batch.")


def pipeline_model(layers: PipelineLayer, strategy: Any,
                   forward_context: Optional[Callable[[], ContextManager]] = None
                   ) -> PipelineParallel:
    """``layers`` under the schedule of ``strategy.pipeline_configs``.

    Args:
        layers: this process's stage.
        strategy: the fleet's ``DistributedStrategy``.
        forward_context: returns the context every forward runs in: the training context's
            (amp's autocast and op lists, when amp applies); None runs them as they are.

    With ``dp_degree > 1`` the stage's gradients are averaged over the hybrid topology's
    data-parallel group in every ``train_batch``.
    """
    cfg = strategy.typed_config("pipeline")
    hcg = get_hcg()
    dp_group = (hcg.get_data_parallel_group()
                if hcg is not None and hcg.get_data_parallel_world_size() > 1 else None)
    return PipelineParallel(layers, micro_batch_size=cfg.micro_batch_size,
                            accumulate_steps=cfg.accumulate_steps,
                            schedule_mode=cfg.schedule_mode, p2p_cache_shape=cfg.p2p_cache_shape,
                            timeout=default_timeout(), dp_group=dp_group,
                            forward_context=forward_context)


def _build(layers: PipelineLayer, strategy: Any,
           context: Callable[[], TrainingContext]) -> PipelineParallel:
    """What ``fleet.distributed_model`` returns for a stage: forwards in the context's forward
    context, looked up at each forward (a re-plan replaces the context)."""
    return pipeline_model(layers, strategy, forward_context=lambda: context().forward_context())


register_model_type(PipelineLayer, _build)
