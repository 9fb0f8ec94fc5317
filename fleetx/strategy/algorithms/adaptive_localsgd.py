"""Adaptive local SGD (``strategy.adaptive_localsgd``).

Like local SGD, but the number of local steps between two parameter averagings is recomputed
after every averaging from the learning rate and the loss (Wang & Joshi, "Adaptive Communication
Strategies to Achieve the Best Error-Runtime Trade-off in Local-Update SGD"):
``k = ceil(sqrt(lr0 * loss / (lr * loss0) * init_k_steps))``, clipped to ``[1, 16]``. A large
learning rate gives short intervals, a small one long intervals.

As in Paddle, steps count from 1; ``lr0`` and ``loss0`` are the learning rate and the mean loss
over ranks of step 1; every step up to ``begin_step`` synchronises (here through DDP's gradient
all-reduce, equal to averaging the parameters for SGD and Momentum) and the interval is computed
at ``begin_step``; after that the parameters are averaged when ``k`` steps have passed since the
last averaging, and ``k`` is recomputed from that step's mean loss and learning rate. The loss
reaches the strategy through the optimizer wrapper: train with ``optimizer.minimize(loss)`` (or
``optimizer.backward(loss)``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch.distributed as dist

from fleetx.strategy.algorithms.data_parallel import DataParallelStrategy
from fleetx.strategy.algorithms.localsgd import (LocalSGDStrategy, average, check_local_sgd,
                                                 model_parameters, sync_in_warmup)
from fleetx.strategy.api import PlanInput, Strategy, TrainingContext, Verdict, register
from fleetx.strategy.config import Config, option

__all__ = ["AdaptiveLocalSGDConfig", "AdaptiveLocalSGDStrategy", "next_interval",
           "AdaptiveInterval", "MAX_K_STEPS"]

MAX_K_STEPS = 16  # Paddle's hard-coded upper bound


@dataclass
class AdaptiveLocalSGDConfig(Config):
    """``strategy.adaptive_localsgd_configs``: the first interval and when it starts.

    Example:
        >>> AdaptiveLocalSGDConfig(begin_step=30).init_k_steps
        1
    """

    section = "adaptive_localsgd_configs"

    init_k_steps: int = option(1, "Local steps of the first interval.", ge=1)
    begin_step: int = option(1, "Step from which local steps start (sync every step before).",
                             ge=1)


def next_interval(lr0: float, loss0: float, lr: float, loss: float, init_k_steps: int) -> int:
    """``ceil(sqrt(lr0 * loss / (lr * loss0) * init_k_steps))`` clipped to ``[1, 16]``.

    A ratio that is not a positive finite number (a zero learning rate, a non-positive loss)
    gives the bound it tends to: ``16`` for +inf, ``1`` otherwise.

    Example:
        >>> next_interval(0.1, 2.0, 0.1, 2.0, 4), next_interval(0.1, 2.0, 0.001, 1.0, 1)
        (2, 8)
    """
    try:
        ratio = lr0 * loss / (lr * loss0) * init_k_steps
    except ZeroDivisionError:
        ratio = math.inf if lr0 * loss * init_k_steps > 0 else math.nan
    if math.isinf(ratio) and ratio > 0:
        return MAX_K_STEPS
    if not ratio > 0:  # nan, zero or negative
        return 1
    return min(max(math.ceil(math.sqrt(ratio)), 1), MAX_K_STEPS)


@dataclass
class AdaptiveInterval:
    """The averaging schedule: when to average and the interval after each averaging.

    ``observe(lr, mean_loss)`` is called after step ``step + 1`` when :meth:`due` said so (and
    after step 1, to fix ``lr0`` and ``loss0``). Saved with the optimizer.

    Example:
        >>> s = AdaptiveInterval(init_k_steps=1, begin_step=1)
        >>> s.advance(), s.needs_loss()  # step 1: synchronised by DDP; fixes lr0 and loss0
        (False, True)
        >>> s.observe(lr=0.1, mean_loss=2.0); s.k_steps
        1
        >>> s.advance()  # step 2 = last sync + 1: average
        True
        >>> s.observe(lr=0.01, mean_loss=1.0); s.k_steps  # ceil(sqrt(0.1 * 1 / (0.01 * 2)))
        3
    """

    init_k_steps: int
    begin_step: int
    step: int = 0
    last_sync: int = 0
    k_steps: int = 0  # set from init_k_steps in __post_init__
    lr0: Optional[float] = None
    loss0: Optional[float] = None
    syncs: int = 0

    def __post_init__(self) -> None:
        self.k_steps = self.k_steps or self.init_k_steps

    def in_warmup(self) -> bool:
        """Whether the next step is one of ``1 .. begin_step`` (synchronised by DDP)."""
        return self.step < self.begin_step

    def advance(self) -> bool:
        """Count a step; True when the parameters are to be averaged after it (never during the
        warm-up, which DDP keeps in step)."""
        self.step += 1
        return self.step > self.begin_step and self.step - self.last_sync == self.k_steps

    def needs_loss(self) -> bool:
        """Whether the mean loss of the step just counted is needed (step 1, the last warm-up
        step, or an averaging step)."""
        return self.step == 1 or self.step == self.begin_step or (
            self.step > self.begin_step and self.step - self.last_sync == self.k_steps)

    def observe(self, lr: float, mean_loss: float) -> None:
        """Record the mean loss and learning rate of the step just counted."""
        if self.step == 1:
            self.lr0, self.loss0 = lr, mean_loss
        if self.step >= self.begin_step:
            self.k_steps = next_interval(self.lr0, self.loss0, lr, mean_loss, self.init_k_steps)
            self.last_sync = self.step
            self.syncs += int(self.step > self.begin_step)

    def state_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("step", "last_sync", "k_steps", "lr0", "loss0",
                                              "syncs")}

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)


@register
class AdaptiveLocalSGDStrategy(Strategy):
    """Local SGD whose averaging interval follows the learning rate and the loss."""

    name = "adaptive_localsgd"
    config = AdaptiveLocalSGDConfig
    paddle_name = "AdaptiveLocalSGDOptimizer"
    requires = (DataParallelStrategy,)
    conflicts = (LocalSGDStrategy,)

    def can_apply(self, plan_input: PlanInput) -> Verdict:
        failed = check_local_sgd(plan_input)
        if failed is not None:
            return failed
        cfg = self.strategy.typed_config("adaptive_localsgd")
        return Verdict.ok(f"gradient all-reduce for steps 1..{cfg.begin_step}, then a parameter "
                          f"average every k steps, k = ceil(sqrt(lr0*loss/(lr*loss0)*"
                          f"{cfg.init_k_steps})) in [1, {MAX_K_STEPS}]")

    def apply(self, ctx: TrainingContext) -> None:
        cfg = self.strategy.typed_config("adaptive_localsgd")
        schedule = AdaptiveInterval(cfg.init_k_steps, cfg.begin_step)
        ctx.state[self.name] = schedule
        sync_in_warmup(ctx, schedule.in_warmup)
        latest: dict[str, Any] = {}
        ctx.loss_listeners.append(lambda loss: latest.__setitem__("loss", loss.detach()))

        def after_step() -> None:
            due = schedule.advance()
            if due:
                average(model_parameters(ctx))
            if schedule.needs_loss():
                lr = float(ctx.optimizer.param_groups[0]["lr"])
                schedule.observe(lr, _mean_loss(latest.get("loss")))

        ctx.after_step.append(after_step)
        # as under localsgd, the ranks differ between averages: average_parameters() ends that
        ctx.optimizer_methods["average_parameters"] = lambda: average(model_parameters(ctx))


def _mean_loss(loss: Any) -> float:
    """The loss averaged over ranks (one all-reduce of one number)."""
    if loss is None:
        raise RuntimeError("adaptive_localsgd needs the loss of each step: train with "
                           "optimizer.minimize(loss) or optimizer.backward(loss)")
    value = loss.detach().float().reshape(1).clone()
    dist.all_reduce(value)
    return float(value.item()) / dist.get_world_size()
