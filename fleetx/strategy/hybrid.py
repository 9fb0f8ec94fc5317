"""Hybrid parallelism (``strategy.hybrid_configs``): a config only.

**No effect yet.** ``hybrid_configs`` is accepted and checked, so Paddle scripts and saved
strategies load, but nothing in fleetx acts on it: every process is a data-parallel rank, and
the plan names the keys when they are set. ``HybridConfig.no_effect`` is the one declaration to
change when hybrid parallelism is implemented.

What the settings mean in Paddle: the world is a grid of data x tensor(model) x pipeline x
sharding ranks whose degrees multiply to the number of processes (``dp_degree=-1``: what is
left). There is no on/off switch: in Paddle 2.2's dynamic graph the degrees alone turn it on.
"""
from dataclasses import dataclass

from fleetx.strategy.config import Config, option

__all__ = ["HybridConfig"]


@dataclass
class HybridConfig(Config):
    """``strategy.hybrid_configs``: the degrees of the process grid.

    Example:
        >>> HybridConfig(mp_degree=2).dp_degree
        -1
    """

    section = "hybrid_configs"
    no_effect = "hybrid parallelism is not implemented yet"

    dp_degree: int = option(-1, "Data parallel degree; -1 infers it from the world size.",
                            ge=1, also=(-1,))
    mp_degree: int = option(1, "Tensor (model) parallel degree.", ge=1)
    pp_degree: int = option(1, "Pipeline parallel degree.", ge=1)
    sharding_degree: int = option(1, "Sharding degree.", ge=1)
