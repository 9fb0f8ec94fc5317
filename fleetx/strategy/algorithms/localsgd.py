"""Local SGD (``strategy.localsgd``).

Each worker takes optimizer steps on its own data without communicating and, every ``k_steps``
steps, the workers average their parameters. Until ``begin_step`` they average every step (the
"post-local SGD" warm-up), which keeps the early, noisy phase of training synchronous. It trades
a little accuracy for far less communication and works with SGD and Momentum.

How it maps onto PyTorch. Steps are counted from 1, as in Paddle:

* steps ``1 .. begin_step`` synchronise through DDP's gradient all-reduce, so every rank holds
  one shared velocity. Paddle averages the parameters after each step instead and keeps a velocity
  per rank. For SGD and Momentum the update is linear in the gradient, so the *parameters* are the
  same either way (the shared velocity is the mean of Paddle's per-rank ones); the velocities are
  not, and the local steps after ``begin_step`` start from different momentum, so the two differ
  from then on. fleetx keeps the gradient average on purpose: each rank enters the local phase
  with the velocity of data-parallel training, and DDP's all-reduce overlaps with backward (see
  ``docs/differences.md``).
* after ``begin_step`` the model runs under ``no_sync`` (no gradient communication) and, after
  steps ``begin_step + k_steps``, ``begin_step + 2 * k_steps``..., the parameters are averaged
  with ``torch.distributed.algorithms.model_averaging.utils.average_parameters`` (one flat
  all-reduce). Every parameter is averaged: PyTorch's ``PeriodicModelAverager`` skips parameters
  whose ``.grad`` is None at that moment, which would leave ranks apart.
* the ranks hold different parameters between two averages, also after the last step: call
  ``optimizer.average_parameters()`` on every rank before saving or evaluating (it averages them
  once more; rank 0 alone would otherwise save a model no average ever saw).
* ``k_steps = 1`` is plain data parallel (averaging every step costs no less than DDP's gradient
  all-reduce, and gives the same parameters), so nothing changes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch
from fleetx.comm import heal

from fleetx.strategy.algorithms.data_parallel import DataParallelStrategy, refuse_split_model
from fleetx.strategy.api import Mode, PlanInput, Strategy, TrainingContext, Verdict, register
from fleetx.strategy.config import Config, option

__all__ = ["LocalSGDConfig", "LocalSGDStrategy", "check_local_sgd", "model_parameters"]


@dataclass
class LocalSGDConfig(Config):
    """``strategy.localsgd_configs``: the averaging interval and when it starts.

    Example:
        >>> LocalSGDConfig(k_steps=4).begin_step
        1
    """

    section = "localsgd_configs"

    k_steps: int = option(1, "Local steps between two parameter averagings.", ge=1)
    begin_step: int = option(1, "Step from which local steps start (sync every step before).",
                             ge=1)


def check_local_sgd(plan_input: PlanInput) -> Optional[Verdict]:
    """The preconditions local SGD and adaptive local SGD share; None when all hold."""
    world, opt = plan_input.world, plan_input.optimizer
    if world.mode is not Mode.COLLECTIVE:
        return Verdict.fail("runs in collective mode only")
    if world.world_size <= 1:
        return Verdict.skip("one process: no parameters to average", warn=True)
    split = refuse_split_model(plan_input, "it averages the parameters over every process of "
                               "the world")
    if split is not None:
        return split
    if opt.class_name and opt.class_name != "SGD":
        return Verdict.fail(f"needs the inner optimizer to be SGD or Momentum (torch.optim.SGD), "
                            f"got {opt.class_name}: parameter averaging only matches data "
                            f"parallel for updates linear in the gradient")
    return None


def model_parameters(ctx: TrainingContext) -> list[torch.nn.Parameter]:
    """The parameters to average: the model's (every rank lists them in the same order), or the
    optimizer's when no model was given to ``distributed_model``."""
    if ctx.model is not None:
        return list(ctx.model.parameters())
    return [p for g in ctx.optimizer.param_groups for p in g["params"]]


def average(params: Iterable[torch.nn.Parameter]) -> None:
    """Average ``params`` over the default process group, in place, with one flat all-reduce
    (under ``fleetrun --fault_tolerance heal``, over the live ranks, healing on a failure)."""
    heal.average_parameters(list(params))


@dataclass
class LocalSGDState:
    """Steps taken so far and the last step that averaged (saved with the optimizer)."""

    k_steps: int
    begin_step: int
    step: int = 0
    syncs: int = 0

    def in_warmup(self) -> bool:
        """Whether the *next* step is one of ``1 .. begin_step`` (synchronised by DDP)."""
        return self.step < self.begin_step

    def advance(self) -> bool:
        """Count a step; True when the parameters are to be averaged after it."""
        self.step += 1
        due = self.step > self.begin_step and (self.step - self.begin_step) % self.k_steps == 0
        self.syncs += int(due)
        return due

    def state_dict(self) -> dict:
        return {"step": self.step, "syncs": self.syncs}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.syncs = int(state["step"]), int(state.get("syncs", 0))


def sync_in_warmup(ctx: TrainingContext, in_warmup: Callable[[], bool]) -> None:
    """Let DDP synchronise gradients only while ``in_warmup()`` holds."""
    previous = ctx.sync_gradients
    ctx.sync_gradients = lambda: in_warmup() and previous()


@register
class LocalSGDStrategy(Strategy):
    """DDP until ``begin_step``, then local steps and a parameter average every ``k_steps``."""

    name = "localsgd"
    config = LocalSGDConfig
    paddle_name = "LocalSGDOptimizer"
    requires = (DataParallelStrategy,)

    def can_apply(self, plan_input: PlanInput) -> Verdict:
        failed = check_local_sgd(plan_input)
        if failed is not None:
            return failed
        cfg = self.strategy.typed_config("localsgd")
        if cfg.k_steps == 1:
            return Verdict.ok("k_steps=1: every step synchronises through DDP's gradient "
                              "all-reduce (the same parameters as averaging every step)")
        return Verdict.ok(f"gradient all-reduce for steps 1..{cfg.begin_step}, then local steps "
                          f"and a parameter average every {cfg.k_steps} steps; call "
                          f"optimizer.average_parameters() on every rank before saving")

    def apply(self, ctx: TrainingContext) -> None:
        cfg = self.strategy.typed_config("localsgd")
        if cfg.k_steps == 1:
            return
        state = LocalSGDState(cfg.k_steps, cfg.begin_step)
        ctx.state[self.name] = state
        sync_in_warmup(ctx, state.in_warmup)

        def after_step() -> None:
            if state.advance():
                average(model_parameters(ctx))

        ctx.after_step.append(after_step)
        # Between averages (and after the last step) the ranks' parameters differ; the
        # optimizer wrapper's average_parameters() ends that, e.g. before a save.
        ctx.optimizer_methods["average_parameters"] = lambda: average(model_parameters(ctx))
