"""Data parallel: every process holds the whole model and gradients are averaged by allreduce.

The engine is PyTorch's ``DistributedDataParallel`` (buckets, overlap of backward and
communication, comm hooks). Fleet's switches map onto it: ``fuse_all_reduce_ops`` and
``fuse_grad_size_in_MB`` set the bucket size, ``find_unused_parameters`` passes through. It is the
first strategy of every collective plan, and it applies only when there is more than one process
and no sharding stage 2 or 3 takes the model (FSDP2 then synchronises the gradients itself;
DDP would reduce them twice).

Within a hybrid topology (``hybrid_configs`` with ``mp_degree`` or ``pp_degree`` above 1) the
ranks of one data-parallel group are the replicas: DDP runs over that group only
(``get_hybrid_communicate_group().get_data_parallel_group()``), never over the world, whose
ranks hold different shards or stages (DDP's first broadcast would copy rank 0's shards over
them). With ``dp_degree`` 1 there are no replicas and no DDP. A pipelined model
(``PipelineLayer``) is not wrapped: its ``train_batch`` averages the gradients over the same
data-parallel group.

Strategies that change how gradients travel (``fp16_allreduce``, ``dgc``, hierarchical
all-reduce, ``nccl_comm_num``) add stages to ``ctx.comm_hooks``; when the model is wrapped they
are composed into DDP's one comm hook by :func:`fleetx.comm.hooks.compose`, and the pipeline's
traffic counters are kept in ``ctx.state["data_parallel"]`` (so they appear under
``optimizer.state_dict()["fleetx"]``). Those that communicate over the whole world or build
process groups of their own (local SGD, DGC, hierarchical all-reduce, ``nccl_comm_num``) are
refused when the model is split (:func:`refuse_split_model`).

Under ``fleetrun --fault_tolerance heal`` there is no DDP: the gradients are averaged at the
optimizer step, on one flat buffer, through :mod:`fleetx.comm.heal`, whose all-reduce survives
the death of a rank (the step is taken again with the survivors' gradients); the micro-steps
that DDP's ``no_sync`` would leave local (gradient merge, local SGD) are left local there too.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch.nn.parallel import DistributedDataParallel

from fleetx.comm import heal, hooks
from fleetx.strategy.api import (Mode, PlanInput, Strategy, StrategyError, TrainingContext,
                                 Verdict, register, train_only)
from fleetx.parallel.hcg import get_hcg
from fleetx.strategy.topology import Topology, resolve

__all__ = ["DataParallelStrategy", "refuse_split_model"]

# With fusion off every gradient travels alone: a bucket cap far below any real tensor gives one
# bucket per parameter (DDP cannot be told "no buckets" directly).
_UNFUSED_BUCKET_MB = 1e-6


@register
class DataParallelStrategy(Strategy):
    """Wrap the model in ``DistributedDataParallel`` when the world has more than one process."""

    name = "data_parallel"
    paddle_graph_name = "GraphExecutionOptimizer"  # Paddle's graph optimizer, not a meta one
    implicit = True

    def can_apply(self, plan_input: PlanInput) -> Verdict:
        world, s = plan_input.world, plan_input.strategy
        if world.mode is not Mode.COLLECTIVE:
            return Verdict.skip("parameter-server mode: dense parameters live on the servers")
        if world.world_size <= 1:
            return Verdict.skip("one process: nothing to synchronise")
        stage = _fsdp_stage(s, world.world_size)
        if stage:
            return Verdict.skip(f"sharding stage {stage} synchronises gradients itself (FSDP2 "
                                f"reduce-scatter): no DistributedDataParallel")
        topo = _model_parallel_topology(s, world.world_size)
        if topo is not None:
            split = f"mp_degree={topo.mp_degree} x pp_degree={topo.pp_degree}"
            if topo.dp_degree == 1:
                return Verdict.skip(f"dp_degree=1: every process holds another part of the "
                                    f"model ({split}); nothing is replicated")
            return Verdict.ok(f"gradients averaged over the data-parallel group (dp_degree="
                              f"{topo.dp_degree} of {world.world_size} processes, {split}): "
                              f"DistributedDataParallel on it (a PipelineLayer's train_batch "
                              f"averages them itself), bucket {self._bucket_mb(s):g} MB")
        return Verdict.ok(f"DistributedDataParallel over {world.world_size} processes, "
                          f"bucket {self._bucket_mb(s):g} MB, "
                          f"find_unused_parameters={s.find_unused_parameters}")

    @staticmethod
    def _bucket_mb(s: Any) -> float:
        return float(s.fuse_grad_size_in_MB) if s.fuse_all_reduce_ops else _UNFUSED_BUCKET_MB

    def apply(self, ctx: TrainingContext) -> None:
        s = self.strategy
        healer = heal.active()
        if healer is not None:
            ctx.step_guards.append(lambda: _average_gradients(ctx, healer))
            return
        ctx.ddp_options.update(bucket_cap_mb=self._bucket_mb(s),
                               find_unused_parameters=bool(s.find_unused_parameters))
        ctx.model_wrappers.append(train_only(lambda module: _wrap_ddp(module, ctx)))


def _fsdp_stage(s: Any, world_size: int) -> int:
    """The sharding stage when FSDP2 takes the model (sharding on, stage 2 or 3, a sharding
    degree above 1), else 0. Sharding's own verdict reports an impossible layout."""
    if not getattr(s, "sharding", False):
        return 0
    stage = s.typed_config("sharding").stage
    try:
        degree = resolve(s, world_size).sharding_degree
    except StrategyError:
        return 0
    return stage if stage >= 2 and degree > 1 else 0


