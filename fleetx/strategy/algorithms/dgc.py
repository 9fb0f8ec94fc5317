"""Deep gradient compression (``strategy.dgc``).

Only the largest gradient entries (a fraction ``1 - sparsity``) are exchanged each step; the rest
accumulate locally, with momentum correction, until they grow large enough to be sent. This cuts
traffic on slow networks. Compression starts at ``rampup_begin_step``; during the next
``rampup_step`` steps the sparsity walks through the ``sparsity`` list, and its last value holds
afterwards. It works with the Momentum optimizer and more than one worker.

How it runs here (Lin et al., "Deep Gradient Compression", ICLR 2018; Paddle's ``dgc`` op):

* A :class:`DGCCodec` in the gradient pipeline. Each rank keeps, per compressed parameter, a
  local momentum ``u`` and a residual ``v``. With ``g`` the local gradient (divided by the world
  size) plus the local share ``wd / N * w`` of the weight decay::

      u = m * u + g            (momentum correction: momentum is applied before sparsifying)
      v = v + u                (nesterov: v = v + g + m * u)
      send the top-k of |v|: k = numel * (1 - sparsity) (index, value) pairs, by all-gather
      u[sent] = 0, v[sent] = 0 (momentum factor masking; the rest stays as residual)

  Every rank adds up all ranks' pairs: that sum is the averaged, momentum-corrected update.
* :class:`DGCMomentumOptimizer` around the user's SGD: a parameter whose update came compressed
  takes a plain step ``w -= lr * update`` (its momentum and weight decay are already inside);
  every other parameter takes the user's momentum-SGD step.
* Parameters under 16384 elements (as in Paddle), or not float32, always go dense; so does
  everything before ``rampup_begin_step``, when training is exactly momentum-SGD data parallel.
  At the first compressed step ``u`` starts from the optimizer's momentum buffer divided by the
  world size, so the momentum carries over.

Steps are counted in optimizer steps taken: with gradient merge the pipeline runs once per merged
step, on the merged gradient, and the ramp-up counts merged steps.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch.futures import Future, collect_all

from fleetx.comm.hooks import GradientCodec, Downstream, done
from fleetx.optim.wrapper import OptimizerWrapper
from fleetx.strategy.algorithms.adaptive_localsgd import AdaptiveLocalSGDStrategy
from fleetx.strategy.algorithms.amp import AmpStrategy
from fleetx.strategy.algorithms.data_parallel import DataParallelStrategy, refuse_split_model
from fleetx.strategy.algorithms.lars import LarsStrategy
from fleetx.strategy.algorithms.localsgd import LocalSGDStrategy
from fleetx.strategy.api import Mode, PlanInput, Strategy, TrainingContext, Verdict, register
from fleetx.strategy.config import Config, option

__all__ = ["DGCConfig", "DGCStrategy", "DGCState", "DGCCodec", "DGCMomentumOptimizer",
           "MIN_NUMEL", "sparsity_at"]

MIN_NUMEL = 16384  # Paddle's threshold: smaller parameters always go dense
DEFAULT_SPARSITY = (0.999,)


@dataclass
class DGCConfig(Config):
    """``strategy.dgc_configs``: when compression starts and how sparse it gets.

    Example:
        >>> DGCConfig(sparsity=[0.75, 0.9375, 0.999]).rampup_step
        1
    """

    section = "dgc_configs"

    rampup_begin_step: int = option(0, "Step at which compression starts.", ge=0)
    rampup_step: int = option(1, "Steps taken to walk through the sparsity list.", ge=1)
    sparsity: list[float] = option(
        [], "Sparsity schedule (fraction of entries not sent); empty means [0.999].", ge=0, lt=1)


def sparsity_at(step: int, cfg: DGCConfig) -> Optional[float]:
    """The sparsity at optimizer step ``step`` (counted from 0); None: not compressed yet.

    The list is walked evenly over ``rampup_step`` steps, its last value holds afterwards.

    Example:
        >>> cfg = DGCConfig(rampup_begin_step=2, rampup_step=6, sparsity=[0.75, 0.9, 0.99])
        >>> [sparsity_at(s, cfg) for s in range(10)]
        [None, None, 0.75, 0.75, 0.9, 0.9, 0.99, 0.99, 0.99, 0.99]
    """
    if step < cfg.rampup_begin_step:
        return None
    schedule = cfg.sparsity or DEFAULT_SPARSITY
    index = (step - cfg.rampup_begin_step) * len(schedule) // cfg.rampup_step
    return schedule[min(index, len(schedule) - 1)]


def compressible(param: torch.Tensor) -> bool:
    """Whether DGC may sparsify this parameter's gradient (large enough, float32)."""
    return param.numel() >= MIN_NUMEL and param.dtype == torch.float32


