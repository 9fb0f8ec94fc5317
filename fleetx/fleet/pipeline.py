"""What ``fleet.distributed_model`` returns for a ``PipelineLayer``: its stage wrapped in
``PipelineParallel`` with the strategy's ``pipeline_configs`` (and ``amp``'s precision)."""
from __future__ import annotations

from typing import Any, Callable, ContextManager, Optional

from fleetx.amp import low_precision_dtype
from fleetx.comm.groups import default_timeout
from fleetx.parallel.hcg import get_hcg
from fleetx.parallel.pipeline import PipelineLayer
from fleetx.parallel.pipeline_parallel import PipelineParallel

__all__ = ["pipeline_model"]


def pipeline_model(layers: PipelineLayer, strategy: Any, device: str,
                   forward_context: Optional[Callable[[], ContextManager]] = None
                   ) -> PipelineParallel:
    """``layers`` under the schedule of ``strategy.pipeline_configs``.

    Args:
        layers: this process's stage.
        strategy: the fleet's ``DistributedStrategy``; with ``amp`` on, forwards run under
            ``torch.autocast`` in the device's low-precision dtype (bfloat16 on CPU).
        device: ``"cpu"`` or ``"cuda"``.
        forward_context: returns the training context's forward context (amp's autocast and
            op lists), entered around every forward instead of a bare autocast.

    With ``dp_degree > 1`` the stage's gradients are averaged over the hybrid topology's
    data-parallel group in every ``train_batch``.
    """
    cfg = strategy.typed_config("pipeline")
    dtype = low_precision_dtype(device) if strategy.amp and forward_context is None else None
    hcg = get_hcg()
    dp_group = (hcg.get_data_parallel_group()
                if hcg is not None and hcg.get_data_parallel_world_size() > 1 else None)
    return PipelineParallel(layers, micro_batch_size=cfg.micro_batch_size,
                            accumulate_steps=cfg.accumulate_steps,
                            schedule_mode=cfg.schedule_mode, p2p_cache_shape=cfg.p2p_cache_shape,
                            timeout=default_timeout(), autocast_dtype=dtype,
                            dp_group=dp_group, forward_context=forward_context)
