"""LARS, layer-wise adaptive rate scaling (``strategy.lars``).

For very large batches: each layer's step is scaled by a *local learning rate*
``lars_coeff * ||w|| / (||g|| + lars_weight_decay * ||w|| + epsilon)``, so that no layer's update
is large relative to its weights (You et al., "Large Batch Training of Convolutional Networks").
It replaces a Momentum optimizer. Layers named in ``exclude_from_weight_decay`` get no weight
decay.

How it maps onto PyTorch: the user's ``torch.optim.SGD`` (with ``momentum > 0``) is replaced by
:class:`fleetx.optim.LarsMomentum` over the same parameter groups, learning rate and momentum.
Parameters whose ``named_parameters()`` name (in the model given to ``distributed_model``)
contains an entry of ``exclude_from_weight_decay`` go into groups of their own with
``lars_weight_decay = 0``, which, as in Paddle, also leaves them unscaled (plain momentum).
"""
from __future__ import annotations

from dataclasses import dataclass
from fleetx.optim import LarsMomentum, check_exclusions, split_groups
from fleetx.strategy.algorithms.adaptive_localsgd import AdaptiveLocalSGDStrategy
from fleetx.strategy.algorithms.data_parallel import DataParallelStrategy
from fleetx.strategy.algorithms.localsgd import LocalSGDStrategy
from fleetx.strategy.api import Mode, PlanInput, Strategy, TrainingContext, Verdict, register
from fleetx.strategy.config import Config, option

__all__ = ["LarsConfig", "LarsStrategy"]


@dataclass
class LarsConfig(Config):
    """``strategy.lars_configs``: trust coefficient, weight decay and exclusions.

    Example:
        >>> LarsConfig(exclude_from_weight_decay=["batch_norm", ".b_0"]).lars_coeff
        0.001
    """

    section = "lars_configs"

    lars_coeff: float = option(0.001, "Trust coefficient of the local learning rate.", gt=0)
    lars_weight_decay: float = option(0.0005, "Weight decay inside the LARS update.", ge=0)
    epsilon: float = option(0.0, "Added to the denominator for numerical stability.", ge=0)
    exclude_from_weight_decay: list[str] = option(
        [], "Parameters whose name contains one of these get no weight decay (and, as in "
            "Paddle, no layer-wise scaling).")


@register
class LarsStrategy(Strategy):
    """Replace the Momentum optimizer by LARS momentum."""

    name = "lars"
    config = LarsConfig
    paddle_name = "LarsOptimizer"
    # No data dependency: listed after the data-parallel engine and after local SGD, which
    # decides which steps are synchronised, as the other strategies acting on the step are.
    runs_after = (DataParallelStrategy, LocalSGDStrategy, AdaptiveLocalSGDStrategy)

    def can_apply(self, plan_input: PlanInput) -> Verdict:
        if plan_input.world.mode is not Mode.COLLECTIVE:
            return Verdict.fail("runs in collective mode only")
        opt = plan_input.optimizer
        if opt.class_name and opt.class_name != "SGD":
            return Verdict.fail(f"needs the inner optimizer to be Momentum (torch.optim.SGD with "
                                f"momentum > 0), got {opt.class_name}")
        if opt.class_name:
            problems = [text for bad, text in (
                (not opt.get("momentum", 0) > 0, "momentum > 0"),
                (bool(opt.get("nesterov", False)), "nesterov=False"),
                (opt.get("dampening", 0) != 0, "dampening=0"),
                (opt.get("weight_decay", 0) != 0,
                 "weight_decay=0 (LARS applies lars_weight_decay itself)")) if bad]
            if problems:
                return Verdict.fail("needs torch.optim.SGD with " + ", ".join(problems))
        cfg = self.strategy.typed_config("lars")
        reason = check_exclusions(cfg.exclude_from_weight_decay, plan_input.model.param_names)
        if reason:
            return Verdict.fail(reason)
        return Verdict.ok(f"SGD momentum replaced by LARS momentum (lars_coeff="
                          f"{cfg.lars_coeff:g}, lars_weight_decay={cfg.lars_weight_decay:g})")

    def apply(self, ctx: TrainingContext) -> None:
        if ctx.optimizer is None:
            return
        cfg = self.strategy.typed_config("lars")
        inner = ctx.optimizer
        groups = split_groups(inner, ctx.model, cfg.exclude_from_weight_decay,
                              "lars_weight_decay", cfg.lars_weight_decay)
        keep = ("params", "lr", "initial_lr", "momentum", "lars_weight_decay")
        ctx.optimizer = LarsMomentum(
            [{k: v for k, v in g.items() if k in keep} for g in groups],
            lr=float(inner.defaults["lr"]), momentum=float(inner.defaults["momentum"]),
            lars_coeff=cfg.lars_coeff, lars_weight_decay=cfg.lars_weight_decay,
            epsilon=cfg.epsilon)
