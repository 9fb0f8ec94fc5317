"""Pipeline parallelism (``strategy.pipeline``): a config only.

**No effect yet.** ``strategy.pipeline`` and ``pipeline_configs`` are accepted and checked, so
Paddle scripts and saved strategies load, but nothing in fleetx acts on them: the whole model
runs on every rank, and the plan names the switch and the keys when they are set.
``PipelineConfig.no_effect`` is the one declaration to change when pipelines are implemented.

What the settings mean in Paddle: layers are split into stages on different devices and each
mini-batch into ``accumulate_steps`` micro-batches of ``micro_batch_size`` samples, scheduled
``F-then-B`` or ``1F1B``.
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
    no_effect = "pipeline parallelism is not implemented yet"
    aliases = {"micro_batch": "accumulate_steps"}

    micro_batch_size: int = option(1, "Samples per micro-batch.", ge=1)
    accumulate_steps: int = option(1, "Micro-batches per mini-batch.", ge=1)
    schedule_mode: str = option("1F1B", "Pipeline schedule.", choices=("F-then-B", "1F1B"))
    p2p_cache_shape: bool = option(
        True, "Reuse the first micro-batch's tensor shapes for stage-to-stage transfers.")
