"""Sharding, ZeRO-style partitioning of training state (``strategy.sharding``): a config only.

**No effect yet.** ``strategy.sharding`` and ``sharding_configs`` are accepted and checked, so
Paddle scripts and saved strategies load, but nothing in fleetx acts on them: every rank keeps
the whole optimizer state, and the plan names the switch and the keys when they are set.
``ShardingConfig.no_effect`` is the one declaration to change when sharding is implemented.

What the settings mean in Paddle: optimizer state, gradients and optionally parameters are split
over the ``sharding_degree`` ranks of a group; broadcasts are fused into segments cut every
``segment_broadcast_MB`` or at ``segment_anchors``; the other degrees combine it with data,
tensor and pipeline parallelism.
"""
from dataclasses import dataclass

from fleetx.strategy.config import Config, option

__all__ = ["ShardingConfig"]


@dataclass
class ShardingConfig(Config):
    """``strategy.sharding_configs``: group sizes, segmentation and offload.

    The 2.0 names ``fuse_broadcast_MB`` and ``sharding_group_size`` are accepted as aliases of
    ``segment_broadcast_MB`` and ``sharding_degree``.

    Example:
        >>> ShardingConfig(sharding_degree=2, hybrid_dp=True).dp_degree
        1
    """

    section = "sharding_configs"
    no_effect = "sharding is not implemented yet"
    aliases = {"fuse_broadcast_MB": "segment_broadcast_MB",
               "sharding_group_size": "sharding_degree"}

    sharding_segment_strategy: str = option(
        "segment_broadcast_MB", "How broadcasts are cut into segments.",
        choices=("segment_broadcast_MB", "segment_anchors"))
    segment_broadcast_MB: float = option(
        32.0, "Segment size in MB (segment_broadcast_MB strategy).", gt=0)
    segment_anchors: list[str] = option(
        [], "Tensor names that end a segment (segment_anchors strategy).")
    sharding_degree: int = option(8, "Ranks in one sharding group.", ge=1)
    mp_degree: int = option(1, "Tensor (model) parallel degree.", ge=1)
    dp_degree: int = option(1, "Data parallel degree outside the sharding groups.", ge=1)
    hybrid_dp: bool = option(
        False, "Add a data-parallel layer over several sharding groups.")
    gradient_merge_acc_step: int = option(
        1, "Micro-steps accumulated per optimizer step inside sharding.", ge=1)
    optimize_offload: bool = option(
        False, "Keep the optimizer state in host memory between steps.")
    pp_allreduce_in_optimize: bool = option(
        False, "With pipelining, all-reduce gradients in the optimize phase.")
    pp_degree: int = option(1, "Pipeline parallel degree.", ge=1)
    optimize_cast: bool = option(
        False, "Keep float32 master parameters and cast to float16 in the optimize phase.")
    _dp_as_optimizer_sharding: bool = option(
        False, "Experimental: treat the data-parallel group as the sharding group.")
