"""LAMB, layer-wise adaptive moments (``strategy.lamb``).

For very large batches with Adam: the Adam update of each layer is rescaled by the ratio of the
layer's weight norm to the update's norm (You et al., "Large Batch Optimization for Deep
Learning: Training BERT in 76 minutes"). It replaces an Adam optimizer. Parameters named in
``exclude_from_weight_decay`` get no weight decay and, as in Paddle, no trust ratio.

How it maps onto PyTorch: the user's ``torch.optim.Adam`` or ``AdamW`` is replaced by
:class:`fleetx.optim.Lamb` over the same parameter groups, with its learning rate, betas and eps.
Parameters whose ``named_parameters()`` name (in the model given to ``distributed_model``)
ends with an entry of ``exclude_from_weight_decay`` (Paddle's LAMB rule: a suffix, not a
substring as for LARS) go into groups of their own with ``lamb_weight_decay = 0``, which Paddle's
kernel updates with plain bias-corrected Adam (``w -= lr * r``, no trust ratio) unless
``always_adapt`` is set.
"""
from __future__ import annotations

from dataclasses import dataclass

from fleetx.optim import Lamb, check_exclusions, ends_with, split_groups
from fleetx.strategy.algorithms.data_parallel import DataParallelStrategy
from fleetx.strategy.api import Mode, PlanInput, Strategy, TrainingContext, Verdict, register
from fleetx.strategy.config import Config, option

__all__ = ["LambConfig", "LambStrategy"]


@dataclass
class LambConfig(Config):
    """``strategy.lamb_configs``: weight decay and exclusions.

    Example:
        >>> LambConfig(exclude_from_weight_decay=["layer_norm"]).lamb_weight_decay
        0.01
    """

    section = "lamb_configs"

    lamb_weight_decay: float = option(0.01, "Weight decay inside the LAMB update.", ge=0)
    exclude_from_weight_decay: list[str] = option(
        [], "Parameters whose name ends with one of these get no weight decay (and, as in "
            "Paddle, no trust ratio unless always_adapt).")
    always_adapt: bool = option(
        False, "Apply the trust ratio to every parameter, also those without weight decay "
               "(Paddle's lamb kernel attribute; Fleet's meta-optimizer leaves it False).")


@register
class LambStrategy(Strategy):
    """Replace the Adam optimizer by LAMB."""

    name = "lamb"
    config = LambConfig
    paddle_name = "LambOptimizer"
    runs_after = (DataParallelStrategy,)  # no data dependency: listed after the engine

    def can_apply(self, plan_input: PlanInput) -> Verdict:
        if plan_input.world.mode is not Mode.COLLECTIVE:
            return Verdict.fail("runs in collective mode only")
        opt = plan_input.optimizer
        if opt.class_name and opt.class_name not in ("Adam", "AdamW"):
            return Verdict.fail(f"needs the inner optimizer to be Adam (torch.optim.Adam or "
                                f"AdamW), got {opt.class_name}")
        if opt.class_name:
            problems = [text for bad, text in (
                (bool(opt.get("amsgrad", False)), "amsgrad=False"),
                (bool(opt.get("maximize", False)), "maximize=False"),
                (opt.get("weight_decay", 0) != 0,
                 f"weight_decay=0 (got {opt.get('weight_decay')}; LAMB applies "
                 f"lamb_weight_decay itself: put the value in lamb_configs)")) if bad]
            if problems:
                return Verdict.fail(f"needs torch.optim.{opt.class_name} with "
                                    + ", ".join(problems))
        cfg = self.strategy.typed_config("lamb")
        reason = check_exclusions(cfg.exclude_from_weight_decay, plan_input.model.param_names,
                                  ends_with)
        if reason:
            return Verdict.fail(reason)
        return Verdict.ok(f"Adam replaced by LAMB (lamb_weight_decay={cfg.lamb_weight_decay:g})")

    def apply(self, ctx: TrainingContext) -> None:
        if ctx.optimizer is None:
            return
        cfg = self.strategy.typed_config("lamb")
        inner = ctx.optimizer
        groups = split_groups(inner, ctx.model, cfg.exclude_from_weight_decay,
                              "lamb_weight_decay", cfg.lamb_weight_decay, ends_with)
        keep = ("params", "lr", "initial_lr", "betas", "eps", "lamb_weight_decay")
        ctx.optimizer = Lamb(
            [{k: v for k, v in g.items() if k in keep} for g in groups],
            lr=float(inner.defaults["lr"]), betas=tuple(inner.defaults["betas"]),
            eps=float(inner.defaults["eps"]), lamb_weight_decay=cfg.lamb_weight_decay,
            always_adapt=cfg.always_adapt)
