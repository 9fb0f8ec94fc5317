"""Pipeline parallelism's settings (``pipeline_configs``).

As in Paddle 2.2's dynamic graph, they apply whenever ``hybrid_configs['pp_degree'] > 1``: the
model is a ``fleet.meta_parallel.PipelineLayer`` (each process builds only its stage's layers)
and ``fleet.distributed_model`` returns a ``PipelineParallel`` whose ``train_batch`` cuts each
mini-batch into ``accumulate_steps`` micro-batches of ``micro_batch_size`` samples and runs them
``1F1B`` or ``FThenB`` (:mod:`fleetx.parallel.schedule`). The ``strategy.pipeline`` switch is the
static graph's and has no effect (declared in ``fields.py``).
"""
from dataclasses import dataclass

from fleetx.strategy.config import Config, option

__all__ = ["PipelineConfig"]


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