def _model_parallel_topology(s: Any, world_size: int) -> Optional[Topology]:
    """The topology when tensor or pipeline degrees split the model (data parallelism is then
    the data-parallel group's), else None; an impossible layout is reported by ``fleet.init``."""
    if not hasattr(s, "typed_config"):  # a strategy without hybrid settings
        return None
    try:
        topo = resolve(s, world_size)
    except StrategyError:
        return None
    return topo if topo.mp_degree * topo.pp_degree > 1 else None


def refuse_split_model(plan_input: PlanInput, what: str) -> Optional[Verdict]:
    """The verdict of a strategy that is not aware of the hybrid topology when tensor or
    pipeline degrees split the model: it fails, naming the degrees; None when nothing is split.

    Such a strategy communicates over the whole world, or builds process groups of its own that
    ``new_group`` would need every process to create; under ``mp_degree`` or ``pp_degree`` > 1
    the world's ranks hold different shards or stages, so it would mix them (or hang), where
    only the data-parallel group holds replicas.

    Args:
        plan_input: the planner's input (strategy and world).
        what: how the strategy communicates, e.g. ``"it averages parameters over every
            process"``.

    Example:
        >>> from fleetx.strategy.api import WorldInfo
        >>> from fleetx.strategy.distributed_strategy import DistributedStrategy
        >>> s = DistributedStrategy(); s.hybrid_configs = {"mp_degree": 2}
        >>> print(refuse_split_model(PlanInput(s, WorldInfo(world_size=2)),
        ...                          "it averages over the world").reason)
        mp_degree=2, pp_degree=1 (dp_degree=1): it averages over the world, while only ...
    """
    topo = _model_parallel_topology(plan_input.strategy, plan_input.world.world_size)
    if topo is None:
        return None
    return Verdict.fail(f"mp_degree={topo.mp_degree}, pp_degree={topo.pp_degree} (dp_degree="
                        f"{topo.dp_degree}): {what}, while only the hybrid topology's "
                        f"data-parallel group holds replicas of the split model; turn it off, "
                        f"or set hybrid_configs mp_degree and pp_degree to 1")


def _data_parallel_group(ctx: TrainingContext) -> Any:
    """The process group DDP reduces over: the hybrid topology's data-parallel group when
    tensor or pipeline degrees split the model, else the world (None).

    Raises:
        StrategyError: the model is split but no hybrid communicate group exists.
    """
    if _model_parallel_topology(ctx.strategy, ctx.world.world_size) is None:
        return None
    hcg = get_hcg()
    if hcg is None:
        raise StrategyError("hybrid_configs splits the model (mp_degree or pp_degree > 1) but "
                            "no hybrid communicate group exists: call "
                            "fleet.init(is_collective=True, strategy=...) first")
    return hcg.get_data_parallel_group()


def _average_gradients(ctx: TrainingContext, healer: Any) -> bool:
    """The healing job's gradient all-reduce, as the first step guard: on the steps DDP would
    synchronise (``ctx.sync_gradients()``), every gradient becomes its mean over the live ranks;
    a parameter without a gradient contributes zeros (every rank must send the same layout)."""
    if ctx.sync_gradients():
        params = [p for group in ctx.optimizer.param_groups for p in group["params"]
                  if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        healer.average([p.grad for p in params])
    return True


def _wrap_ddp(module: torch.nn.Module, ctx: TrainingContext) -> DistributedDataParallel:
    device_ids = None
    if ctx.world.device == "cuda":
        device_ids = [torch.cuda.current_device()]
    ddp = DistributedDataParallel(module, device_ids=device_ids,
                                  process_group=_data_parallel_group(ctx), **ctx.ddp_options)
    composed = hooks.compose(ctx.comm_hooks, ddp.process_group)
    if composed is not None:
        state, hook = composed
        ddp.register_comm_hook(state, hook)
        if isinstance(state, hooks.Pipeline):
            ctx.state["data_parallel"] = state.traffic
    return ddp
