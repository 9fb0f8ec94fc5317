"""Synchronised batch normalisation (``strategy.sync_batch_norm``).

Batch-norm layers compute their batch statistics over the global batch (every process's
samples) instead of each process's own: ``nn.SyncBatchNorm.convert_sync_batchnorm`` replaces
every ``BatchNorm*d`` of the model before it is wrapped for data parallel (same parameters and
running buffers, so checkpoints are unchanged). PyTorch implements ``SyncBatchNorm`` for GPUs
only; on CPU the strategy is skipped with a warning and statistics stay per process.
"""
from __future__ import annotations

from torch import nn

from fleetx.strategy.algorithms.data_parallel import DataParallelStrategy
from fleetx.strategy.api import Mode, PlanInput, Strategy, TrainingContext, Verdict, register

__all__ = ["SyncBatchNormStrategy"]


@register
class SyncBatchNormStrategy(Strategy):
    """Convert batch-norm layers to ``nn.SyncBatchNorm``.

    Example:
        >>> from fleetx.strategy.api import WorldInfo
        >>> from fleetx.strategy.distributed_strategy import DistributedStrategy
        >>> s = DistributedStrategy(); s.sync_batch_norm = True
        >>> SyncBatchNormStrategy(s).can_apply(PlanInput(s, WorldInfo(world_size=2))).reason
        "PyTorch's SyncBatchNorm runs on GPUs only: batch-norm statistics stay per process"
    """

    name = "sync_batch_norm"
    heal_fallback = ("its statistics travel in every forward over the group built at the start")
    requires = (DataParallelStrategy,)
    # its model wrapper must convert the layers before data parallel wraps the model in DDP
    runs_before = (DataParallelStrategy,)

    def can_apply(self, plan_input: PlanInput) -> Verdict:
        world = plan_input.world
        if world.mode is not Mode.COLLECTIVE:
            return Verdict.fail("works in collective mode only")
        if world.world_size <= 1:
            return Verdict.skip("one process: its batch is the global batch", warn=True)
        if world.device != "cuda":
            return Verdict.skip("PyTorch's SyncBatchNorm runs on GPUs only: batch-norm "
                                "statistics stay per process", warn=True)
        return Verdict.ok("BatchNorm layers -> nn.SyncBatchNorm over all processes")

    def apply(self, ctx: TrainingContext) -> None:
        ctx.model_wrappers.append(nn.SyncBatchNorm.convert_sync_batchnorm)
