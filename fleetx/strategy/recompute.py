"""Recompute, also called activation checkpointing (``strategy.recompute``): a config only.

**No effect yet.** ``strategy.recompute`` and ``recompute_configs`` are accepted and checked, so
Paddle scripts and saved strategies load, but nothing in fleetx acts on them: activations are
kept as in plain PyTorch, and the plan names the switch and the keys when they are set.
``RecomputeConfig.no_effect`` is the one declaration to change when recompute is implemented.

What the settings mean in Paddle: the network is cut at the named *checkpoints*; the forward
keeps only the checkpoint tensors and the backward recomputes each segment from its checkpoint;
with offload the checkpoints also move to host memory, which needs them to share one shape.
"""
from dataclasses import dataclass

from fleetx.strategy.config import Config, option

__all__ = ["RecomputeConfig"]


@dataclass
class RecomputeConfig(Config):
    """``strategy.recompute_configs``: where to cut the network, and offload.

    Example:
        >>> RecomputeConfig(checkpoints=["blocks.0", "blocks.1"]).enable_offload
        False
    """

    section = "recompute_configs"
    no_effect = "recompute is not implemented yet"

    checkpoints: list[str] = option(
        [], "Names of the checkpoints (the segment boundaries); empty disables recompute.")
    enable_offload: bool = option(False, "Also move the checkpoints to host memory.")
    checkpoint_shape: list[int] = option(
        [], "The common shape of all checkpoints; needed only with offload.", ge=1)
