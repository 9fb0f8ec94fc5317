"""A trial: a few real training steps of one plan on copies of the user's model and optimizer.

``strategy.auto`` measures its candidate plans through :func:`run_trial`, which the engine puts
on the training context (``ctx.trial``). A trial plans and applies the candidate exactly as
``fleet.distributed_model`` / ``distributed_optimizer`` would (:func:`apply_plan`), wraps the
copies in the same :class:`DistributedModel` / :class:`DistributedOptimizer`, and runs the user's
batch through them with a surrogate loss (the mean of every floating output), so the step does
the work of a training step without the user's loss function. The user's objects are never
touched.
"""
from __future__ import annotations

import copy
import gc
import statistics
import time
import warnings
from typing import Any, Optional

import torch

from fleetx.fleet.model import DistributedModel
from fleetx.fleet.optimizer import DistributedOptimizer
from fleetx.strategy.algorithms.auto import Measurement, held_bytes
from fleetx.strategy.api import Plan, TrainingContext, WorldInfo, registered
from fleetx.strategy.measured import SavedForBackward
from fleetx.strategy.planner import make_plan, plan_for

__all__ = ["apply_plan", "run_trial", "TRIAL_STEPS"]

# One untimed step (first-call allocations, DDP's bucket rebuild), then the timed ones; the
# median resists one slow step on a shared machine.
WARMUP_STEPS, TRIAL_STEPS = 1, 5


def apply_plan(plan: Plan, strategy: Any, world: WorldInfo, model: Optional[torch.nn.Module],
               optimizer: Optional[torch.optim.Optimizer], trial: Any = None,
               replan: Any = None) -> TrainingContext:
    """A training context with every applied strategy of ``plan`` installed, in order
    (``trial``, ``replan`` and the planner: the engine's seams for ``auto``, set before any
    ``apply``)."""
    ctx = TrainingContext(world, strategy, optimizer, model)
    ctx.trial, ctx.replan, ctx.planner = trial, replan, make_plan
    for name in plan.applied:
        registered(name)(strategy).apply(ctx)
    return ctx


def _surrogate_loss(output: Any) -> torch.Tensor:
    """The sum over the floating tensors of ``output`` (nested in tuples, lists, dicts) of their
    mean: a scalar that reaches every output, with gradients of a sane size.

    Raises:
        ValueError: the output holds no floating tensor that requires grad.
    """
    found: list[torch.Tensor] = []

    def walk(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            if value.is_floating_point() and value.requires_grad:
                found.append(value.float().mean())
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)

    walk(output)
    if not found:
        raise ValueError("auto: the model's output holds no floating tensor that requires grad, "
                         "so no training step can be measured")
    return torch.stack(found).sum()


def _sync(world: WorldInfo) -> None:
    if world.device == "cuda":
        torch.cuda.synchronize()


def _step(world: WorldInfo, model: DistributedModel, opt: DistributedOptimizer, args: tuple,
          kwargs: dict) -> tuple[float, int, int]:
    """One training step: (seconds, state bytes after backward, bytes saved for backward)."""
    _sync(world)
    start = time.perf_counter()
    with SavedForBackward(model.parameters()) as saved:
        loss = _surrogate_loss(model(*args, **kwargs))
    opt.backward(loss)
    state = held_bytes(model.module, opt.inner)  # gradients are still held here
    opt.step()
    opt.zero_grad()
    _sync(world)
    return time.perf_counter() - start, state, saved.bytes


def run_trial(world: WorldInfo, strategy: Any, model: torch.nn.Module,
              optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> Measurement:
    """Measure ``strategy``'s plan on copies of ``model`` and ``optimizer`` with this batch.

    Every rank must call it with the same strategy (the steps communicate). An out-of-memory
    error is returned as the measurement's ``error``; any other error propagates.
    """
    model_copy, opt_copy = copy.deepcopy((model, optimizer))  # one memo: the optimizer keeps
    # pointing at the copied model's parameters
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the candidate's plan notices are not the user's
            plan = plan_for(strategy, world, model_copy, opt_copy)
            ctx = apply_plan(plan, strategy, world, model_copy, opt_copy)
        wrapped = DistributedModel(model_copy, lambda: ctx)
        wrapped.train()
        opt = DistributedOptimizer(ctx)
        times, state, saved = [], 0, 0
        for step in range(WARMUP_STEPS + TRIAL_STEPS):
            seconds, state_now, saved_now = _step(world, wrapped, opt, args, kwargs)
            state, saved = max(state, state_now), max(saved, saved_now)
            if step >= WARMUP_STEPS:
                times.append(seconds)
        return Measurement(statistics.median(times), state, saved,
                           spread=max(times) - min(times))
    except torch.OutOfMemoryError as err:
        return Measurement(float("inf"), 0, 0, f"out of memory: {str(err).splitlines()[0]}")
    finally:
        del model_copy, opt_copy
        gc.collect()
        if world.device == "cuda":
            torch.cuda.empty_cache()
