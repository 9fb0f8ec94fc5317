"""Tensor parallelism's settings (``strategy.tensor_parallel_configs``).

``tensor_parallel_degree`` fills ``hybrid_configs['mp_degree']`` when that is unset
(:func:`fleetx.strategy.topology.resolve`; two different values are an error naming both), and
``tensor_init_seed`` seeds the model-parallel random streams that ``fleet.init`` sets up when
the model-parallel degree is above 1 (:func:`init_seed`). As in Paddle 2.2's dynamic graph no
switch is needed: ``strategy.tensor_parallel`` itself is the static-graph switch.

What the settings mean in Paddle: weight matrices are split over ``tensor_parallel_degree``
ranks by columns or rows, slices initialised from streams seeded by ``tensor_init_seed``.
"""
from typing import Any, Optional

from dataclasses import dataclass

from fleetx.strategy.config import Config, option

__all__ = ["TensorParallelConfig", "init_seed"]


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
