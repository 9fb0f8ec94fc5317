"""Tensor parallelism (``strategy.tensor_parallel``): a config only.

**No effect yet.** ``strategy.tensor_parallel`` and ``tensor_parallel_configs`` are accepted and
checked, so Paddle scripts and saved strategies load, but nothing in fleetx acts on them: no
weight is split, and the plan names the switch and the keys when they are set.
``TensorParallelConfig.no_effect`` is the one declaration to change when it is implemented.

What the settings mean in Paddle: weight matrices are split over ``tensor_parallel_degree``
ranks by columns or rows, slices initialised from streams seeded by ``tensor_init_seed``.
"""
from dataclasses import dataclass

from fleetx.strategy.config import Config, option

__all__ = ["TensorParallelConfig"]


@dataclass
class TensorParallelConfig(Config):
    """``strategy.tensor_parallel_configs``: the group size and initialisation seed.

    Example:
        >>> TensorParallelConfig(tensor_parallel_degree=2).tensor_init_seed
        -1
    """

    section = "tensor_parallel_configs"
    no_effect = "tensor parallelism is not implemented yet"

    tensor_parallel_degree: int = option(1, "Ranks a weight matrix is split across.", ge=1)
    tensor_init_seed: int = option(-1, "Seed for initialising the slices; -1 picks one at random.",
                                   ge=-1)
