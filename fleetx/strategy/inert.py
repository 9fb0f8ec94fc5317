"""Switches fleetx accepts but does not act on, named in the plan instead of ignored silently.

Some of Paddle's fields describe machinery PyTorch does not have (static-graph passes, cuDNN
workspace limits, fusion by TFLOPS) or features fleetx does not offer yet (recompute, pipeline,
sharding, tensor parallel, strict auto mode). A script written for Paddle may set them; rejecting
it would break the script, and ignoring them silently would mislead. So when any of them differs
from its default, the plan carries one warning listing them.
"""
from __future__ import annotations

from typing import Any

from fleetx.strategy.api import PlanInput, Strategy, TrainingContext, Verdict, register

__all__ = ["InertSwitches", "INERT"]

#: field -> why it has no effect
INERT = {
    "recompute": "not available yet",
    "pipeline": "not available yet",
    "sharding": "not available yet",
    "tensor_parallel": "not available yet",
    "asp": "not available",
    "auto": "strict auto mode is not implemented",
    "semi_auto": "no auto-parallel planner",
    "elastic": "elastic jobs come from fleetrun --nnodes MIN:MAX",
    "sync_nccl_allreduce": "DDP always synchronises its gradient buckets",
    "conv_workspace_size_limit": "no cuDNN workspace knob in PyTorch",
    "cudnn_batchnorm_spatial_persistent": "no such cuDNN switch in PyTorch",
    "last_comm_group_size_MB": "DDP sizes its first bucket itself",
    "fuse_grad_size_in_TFLOPS": "buckets are sized in MB (fuse_grad_size_in_MB)",
    "fuse_grad_size_in_num": "buckets are sized in MB (fuse_grad_size_in_MB)",
    "without_graph_optimization": "no static graph",
    "calc_comm_same_stream": "DDP chooses its streams",
    "fuse_grad_merge": "gradient merge accumulates in the parameters' .grad",
    "hybrid_configs": "hybrid parallelism is not available yet",
    "tensor_parallel_configs": "tensor parallelism is not available yet",
    "trainer_desc_configs": "no trainer descriptor",
    "gradient_scale_configs": "gradients are always averaged over workers",
}


def _changed(strategy: Any) -> list[str]:
    default = type(strategy)()
    return [name for name in INERT if hasattr(strategy, name)
            and getattr(strategy, name) != getattr(default, name)]


@register
class InertSwitches(Strategy):
    """Never applies; warns in the plan when a switch without effect was set."""

    name = "inert_switches"

    @classmethod
    def enabled(cls, strategy: Any) -> bool:
        return hasattr(strategy, "to_dict") and bool(_changed(strategy))

    def can_apply(self, plan_input: PlanInput) -> Verdict:
        names = _changed(plan_input.strategy)
        return Verdict.skip("set but without effect in fleetx: " + "; ".join(
            f"{n} ({INERT[n]})" for n in names), warn=True)

    def apply(self, ctx: TrainingContext) -> None:  # pragma: no cover - never planned
        raise AssertionError("inert switches are never applied")
