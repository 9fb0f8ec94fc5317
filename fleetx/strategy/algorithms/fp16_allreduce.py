"""Half-precision gradient all-reduce (``strategy.fp16_allreduce``).

Gradients are cast to float16 for communication and back to their own precision afterwards, so
every all-reduce moves half the bytes. The pipeline divides each bucket by the world size
*before* the cast, so the float16 sum stays as far from overflow as the averaged gradient itself
(|g| < 65504); precision is float16's, about 3 significant digits per element. bfloat16 would
keep float32's range, but PyTorch's bfloat16 compress hook needs CUDA and NCCL; float16 works on
every backend, gloo included.

It composes with every other gradient-communication strategy: with ``dgc`` it carries the dense
remainder (small parameters, and every step before compression starts), with hierarchical
all-reduce and ``nccl_comm_num`` it casts before the route is chosen.
"""
from __future__ import annotations

import torch
from torch.futures import Future

from fleetx.comm.hooks import GradientCodec, Downstream
from fleetx.strategy.algorithms.adaptive_localsgd import AdaptiveLocalSGDStrategy
from fleetx.strategy.algorithms.data_parallel import DataParallelStrategy
from fleetx.strategy.algorithms.dgc import DGCStrategy
from fleetx.strategy.algorithms.gradient_merge import GradientMergeStrategy
from fleetx.strategy.algorithms.localsgd import LocalSGDStrategy
from fleetx.strategy.api import Mode, PlanInput, Strategy, TrainingContext, Verdict, register

__all__ = ["Fp16AllReduceStrategy", "Fp16Codec"]


class Fp16Codec(GradientCodec):
    """Cast float32 (or float64) gradients to float16 around the rest of the pipeline."""

    def run(self, bucket: object, tensor: torch.Tensor, link: Downstream) -> Future:
        if tensor.dtype in (torch.float16, torch.bfloat16):
            return link.all_reduce(tensor)
        dtype = tensor.dtype
        return link.all_reduce(tensor.to(torch.float16)).then(lambda f: f.value().to(dtype))

    def describe(self) -> str:
        return "cast to float16"


@register
class Fp16AllReduceStrategy(Strategy):
    """Communicate gradients in float16.

    Example:
        >>> from fleetx.strategy.api import WorldInfo
        >>> from fleetx.strategy.distributed_strategy import DistributedStrategy
        >>> s = DistributedStrategy(); s.fp16_allreduce = True
        >>> Fp16AllReduceStrategy(s).can_apply(PlanInput(s, WorldInfo(world_size=1))).reason
        'one process: no gradient is communicated'
    """

    name = "fp16_allreduce"
    heal_fallback = ("it changes DDP's all-reduce, which the healing all-reduce replaces")
    paddle_name = "FP16AllReduceOptimizer"
    requires = (DataParallelStrategy,)
    # Codecs nest in plan order, first outermost: DGC sparsifies the full-precision gradients and
    # this cast carries the dense rest. After the step schedules (gradient merge, local SGD),
    # which decide when gradients are communicated at all.
    runs_after = (DGCStrategy, GradientMergeStrategy, LocalSGDStrategy, AdaptiveLocalSGDStrategy)

    def can_apply(self, plan_input: PlanInput) -> Verdict:
        world = plan_input.world
        if world.mode is not Mode.COLLECTIVE:
            return Verdict.fail("works in collective mode only (gradients all-reduced)")
        if world.world_size <= 1:
            return Verdict.skip("one process: no gradient is communicated", warn=True)
        return Verdict.ok("gradients cast to float16 for all-reduce (half the bytes), "
                          "back to float32 after")

    def apply(self, ctx: TrainingContext) -> None:
        ctx.comm_hooks.append((None, Fp16Codec()))