class DGCState:
    """Per-parameter momentum and residual, the step counter, and the last step's output.

    Args:
        cfg: the schedule.
        optimizer: the user's SGD (momentum, weight decay, nesterov and lr per group).
        names: parameter -> ``named_parameters()`` name, for ``state_dict`` keys.
        world_size: number of data-parallel ranks.
    """

    def __init__(self, cfg: DGCConfig, optimizer: torch.optim.Optimizer,
                 names: dict[int, str], world_size: int) -> None:
        self.cfg, self.optimizer, self.world_size = cfg, optimizer, world_size
        self.names = names
        self.step = 0
        self.u: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self.pending: dict[int, torch.Tensor] = {}  # compressed since the last optimizer step
        self._groups: dict[int, dict] = {}

    def group_of(self, param: torch.Tensor) -> Optional[dict]:
        if id(param) not in self._groups:
            self._groups = {id(p): g for g in self.optimizer.param_groups for p in g["params"]}
        return self._groups.get(id(param))

    def _buffers(self, param: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        key = id(param)
        if key not in self.u:
            # Carry the momentum over: the buffer holds the averaged momentum, and the ranks'
            # local momenta add up to it.
            buf = self.optimizer.state.get(param, {}).get("momentum_buffer")
            self.u[key] = (buf.detach().reshape(-1) / self.world_size if buf is not None
                           else torch.zeros(param.numel(), dtype=param.dtype,
                                            device=param.device))
            self.v[key] = torch.zeros_like(self.u[key])
        return self.u[key], self.v[key]

    def compress(self, param: torch.Tensor, grad: torch.Tensor,
                 sparsity: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Momentum-correct ``grad`` (flat, divided by the world size) into the residual and
        take out its top-k entries. Returns (indices, values)."""
        group = self.group_of(param)
        m, wd = group["momentum"], group["weight_decay"]
        u, v = self._buffers(param)
        if wd:
            grad = grad + (wd / self.world_size) * param.detach().reshape(-1)
        u.mul_(m).add_(grad)
        if group["nesterov"]:
            v.add_(grad).add_(u, alpha=m)
        else:
            v.add_(u)
        k = max(1, int(grad.numel() * (1.0 - sparsity)))
        index = torch.topk(v.abs(), k, sorted=False).indices
        values = v[index]
        u[index] = 0
        v[index] = 0
        self.pending[id(param)] = param
        return index, values

    def finish_step(self) -> dict[int, torch.Tensor]:
        """Count an optimizer step; return the parameters compressed since the last one."""
        self.step += 1
        pending, self.pending = self.pending, {}
        return pending

    def state_dict(self) -> dict:
        return {"step": self.step,
                "u": {self.names[k]: t for k, t in self.u.items()},
                "v": {self.names[k]: t for k, t in self.v.items()}}

    def load_state_dict(self, state: dict) -> None:
        ids = {name: key for key, name in self.names.items()}
        self.step = int(state["step"])
        self.u = {ids[n]: t.clone() for n, t in state["u"].items()}
        self.v = {ids[n]: t.clone() for n, t in state["v"].items()}


class DGCCodec(GradientCodec):
    """Sparsify the large gradients of a bucket; pass the rest down the pipeline dense."""

    def __init__(self, state: DGCState) -> None:
        self.state = state

    def run(self, bucket: Any, tensor: torch.Tensor, link: Downstream) -> Future:
        st = self.state
        sparsity = sparsity_at(st.step, st.cfg)
        params = bucket.parameters()
        sizes = [p.numel() for p in params]
        if sum(sizes) != tensor.numel():
            raise RuntimeError(f"DGC expected a bucket of {sum(sizes)} gradient elements laid out "
                               f"parameter after parameter, got {tensor.numel()}")
        pieces = tensor.split(sizes)
        chosen = [(p, g) for p, g in zip(params, pieces)
                  if sparsity is not None and compressible(p) and st.group_of(p) is not None]
        if not chosen:
            return link.all_reduce(tensor)
        taken = {id(p) for p, _ in chosen}
        rest = [g for p, g in zip(params, pieces) if id(p) not in taken]
        packet, n_index, index_dtype = self._pack(chosen, sparsity)
        sparse = link.all_gather(packet)
        dense = link.all_reduce(torch.cat(rest)) if rest else done(None)

        def unpack(_: Future) -> torch.Tensor:
            total = torch.zeros(sum(g.numel() for _, g in chosen), dtype=tensor.dtype,
                                device=tensor.device)
            for pk in sparse.value():
                total.index_add_(0, pk[:n_index].view(index_dtype).long(), pk[n_index:])
            for (_, g), part in zip(chosen, total.split([g.numel() for _, g in chosen])):
                g.copy_(part)
            if rest:
                for g, part in zip(rest, dense.value().split([g.numel() for g in rest])):
                    g.copy_(part)
            return tensor
        return collect_all([sparse, dense]).then(unpack)

    def _pack(self, chosen: list, sparsity: float) -> tuple[torch.Tensor, int, torch.dtype]:
        """One float32 packet [indices bit-cast to float32 | values], so one all-gather carries
        both. Indices are int32 while the bucket's compressed part allows it."""
        indices, values, offset = [], [], 0
        for p, g in chosen:
            index, value = self.state.compress(p, g, sparsity)
            indices.append(index + offset)
            values.append(value)
            offset += g.numel()
        index_dtype = torch.int32 if offset < 2 ** 31 else torch.int64
        index_part = torch.cat(indices).to(index_dtype).view(torch.float32)
        return torch.cat([index_part, torch.cat(values).float()]), index_part.numel(), index_dtype

    def describe(self) -> str:
        return "DGC top-k sparsification"


class DGCMomentumOptimizer(OptimizerWrapper):
    """The user's SGD, except for parameters whose update DGC just delivered compressed.

    Those take ``w -= lr * update``: their momentum and weight decay were applied before
    sparsification. The others (small parameters, steps before compression starts) take the
    inner optimizer's ordinary step. Groups, state and state_dict are the inner optimizer's.
    """

    def __init__(self, inner: torch.optim.Optimizer, state: DGCState) -> None:  # noqa: D107
        super().__init__()
        self._inner, self._dgc = inner, state

    @property
    def inner(self) -> torch.optim.Optimizer:
        return self._inner

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        compressed = self._dgc.finish_step()
        stash = {}
        for key, p in compressed.items():
            if p.grad is not None:
                stash[key], p.grad = p.grad, None  # the inner step skips parameters without grad
        try:
            self.inner.step()
        finally:
            for key, grad in stash.items():
                compressed[key].grad = grad
        with torch.no_grad():
            for group in self.inner.param_groups:
                for p in group["params"]:
                    if id(p) in stash:
                        p.add_(stash[id(p)], alpha=-group["lr"])
        return loss


def _momentum_problem(opt: Any) -> Optional[str]:
    """Why the optimizer cannot host DGC, or None."""
    if opt.class_name != "SGD" or not opt.get("momentum", 0):
        what = (f"SGD with momentum={opt.get('momentum', 0)}" if opt.class_name == "SGD"
                else opt.class_name)
        return (f"needs a momentum optimizer (torch.optim.SGD with momentum > 0), got {what}")
    if opt.get("dampening", 0):
        return (f"momentum correction assumes SGD dampening=0, got "
                f"dampening={opt.get('dampening')}")
    if opt.get("maximize", False):
        return "SGD with maximize=True is not supported"
    return None


@register
class DGCStrategy(Strategy):
    """Deep gradient compression on top of data parallel.

    Example:
        >>> from fleetx.strategy.api import ModelInfo, OptimizerInfo, WorldInfo
        >>> from fleetx.strategy.distributed_strategy import DistributedStrategy
        >>> s = DistributedStrategy(); s.dgc = True
        >>> adam = OptimizerInfo("Adam", (("lr", 0.001),))
        >>> DGCStrategy(s).can_apply(PlanInput(s, WorldInfo(world_size=2),
        ...                                    optimizer=adam)).reason
        'needs a momentum optimizer (torch.optim.SGD with momentum > 0), got Adam'
    """

    name = "dgc"
    heal_fallback = ("DGC's residuals are per rank and its compressed all-reduce runs inside DDP's "
                     "backward, not in the healing all-reduce")
    config = DGCConfig
    paddle_name = "DGCOptimizer"
    requires = (DataParallelStrategy,)
    # amp: the loss scale would be baked into the residuals, and one inf step would poison them
    # for good. lars: compressed updates bypass its layer-wise rate. Local SGD: gradients are not
    # all-reduced, so there is nothing to compress.
    conflicts = (AmpStrategy, LarsStrategy, LocalSGDStrategy, AdaptiveLocalSGDStrategy)

    def can_apply(self, plan_input: PlanInput) -> Verdict:
        world, model, opt = plan_input.world, plan_input.model, plan_input.optimizer
        if world.mode is not Mode.COLLECTIVE:
            return Verdict.fail("works in collective mode only (gradients all-reduced)")
        if not opt.class_name:
            return Verdict.skip("decided at distributed_optimizer, once the optimizer is known")
        problem = _momentum_problem(opt)
        if problem:
            return Verdict.fail(problem)
        if world.world_size <= 1:
            return Verdict.skip("one process: no gradient is communicated", warn=True)
        split = refuse_split_model(plan_input, "its residuals and momentum correction average "
                                   "over every process of the world")
        if split is not None:
            return split
        cfg = self.strategy.typed_config("dgc")
        schedule = cfg.sparsity or list(DEFAULT_SPARSITY)
        ramp = (f"sparsity {schedule} over {cfg.rampup_step} steps from step "
                f"{cfg.rampup_begin_step}")
        if model.param_numels:
            big = sum(1 for n in model.param_numels if n >= MIN_NUMEL)
            if not big:
                return Verdict.skip(f"no parameter has {MIN_NUMEL} elements or more, so every "
                                    f"gradient would go dense: plain data parallel", warn=True)
            return Verdict.ok(f"top-k exchange of {big} of {len(model.param_numels)} parameters "
                              f"(>= {MIN_NUMEL} elements), the rest dense; {ramp}")
        return Verdict.ok(f"top-k exchange of parameters with >= {MIN_NUMEL} elements; {ramp}")

    def apply(self, ctx: TrainingContext) -> None:
        # state_dict keys: the model's parameter names, else the position in the optimizer.
        params = [p for g in ctx.optimizer.param_groups for p in g["params"]]
        names = {id(p): f"param{i}" for i, p in enumerate(params)}
        if ctx.model is not None:
            names.update((id(p), name) for name, p in ctx.model.named_parameters())
        state = DGCState(self.strategy.typed_config("dgc"), ctx.optimizer, names,
                         ctx.world.world_size)
        ctx.state[self.name] = state
        ctx.optimizer = DGCMomentumOptimizer(ctx.optimizer, state)
        ctx.comm_hooks.append((None, DGCCodec(state)))
        # the sparsity of the next exchange; 0 while the gradients are not compressed yet
        ctx.scalars["dgc_sparsity"] = lambda: sparsity_at(state.step, state.cfg) or 0.0
