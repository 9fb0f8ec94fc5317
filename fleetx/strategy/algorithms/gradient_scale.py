"""Gradient scaling across data-parallel workers (``strategy.gradient_scale_configs``).

In Paddle each worker's loss gradient is scaled before the gradients are summed across workers:
by ``1/world_size`` (``avg``, the mean gradient), not at all (``sum``), or left to the user's own
scaling (``customized``). fleetx always averages (``avg``, the default); the other values are
accepted without effect and named in the plan.
"""
from dataclasses import dataclass

from fleetx.strategy.config import Config, option

__all__ = ["GradientScaleConfig"]


@dataclass
class GradientScaleConfig(Config):
    """``strategy.gradient_scale_configs``: how gradients are scaled before summation.

    Example:
        >>> GradientScaleConfig().scale_strategy
        'avg'
    """

    section = "gradient_scale_configs"

    scale_strategy: str = option("avg", "Loss-gradient scaling across workers.",
                                 choices=("avg", "sum", "customized"),
                                 no_effect="gradients are always averaged over workers")
