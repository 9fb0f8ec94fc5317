"""Hybrid parallelism (``strategy.hybrid_configs``): the degrees of the process grid.

``hybrid_configs`` is the source of truth for the degrees; the same degrees written in
``sharding_configs`` or ``tensor_parallel_configs`` fill its keys when they are unset
(:func:`fleetx.strategy.topology.resolve` holds the rule). ``dp_degree`` and
``sharding_degree`` act with ``strategy.sharding``;
``mp_degree`` and ``pp_degree`` have no effect: tensor and pipeline parallelism are not
implemented yet, and with sharding on a value other than 1 is refused.

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

    dp_degree: int = option(
        -1, "Data parallel degree: sharding groups replicated; -1 infers it from the world size.",
        ge=1, also=(-1,))
    mp_degree: int = option(
        1, "Tensor (model) parallel degree (refused with sharding on unless 1).", ge=1,
        no_effect="tensor parallelism is not implemented yet")
    pp_degree: int = option(
        1, "Pipeline parallel degree (refused with sharding on unless 1).", ge=1,
        no_effect="pipeline parallelism is not implemented yet")
    sharding_degree: int = option(
        1, "Ranks in one sharding group (needs strategy.sharding); fills from "
        "sharding_configs['sharding_degree'] when unset.", ge=1)
