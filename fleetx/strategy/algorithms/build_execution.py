"""``strategy.build_strategy`` and ``strategy.execution_strategy`` in PyTorch terms.

Paddle compiles a static graph with a *build strategy* (fusion and memory passes) and runs it
with an *execution strategy* (executor threads, scope clean-up). PyTorch runs eagerly, so most of
these options have nothing to act on. The fields that have a meaning are mapped; every other
field declares why it has none (``option(..., no_effect=...)`` in ``build.py``) and, when the
user changed it from its default, is listed in the plan with that reason, so a Paddle script
keeps running and says what it lost.

======================================  ========================================================
field                                   in fleetx
======================================  ========================================================
``fuse_all_optimizer_ops``              ``foreach=True`` on every parameter group of the
                                        optimizer, when it has that option (multi-tensor
                                        kernels: one launch for all parameters, same results)
``num_threads`` (execution)             ``torch.set_num_threads(n)`` for n > 1 (0, automatic,
                                        and 1, the default, leave PyTorch's setting alone)
everything else                         no effect (kernel fusion: use ``torch.compile``; memory
                                        reuse and gradient accumulation in place are what
                                        PyTorch does anyway)
======================================  ========================================================
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar

import torch

from fleetx.strategy.api import (OptimizerInfo, PlanInput, Strategy, TrainingContext, Verdict,
                                 register)
from fleetx.strategy.build import BuildStrategy, ExecutionStrategy

__all__ = ["BuildStrategyOptions", "ExecutionStrategyOptions", "changed_fields"]


def changed_fields(bag: Any) -> list[str]:
    """Names of the fields of a build / execution strategy that differ from their defaults."""
    default = type(bag)()
    return [f.name for f in dataclasses.fields(bag)
            if getattr(bag, f.name) != getattr(default, f.name)]


class _BagOptions(Strategy):
    """A strategy for one option bag: maps what it can, lists the rest with their declared
    reason."""

    # Last of all: the options apply to the final optimizer, after every strategy that replaces
    # or wraps it (lars, lamb, dgc, sharding, parameter server) or installs hooks around its
    # step.
    runs_last = True
    # field -> (fn(value, optimizer info) -> what it does, or "" for no effect here); every field
    # not here declares no_effect
    mapped: ClassVar[dict[str, Callable[[Any, OptimizerInfo], str]]] = {}

    @classmethod
    def enabled(cls, strategy: Any) -> bool:
        bag = getattr(strategy, cls.name, None)
        return bag is not None and bool(changed_fields(bag))

    def can_apply(self, plan_input: PlanInput) -> Verdict:
        bag = getattr(plan_input.strategy, self.name)
        done, ignored = [], []
        for name in changed_fields(bag):
            why = type(bag).no_effect_of(name)
            effect = "" if why else self.mapped[name](getattr(bag, name), plan_input.optimizer)
            if effect:
                done.append(f"{name} -> {effect}")
            else:
                ignored.append(f"{name} ({why or 'nothing to act on with this optimizer'})")
        no_op = f"no effect in PyTorch: {', '.join(ignored)}" if ignored else ""
        if not done:
            return Verdict.skip(f"accepted; {no_op}")
        return Verdict.ok("; ".join(done + ([no_op] if no_op else [])))


def _foreach(value: bool, opt: OptimizerInfo) -> str:
    if not value:
        return ""
    if not opt.class_name:
        return "foreach=True where the optimizer has it (decided at distributed_optimizer)"
    if "foreach" not in dict(opt.defaults):
        return ""
    return f"foreach=True on {opt.class_name}"


def _threads(value: int, opt: OptimizerInfo) -> str:
    return f"torch.set_num_threads({value})" if value > 1 else ""


@register
class BuildStrategyOptions(_BagOptions):
    """``strategy.build_strategy``: fuse_all_optimizer_ops -> foreach; the rest listed.

    Example:
        >>> from fleetx.strategy.api import WorldInfo
        >>> from fleetx.strategy.distributed_strategy import DistributedStrategy
        >>> s = DistributedStrategy()
        >>> s.build_strategy = {"fuse_bn_act_ops": True, "enable_inplace": True}
        >>> print(BuildStrategyOptions(s).can_apply(PlanInput(s, WorldInfo())).reason)
        accepted; no effect in PyTorch: fuse_bn_act_ops (kernel fusion: use torch.compile), enable_inplace (memory reuse is PyTorch's own)
    """

    name = "build_strategy"
    config = BuildStrategy
    mapped = {"fuse_all_optimizer_ops": _foreach}

    def apply(self, ctx: TrainingContext) -> None:
        opt = ctx.optimizer
        if (self.strategy.build_strategy.fuse_all_optimizer_ops and opt is not None
                and "foreach" in opt.defaults):
            for group in opt.param_groups:
                group["foreach"] = True


@register
class ExecutionStrategyOptions(_BagOptions):
    """``strategy.execution_strategy``: num_threads -> torch.set_num_threads; the rest listed.

    Example:
        >>> from fleetx.strategy.api import WorldInfo
        >>> from fleetx.strategy.distributed_strategy import DistributedStrategy
        >>> s = DistributedStrategy()
        >>> s.execution_strategy = {"num_threads": 4, "num_iteration_per_drop_scope": 1}
        >>> print(ExecutionStrategyOptions(s).can_apply(PlanInput(s, WorldInfo())).reason)
        num_threads -> torch.set_num_threads(4); no effect in PyTorch: num_iteration_per_drop_scope (no static-graph executor)
    """

    name = "execution_strategy"
    config = ExecutionStrategy
    mapped = {"num_threads": _threads}

    def apply(self, ctx: TrainingContext) -> None:
        threads = self.strategy.execution_strategy.num_threads
        if threads > 1:
            torch.set_num_threads(threads)
