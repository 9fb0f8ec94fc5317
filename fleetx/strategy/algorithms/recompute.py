"""Recompute, also called activation checkpointing (``strategy.recompute``).

A named sub-module keeps only its input during the forward; the activations inside it are
dropped and recomputed when the backward reaches it. Memory saved for backward falls, at the
cost of a second forward of each named module. The engine is ``torch.utils.checkpoint`` in its
non-reentrant form (``use_reentrant=False``) with the RNG state preserved, so a dropout inside a
named module draws the same mask on recomputation and the gradients equal those of a run
without recompute.

How Paddle's settings map: Paddle cuts the static graph at checkpoint *variables*; a PyTorch
model has no variable names, so ``recompute_configs["checkpoints"]`` lists qualified names of
sub-modules as ``model.named_modules()`` spells them (``"blocks.0"``, ``"encoder.layers.3"``).
Each one's forward is replaced, on the instance, by a checkpointed call of its class's forward
(parameters, buffers and ``state_dict`` keys are unchanged). A name that matches no module is an
error naming it and the closest names. ``enable_offload`` (keep the kept inputs in host memory
on GPU) and ``checkpoint_shape`` (Paddle's common shape of offloaded checkpoints) are accepted
and declared without effect: on CPU the inputs are in host memory already; GPU offload is not
implemented.

The functional form of Paddle 2.2, ``fleet.utils.recompute(function, *args, **kwargs)``, is
:func:`recompute` here.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.utils import checkpoint as torch_checkpoint

from fleetx.strategy.algorithms.data_parallel import DataParallelStrategy
from fleetx.strategy.algorithms.sync_batch_norm import SyncBatchNormStrategy
from fleetx.strategy.api import Mode, PlanInput, Strategy, TrainingContext, Verdict, register
from fleetx.strategy.config import Config, option

__all__ = ["RecomputeConfig", "RecomputeStrategy", "recompute", "checkpoint_modules",
           "unknown_modules"]


@dataclass
class RecomputeConfig(Config):
    """``strategy.recompute_configs``: which sub-modules to recompute, and offload.

    Example:
        >>> RecomputeConfig(checkpoints=["blocks.0", "blocks.1"]).enable_offload
        False
    """

    section = "recompute_configs"

    checkpoints: list[str] = option(
        [], "Qualified names of sub-modules (as in model.named_modules()) recomputed in "
            "backward; empty disables recompute.")
    enable_offload: bool = option(
        False, "Also move the kept inputs to host memory.",
        no_effect="offload is not implemented: on CPU the kept inputs are in host memory "
                  "already, on GPU they stay in GPU memory")
    checkpoint_shape: list[int] = option(
        [], "The common shape of all checkpoints; Paddle needs it only with offload.", ge=1,
        no_effect="module inputs are kept with their own shapes")


def recompute(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``function(*args)`` keeping only its inputs; recompute it in backward (Paddle 2.2's
    ``fleet.utils.recompute``).

    Args:
        function: a module or function of tensors.
        *args: its positional arguments.
        **kwargs: only ``preserve_rng_state`` (default True: dropout draws the same mask when
            recomputed), as in Paddle.

    Raises:
        ValueError: another keyword argument (Paddle passes none to the function).

    Example:
        >>> block, x = nn.Sequential(nn.Linear(4, 8), nn.GELU()), torch.ones(2, 4)
        >>> recompute(block, x).shape  # block's activations are not kept for backward
        torch.Size([2, 8])
    """
    preserve = kwargs.pop("preserve_rng_state", True)
    if kwargs:
        raise ValueError("Unexpected keyword arguments: " + ",".join(kwargs)
                         + " (recompute accepts only preserve_rng_state)")
    return torch_checkpoint.checkpoint(function, *args, use_reentrant=False,
                                       preserve_rng_state=bool(preserve))


class _RecomputedForward:
    """The instance-level ``forward`` of a named module: its class's forward, checkpointed.

    A callable object holding the module (not a closure), so ``copy.deepcopy`` and pickling of
    the model carry it over to the copy instead of pointing back at the original.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        forward = type(self.module).forward.__get__(self.module)
        if not torch.is_grad_enabled():  # nothing is saved for backward: run it once
            return forward(*args, **kwargs)
        return torch_checkpoint.checkpoint(forward, *args, use_reentrant=False,
                                           preserve_rng_state=True, **kwargs)


def unknown_modules(known: Sequence[str], names: Sequence[str]) -> str:
    """An error text for the ``names`` not among the module names ``known``; ``""`` if none.

    Example:
        >>> unknown_modules(["0", "1"], ["3"])
        "recompute_configs['checkpoints'] names no module '3' (closest: none); modules of ..."
    """
    known = [name for name in known if name]
    present = set(known)
    missing = [name for name in names if name not in present]
    if not missing:
        return ""
    parts = []
    for name in missing:
        # A name from another nesting ("blocks.1" for "1", "1" for "encoder.1") is the likely
        # slip; spelling neighbours come after.
        close = [k for k in known if name.endswith("." + k) or k.endswith("." + name)]
        close += [c for c in difflib.get_close_matches(name, known, n=3, cutoff=0.3)
                  if c not in close]
        close = close[:3]
        parts.append(f"{name!r} (closest: {', '.join(repr(c) for c in close) or 'none'})")
    listed = ", ".join(known[:12]) + (", ..." if len(known) > 12 else "")
    return (f"recompute_configs['checkpoints'] names no module {'; '.join(parts)}; modules of "
            f"the model (model.named_modules()): {listed or 'none'}")


def checkpoint_modules(model: nn.Module, names: Sequence[str]) -> nn.Module:
    """Make each named sub-module of ``model`` recompute its forward in backward; returns
    ``model`` (changed in place; a module already recomputed is left as it is).

    Raises:
        ValueError: a name matches no sub-module (the message names the closest ones).
    """
    error = unknown_modules([name for name, _ in model.named_modules()], names)
    if error:
        raise ValueError(error)
    modules = dict(model.named_modules())
    for name in names:
        module = modules[name]
        if not isinstance(module.__dict__.get("forward"), _RecomputedForward):
            module.forward = _RecomputedForward(module)
    return model


@register
class RecomputeStrategy(Strategy):
    """Checkpoint the named sub-modules with ``torch.utils.checkpoint`` (non-reentrant)."""

    name = "recompute"
    config = RecomputeConfig
    paddle_name = "RecomputeOptimizer"
    # Names are resolved on the plain model: after SyncBatchNorm swaps its layers (a named
    # batch-norm layer must be the swapped one) and before DDP hides the model under "module.".
    runs_after = (SyncBatchNormStrategy,)
    runs_before = (DataParallelStrategy,)

    def can_apply(self, plan_input: PlanInput) -> Verdict:
        if plan_input.world.mode is not Mode.COLLECTIVE:
            return Verdict.fail("runs in collective mode only")
        names = self.strategy.typed_config("recompute").checkpoints
        if not names:
            return Verdict.skip("recompute_configs['checkpoints'] is empty: no module to "
                                "recompute", warn=True)
        error = unknown_modules(plan_input.model.module_names, names)
        if error and plan_input.model.module_names:  # without the model, checked at wrap time
            return Verdict.fail(error)
        return Verdict.ok(f"torch.utils.checkpoint (non-reentrant, RNG preserved) around "
                          f"{len(names)} module(s): {', '.join(names)}")

    def apply(self, ctx: TrainingContext) -> None:
        names = list(self.strategy.typed_config("recompute").checkpoints)
        ctx.model_wrappers.append(lambda module: checkpoint_modules(module, names))
