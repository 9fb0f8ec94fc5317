"""Recompute, also called activation checkpointing (``strategy.recompute``).

A named sub-module keeps only its input during the forward; the activations inside it are
dropped and recomputed when the backward reaches it. Memory saved for backward falls, at the
cost of a second forward of each named module. The engine is ``torch.utils.checkpoint`` in its
non-reentrant form (``use_reentrant=False``) with the RNG state preserved, so a dropout inside a
named module draws the same mask on recomputation and the gradients equal those of a run
without recompute.

How Paddle's settings map: Paddle cuts the static graph at checkpoint *variables*; a PyTorch
model has no variable names, so ``recompute_configs["checkpoints"]`` lists qualified names of
sub-modules as ``model.named_modules()`` spells them (``"blocks.0"``, ``"encoder.layers.3"``),
globs of those names where ``*`` is one name between dots (``"model.layers.*"``), or class names
(``"GPT2Block"``: every module of that class); a module inside another selected one is not
checkpointed twice. Each selected module's forward is replaced, on the instance, by a
checkpointed call of its class's forward (parameters, buffers and ``state_dict`` keys are
unchanged). An entry that selects no module is an
error naming it and the closest names and classes; a model whose own gradient checkpointing is
on (Hugging Face's ``gradient_checkpointing_enable()``) is refused, not checkpointed twice.
``enable_offload`` (keep the kept inputs in host memory on GPU) and ``checkpoint_shape`` (Paddle's common shape of offloaded checkpoints) are accepted
and declared without effect: on CPU the inputs are in host memory already; GPU offload is not
implemented.

The functional form of Paddle 2.2, ``fleet.utils.recompute(function, *args, **kwargs)``, is
:func:`recompute` here.
"""
from __future__ import annotations

import difflib
import fnmatch
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.utils import checkpoint as torch_checkpoint

from fleetx.strategy.algorithms.data_parallel import DataParallelStrategy
from fleetx.strategy.algorithms.sync_batch_norm import SyncBatchNormStrategy
from fleetx.strategy.api import Mode, PlanInput, Strategy, TrainingContext, Verdict, register
from fleetx.strategy.plan import module_class_name
from fleetx.strategy.config import Config, option

__all__ = ["RecomputeConfig", "RecomputeStrategy", "recompute", "checkpoint_modules",
           "select_modules", "own_checkpointing"]


@dataclass
class RecomputeConfig(Config):
    """``strategy.recompute_configs``: which sub-modules to recompute, and offload.

    Example:
        >>> RecomputeConfig(checkpoints=["blocks.0", "blocks.1"]).enable_offload
        False
    """

    section = "recompute_configs"

    checkpoints: list[str] = option(
        [], "Sub-modules recomputed in backward: qualified names (as in model.named_modules()), "
            "globs of names where * is one name ('model.layers.*') or class names "
            "('GPT2Block'); empty disables recompute.")
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


_GLOB_CHARS = frozenset("*?[")


def _is_glob(entry: str) -> bool:
    return any(ch in _GLOB_CHARS for ch in entry)


def _glob_matches(pattern: str, name: str) -> bool:
    """Whether ``name`` matches ``pattern`` segment by segment: ``*`` stands for one name
    between dots, so ``"model.layers.*"`` selects the layers, not the modules inside them."""
    parts, segments = pattern.split("."), name.split(".")
    return len(parts) == len(segments) and all(
        fnmatch.fnmatchcase(seg, part) for part, seg in zip(parts, segments))


def _matches(entry: str, names: Sequence[str], classes: Sequence[str]) -> list[str]:
    """The qualified names one entry selects: itself, its glob's matches, or its class's
    modules (in that order of precedence)."""
    if entry in names:
        return [entry]
    if _is_glob(entry):
        return [name for name in names if _glob_matches(entry, name)]
    return [name for name, cls in zip(names, classes) if cls == entry]


def _outermost(selected: set[str], names: Sequence[str]) -> list[str]:
    """The selected names in model order, without those inside another selected module (a
    checkpoint inside a checkpoint would run its forward three times)."""
    return [name for name in names if name in selected
            and not any(name.startswith(other + ".") for other in selected)]


def _closest(entry: str, names: Sequence[str], classes: Sequence[str]) -> list[str]:
    # A name from another nesting ("blocks.1" for "1", "1" for "encoder.1") is the likely
    # slip; spelling neighbours among names and classes come after.
    stem = entry.replace("*", "")
    close = [k for k in names if entry.endswith("." + k) or k.endswith("." + entry)]
    close += [c for c in difflib.get_close_matches(stem, list(names) + sorted(set(classes)),
                                                   n=3, cutoff=0.3) if c not in close]
    return close[:3]


