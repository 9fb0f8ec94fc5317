"""Automatic mixed precision (``strategy.amp``).

The forward and backward passes run in float16 where that is numerically safe and in float32
elsewhere; the parameters and the optimizer step stay in float32. Small float16 gradients would
underflow to zero, so the loss is multiplied by a *loss scale* before backward and the gradients
divided by it before the step. With dynamic loss scaling a step whose gradients contain inf/nan
is skipped; after ``decr_every_n_nan_or_inf`` such steps the scale shrinks by ``decr_ratio``, and
after ``incr_every_n_steps`` clean steps in a row it grows by ``incr_ratio``. In PyTorch this is
``torch.autocast`` plus a gradient scaler.

How it maps onto PyTorch: every forward of the distributed model runs under ``torch.autocast``
(float16 on CUDA, bfloat16 on CPU) with the module hooks of :mod:`fleetx.amp.precision` for
``custom_white_list`` / ``custom_black_list`` / ``custom_black_varnames``; the backward runs on
the scaled loss; a step guard unscales the gradients and skips the step when one holds inf or
nan. When the gradients were synchronised (data parallel), the found-inf flag is all-reduced so
that every rank skips the same steps and keeps the same scale. The scaler's state is saved with
the optimizer, and ``optimizer.get_loss_scaling()`` returns the current scale.
``optimizer.clip_grad_norm_`` unscales the gradients first (the context's ``before_clip`` hook,
as ``GradScaler.unscale_`` before clipping), so it clips by the model's norm; the step guard then
reuses that unscale and its found-inf flag instead of dividing a second time.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from fleetx.amp import LossScaler, PrecisionHooks, low_precision_dtype, resolve
from fleetx.strategy.algorithms.adaptive_localsgd import AdaptiveLocalSGDStrategy
from fleetx.strategy.algorithms.data_parallel import DataParallelStrategy
from fleetx.strategy.algorithms.gradient_merge import GradientMergeStrategy
from fleetx.strategy.algorithms.localsgd import LocalSGDStrategy
from fleetx.strategy.api import (Mode, PlanInput, Strategy, StrategyError, TrainingContext,
                                 Verdict, register)
from fleetx.strategy.config import Config, option

__all__ = ["AmpConfig", "AmpStrategy", "cpu_has_fast_bf16", "fast_bf16_flags"]


@dataclass
class AmpConfig(Config):
    """``strategy.amp_configs``: loss scaling and the op lists of mixed precision.

    Example:
        >>> AmpConfig(init_loss_scaling=1024).init_loss_scaling
        1024.0
    """

    section = "amp_configs"

    init_loss_scaling: float = option(32768.0, "Loss scale at the first step.", gt=0)
    incr_every_n_steps: int = option(
        1000, "Grow the scale after this many consecutive steps with finite gradients.", ge=1)
    decr_every_n_nan_or_inf: int = option(
        2, "Shrink the scale after this many steps with inf/nan gradients.", ge=1)
    incr_ratio: float = option(2.0, "Factor the scale grows by.", gt=1)
    decr_ratio: float = option(0.8, "Factor the scale shrinks by.", gt=0, lt=1)
    use_dynamic_loss_scaling: bool = option(
        True, "Adjust the scale as above; False keeps init_loss_scaling fixed.")
    custom_white_list: list[str] = option([], "Ops always run in float16.")
    custom_black_list: list[str] = option([], "Ops always run in float32.")
    custom_black_varnames: list[str] = option([], "Tensors (by name) kept in float32.")
    use_pure_fp16: bool = option(
        False, "Pure float16 training: parameters cast to float16 too (master copies in float32).")
    use_fp16_guard: bool = option(
        True, "With use_pure_fp16, cast only the ops inside an fp16 guard region.",
        no_effect="use_pure_fp16 is refused, so there is no guard region")


def fast_bf16_flags(cpuinfo: str) -> Optional[bool]:
    """Whether ``/proc/cpuinfo`` text shows hardware bfloat16 arithmetic (x86 AMX or
    AVX512-BF16, Arm's BF16 extension);
    None when it lists no CPU flags at all.

    Example:
        >>> fast_bf16_flags("flags : fpu avx2"), fast_bf16_flags("flags : avx512f avx512_bf16")
        (False, True)
    """
    flags = set()
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            flags.update(value.split())
    if not flags:
        return None
    return bool(flags & {"amx_bf16", "avx512_bf16", "bf16"})  # bf16: Arm's BFloat16 extension


@functools.lru_cache(maxsize=1)
def cpu_has_fast_bf16() -> Optional[bool]:
    """:func:`fast_bf16_flags` of this machine (read once); None where ``/proc/cpuinfo`` is
    missing (not Linux), so no hint is given."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return fast_bf16_flags(f.read())
    except OSError:
        return None


def _lists(cfg: AmpConfig) -> tuple[tuple[type, ...], tuple[type, ...]]:
    """The black and white module types of the config.

    Raises:
        ValueError: an unknown name, or a module type on both lists.
    """
    black = tuple(t for name in cfg.custom_black_list for t in resolve(name))
    white = tuple(t for name in cfg.custom_white_list for t in resolve(name))
    both = sorted({t.__name__ for t in black} & {t.__name__ for t in white})
    if both:
        raise ValueError(f"{', '.join(both)} is on both custom_white_list and custom_black_list")
    return black, white


@register
class AmpStrategy(Strategy):
    """Autocast around every forward, Paddle's dynamic loss scaling around every step."""

    name = "amp"
    config = AmpConfig
    paddle_name = "AMPOptimizer"
    # Its step guard (unscale, inf check) must run after gradient merge's boundary guard, and it
    # asks the sync_gradients that data parallel, gradient merge and local SGD shape whether a
    # step was synchronised.
    runs_after = (DataParallelStrategy, GradientMergeStrategy, LocalSGDStrategy,
                  AdaptiveLocalSGDStrategy)

    def can_apply(self, plan_input: PlanInput) -> Verdict:
        cfg = self.strategy.typed_config("amp")
        world = plan_input.world
        if world.mode is not Mode.COLLECTIVE:
            return Verdict.fail("runs in collective mode only (parameter-server training keeps "
                                "float32 on the servers)")
        if cfg.use_pure_fp16:
            return Verdict.fail("use_pure_fp16 is not supported: parameters stay float32 and "
                                "autocast picks each op's precision; set "
                                "amp_configs['use_pure_fp16'] = False")
        try:
            _lists(cfg)
        except ValueError as err:
            return Verdict.fail(f"amp_configs: {err}")
        if cfg.custom_black_varnames and not plan_input.model.param_names:
            return Verdict.fail("custom_black_varnames names modules of the model: call "
                                "fleet.distributed_model(model) before distributed_optimizer")
        dtype = str(low_precision_dtype(world.device)).replace("torch.", "")
        kind = "dynamic loss scale from" if cfg.use_dynamic_loss_scaling else "fixed loss scale"
        scaling = f"{kind} {cfg.init_loss_scaling:g}"
        lists = ""
        if cfg.custom_white_list or cfg.custom_black_list:
            lists = (f"; white {cfg.custom_white_list or '[]'}, "
                     f"black {cfg.custom_black_list or '[]'}")
        hint = ""
        if world.device == "cpu" and cpu_has_fast_bf16() is False:
            hint = ("; hint: this CPU has no fast bfloat16 (no amx_bf16, avx512_bf16 or bf16 "
                    "flag), so its bfloat16 math is emulated and usually slower than float32: "
                    "consider strategy.amp = False on this machine")
        return Verdict.ok(f"autocast {dtype} on {world.device}, {scaling}{lists}{hint}")

    def apply(self, ctx: TrainingContext) -> None:
        cfg = self.strategy.typed_config("amp")
        scaler = LossScaler(cfg.init_loss_scaling, cfg.incr_every_n_steps,
                            cfg.decr_every_n_nan_or_inf, cfg.incr_ratio, cfg.decr_ratio,
                            cfg.use_dynamic_loss_scaling)
        ctx.state[self.name] = scaler
        hooks = PrecisionHooks(ctx.world.device, low_precision_dtype(ctx.world.device))
        if ctx.model is not None:
            black, white = _lists(cfg)
            try:
                hooks.install(ctx.model, black, white, cfg.custom_black_varnames)
            except ValueError as err:
                raise StrategyError(f"amp: {err}") from None
        ctx.forward_contexts.append(hooks.region)

        check = _InfCheck(ctx, scaler)
        scaled_backward = ctx.backward

        def backward(loss: Any) -> None:
            check.scaled = True
            with hooks.backward_region():  # recomputed modules keep their listed precision
                scaled_backward(scaler.scale_loss(loss))

        ctx.backward = backward
        unscaled_from = ctx.backward_from

        def backward_from(tensors: Any, grads: Any) -> None:
            # A pipeline stage before the last: its outputs' gradients came from the scaled
            # loss of the last stage, so they carry the same scale (every stage's scaler takes
            # the same steps: the found-inf flag is agreed across all ranks).
            check.scaled = True
            with hooks.backward_region():
                unscaled_from(tensors, grads)

        ctx.backward_from = backward_from
        ctx.step_guards.append(check.guard)
        ctx.after_step.append(check.after_step)
        ctx.optimizer_methods["get_loss_scaling"] = lambda: scaler.scale
        ctx.before_clip.append(check.before_clip)
        ctx.scalars["loss_scale"] = lambda: float(scaler.scale)


class _InfCheck:
    """The step guard (unscale, look for inf/nan, agree across ranks) and the scale update.

    The guard only runs on steps the guards before it allowed (at a gradient-merge boundary, say);
    the scale is updated only after steps on which the guard ran, so accumulated gradients all
    carry the same scale.
    """

    def __init__(self, ctx: TrainingContext, scaler: LossScaler) -> None:
        self.ctx, self.scaler = ctx, scaler
        self.found_inf: Any = None  # None: the guard did not run this step
        self.scaled = False  # a backward ran on the scaled loss since the last step
        # The found-inf flag of an unscale clip_grad_norm_ already made this step (None: the
        # gradients still carry the scale); the guard must not divide them a second time.
        self.clipped_found: Optional[bool] = None

    def before_clip(self, params: list) -> None:
        """``before_clip``: unscale now, once per step, so the norm is the model's (a clip from
        a step pre-hook runs after the guard and finds the gradients unscaled already)."""
        if self.clipped_found is None and self.found_inf is None:
            self.clipped_found = self._unscale()

    def guard(self) -> bool:
        found = self.clipped_found if self.clipped_found is not None else self._unscale()
        self.found_inf = found
        return not found

    def _unscale(self) -> bool:
        """Divide the gradients by the scale; whether one holds inf or nan on any rank."""
        params = [p for g in self.ctx.optimizer.param_groups for p in g["params"]]
        if not self.scaled and any(p.grad is not None for p in params):
            # Unscaling gradients that were never scaled would shrink the step silently.
            raise RuntimeError("amp: the gradients did not come from the scaled loss: run the "
                               "backward through the optimizer (optimizer.minimize(loss) or "
                               "optimizer.backward(loss)), not loss.backward()")
        found = self.scaler.unscale_(params)
        # Synchronised gradients are equal on every rank, but a comm hook or a user edit may
        # still leave one rank with an inf: all ranks must skip together or their parameters
        # part. Unsynchronised (local SGD) steps are each rank's own business.
        if self.ctx.world.world_size > 1 and self.ctx.sync_gradients():
            device = params[0].device if params else torch.device("cpu")
            flag = torch.tensor([1.0 if found else 0.0], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            found = bool(flag.item() > 0)
        return found

    def after_step(self) -> None:
        # Every step (taken or skipped) ends the unscale a clip made for it.
        self.clipped_found = None
        if self.found_inf is not None:
            self.scaler.update(self.found_inf)
            self.found_inf, self.scaled = None, False
