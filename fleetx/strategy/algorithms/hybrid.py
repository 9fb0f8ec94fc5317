"""Hybrid parallelism (``strategy.hybrid_configs``): the degrees of the process grid.

``hybrid_configs`` is the source of truth for the degrees; the same degrees written in
``sharding_configs`` or ``tensor_parallel_configs`` fill its keys when they are unset
(:func:`fleetx.strategy.topology.resolve` holds the rule). ``dp_degree`` and
``sharding_degree`` act with ``strategy.sharding``. ``mp_degree`` and ``pp_degree`` need no
switch: ``fleet.init`` builds the model-parallel and pipeline groups of the hybrid communicate
group (``fleet.get_hybrid_communicate_group()``) from them, and seeds the model-parallel random
streams when ``mp_degree > 1``; the layers of ``fleet.meta_parallel`` split over those groups.
With sharding on, a tensor or pipeline degree other than 1 is refused.

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
        -1, "Data parallel degree: replicas of the model; -1 infers it from the world size.",
        ge=1, also=(-1,))
    mp_degree: int = option(
        1, "Tensor (model) parallel degree: ranks per model-parallel group (consecutive ranks); "
        "fills from tensor_parallel_configs['tensor_parallel_degree'] when unset; refused with "
        "sharding on unless 1.", ge=1)
    pp_degree: int = option(
        1, "Pipeline parallel degree: stages per pipeline group; refused with sharding on "
        "unless 1.", ge=1)
    sharding_degree: int = option(
        1, "Ranks in one sharding group (needs strategy.sharding); fills from "
        "sharding_configs['sharding_degree'] when unset.", ge=1)
