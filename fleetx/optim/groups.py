"""Parameter groups by parameter name: which parameters a weight-decay exclusion list covers.

Paddle's LARS and LAMB exclude parameters from weight decay by name, each with its own rule, kept
here: LARS excludes a parameter whose name *contains* an entry (``name in param_name`` in
``LarsMomentumOptimizer._append_optimize_op``, python/paddle/fluid/optimizer.py in 2.2, today
python/paddle/incubate/optimizer/lars_momentum.py) and LAMB one whose name *ends with*
an entry (``param.name.endswith(name)`` in
python/paddle/distributed/fleet/meta_optimizers/lamb_optimizer.py). Here the names are those of
``model.named_parameters()``.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

__all__ = ["GroupUpdateOptimizer", "check_exclusions", "contains", "ends_with", "split_groups"]

Match = Callable[[str, str], bool]


def contains(pattern: str, name: str) -> bool:
    """LARS's rule: the parameter name contains the entry."""
    return pattern in name


def ends_with(pattern: str, name: str) -> bool:
    """LAMB's rule: the parameter name ends with the entry."""
    return name.endswith(pattern)


def check_exclusions(patterns: Sequence[str], param_names: Sequence[str],
                     match: Match = contains) -> Optional[str]:
    """Why ``exclude_from_weight_decay`` cannot be honoured, or None when it can.

    Every entry must match some parameter name (``match(entry, name)``): Paddle-style names
    (``.b_0``) match nothing in a PyTorch model, and silently decaying every parameter would hide
    that.
    """
    if not patterns:
        return None
    if not param_names:
        return ("exclude_from_weight_decay names parameters of the model: call "
                "fleet.distributed_model(model) before distributed_optimizer")
    unmatched = [p for p in patterns if not any(match(p, name) for name in param_names)]
    if unmatched:
        rule = "ends with" if match is ends_with else "contains"
        return (f"exclude_from_weight_decay entries {unmatched} match no parameter name "
                f"(an entry matches a name that {rule} it; names look like "
                f"{list(param_names[:3])})")
    return None


def split_groups(optimizer: torch.optim.Optimizer, model: Any, patterns: Sequence[str],
                 decay_key: str, decay: float, match: Match = contains) -> list[dict]:
    """The optimizer's parameter groups, each split into a decayed group (``decay_key: decay``)
    and an excluded one (``decay_key: 0.0``, for names that ``match`` an entry); empty groups are
    dropped."""
    names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}

    def excluded(p: torch.Tensor) -> bool:
        name = names.get(id(p), "")
        return any(match(pattern, name) for pattern in patterns)

    groups = []
    for group in optimizer.param_groups:
        options = {k: v for k, v in group.items() if k != "params"}
        for value, keep in ((decay, False), (0.0, True)):
            params = [p for p in group["params"] if excluded(p) == keep]
            if params:
                groups.append(dict(options, params=params, **{decay_key: value}))
    return groups


class GroupUpdateOptimizer(torch.optim.Optimizer):
    """An optimizer whose step updates, group by group, the parameters that have a gradient;
    subclasses write ``_update(group, params)``."""

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                self._update(group, params)
        return loss

    def _update(self, group: dict, params: list) -> None:
        raise NotImplementedError