def select_modules(names: Sequence[str], classes: Sequence[str],
                   entries: Sequence[str]) -> tuple[list[str], str]:
    """The qualified names ``recompute_configs['checkpoints']`` selects, and an error text.

    Args:
        names: every sub-module's qualified name (``model.named_modules()``).
        classes: each one's class name, in the same order (may be empty: names only).
        entries: qualified names (``"blocks.3"``), globs over names, where ``*`` is one name
            between dots (``"model.layers.*"``), or class names (``"GPT2Block"``).

    Returns:
        The selected modules in model order, outermost only, and ``""``, or ``[]`` and a text
        naming each entry that selects nothing with its closest names and classes.

    Example:
        >>> select_modules(["", "h", "h.0", "h.1"], ["Net", "ModuleList", "Block", "Block"],
        ...                ["Block"])
        (['h.0', 'h.1'], '')
    """
    pairs = [(n, c) for n, c in zip(names, list(classes) or [""] * len(names)) if n]
    names = [n for n, _ in pairs]
    classes = [c for _, c in pairs]
    selected: set[str] = set()
    missing = []
    for entry in entries:
        found = _matches(entry, names, classes)
        if not found:
            missing.append(entry)
        selected.update(found)
    if not missing:
        return _outermost(selected, names), ""
    parts = []
    for entry in missing:
        close = ", ".join(repr(c) for c in _closest(entry, names, classes))
        parts.append(f"{entry!r} (closest: {close or 'none'})")
    listed = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
    kinds = list(dict.fromkeys(c for c in classes if c))
    kinds_listed = ", ".join(kinds[:12]) + (", ..." if len(kinds) > 12 else "")
    return [], (f"recompute_configs['checkpoints'] names no module {'; '.join(parts)}; an entry "
                f"is a qualified name, a glob of names ('blocks.*') or a class name; modules of "
                f"the model (model.named_modules()): {listed or 'none'}"
                + (f"; classes: {kinds_listed}" if kinds else ""))


def own_checkpointing(model: nn.Module) -> str:
    """The qualified name of a module whose own gradient checkpointing is on (a Hugging Face
    model's ``activation_checkpointing_enable()``, ``gradient_checkpointing_enable()`` before
    transformers 5, sets ``gradient_checkpointing = True`` on the modules that run it), or
    ``""``."""
    for name, module in model.named_modules():
        if module.__dict__.get("gradient_checkpointing") is True:
            return name or type(model).__name__
    return ""


def checkpoint_modules(model: nn.Module, entries: Sequence[str]) -> nn.Module:
    """Make each sub-module of ``model`` that ``entries`` select recompute its forward in
    backward; returns ``model`` (changed in place; a module already recomputed is left as it is).

    Args:
        model: the plain model.
        entries: qualified names, globs of names or class names (see :func:`select_modules`).

    Raises:
        ValueError: an entry selects no sub-module (the message names the closest names and
            classes), or the model's own gradient checkpointing is on (two checkpoints of one
            block would run its forward three times).

    Example:
        >>> net = checkpoint_modules(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), ["Linear"])
        >>> [type(m.__dict__.get("forward")).__name__ for m in net]
        ['_RecomputedForward', '_RecomputedForward']
    """
    modules = dict(model.named_modules())
    chosen, error = select_modules(list(modules), [module_class_name(m) for m in modules.values()],
                                   entries)
    if error:
        raise ValueError(error)
    owner = own_checkpointing(model)
    if owner:
        raise ValueError(
            f"the model's own gradient checkpointing is on ({owner}.gradient_checkpointing is "
            f"True) and strategy.recompute would checkpoint the same blocks again; use one: "
            f"call model.activation_checkpointing_disable() (gradient_checkpointing_disable() "
            f"before transformers 5) before fleet.distributed_model, or set "
            f"strategy.recompute = False")
    for name in chosen:
        module = modules[name]
        if not isinstance(module.__dict__.get("forward"), _RecomputedForward):
            module.forward = _RecomputedForward(module)
    return model


def _summary(chosen: Sequence[str]) -> str:
    return ", ".join(chosen[:8]) + (f", ... ({len(chosen) - 8} more)" if len(chosen) > 8 else "")


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
        model = plan_input.model
        if not model.module_names:  # without the model, checked at wrap time
            return Verdict.ok(f"torch.utils.checkpoint (non-reentrant, RNG preserved) around "
                              f"the modules {', '.join(names)} select")
        chosen, error = select_modules(model.module_names, model.module_classes, names)
        if error:
            return Verdict.fail(error)
        by = "" if list(names) == chosen else f" selected by {', '.join(names)}"
        return Verdict.ok(f"torch.utils.checkpoint (non-reentrant, RNG preserved) around "
                          f"{len(chosen)} module(s){by}: {_summary(chosen)}")

    def apply(self, ctx: TrainingContext) -> None:
        names = list(self.strategy.typed_config("recompute").checkpoints)
        ctx.model_wrappers.append(lambda module: checkpoint_modules(module, names))
