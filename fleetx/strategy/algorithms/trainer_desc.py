"""Trainer dumps and statistics (``strategy.trainer_desc_configs``).

In Paddle, parameter-server training over a dataset can dump the values of chosen tensors and
parameters to files while it runs and gather named statistics across workers. fleetx accepts and
checks these keys but does not act on them (declared ``no_effect``; the plan names them).
"""
from dataclasses import dataclass

from fleetx.strategy.config import Config, option

__all__ = ["TrainerDescConfig"]


@dataclass
class TrainerDescConfig(Config):
    """``strategy.trainer_desc_configs``: what to dump, and where.

    Example:
        >>> TrainerDescConfig(dump_fields=["click"]).dump_fields_path
        ''
    """

    section = "trainer_desc_configs"
    no_effect = "no trainer descriptor: nothing is dumped"

    dump_fields_path: str = option("", "Directory the dumps are written to.")
    dump_fields: list[str] = option([], "Tensors whose values are dumped per sample.")
    dump_param: list[str] = option([], "Parameters dumped after each batch.")
    stat_var_names: list[str] = option([], "Statistics gathered across workers.")
