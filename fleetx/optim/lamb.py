"""LAMB (You et al., "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes").

For each parameter tensor ``w`` with gradient ``g`` at step ``t`` (Paddle's ``lamb`` rule)::

    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    r = (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps) + weight_decay * w
    trust = ||w|| / ||r||   if (weight_decay > 0 or always_adapt) and ||w|| > 0 and ||r|| > 0
          = 1               otherwise
    w = w - lr * trust * r

A group with ``lamb_weight_decay = 0`` (``exclude_from_weight_decay``) is therefore plain
bias-corrected Adam (``w -= lr * r``): neither decayed nor scaled by a trust ratio, as in Paddle's
``lamb`` kernel (``paddle/phi/kernels/impl/lamb_kernel_impl.h``, whose norms stay 0 unless
``weight_decay > 0 || always_adapt``). ``always_adapt=True`` scales every group.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch

from fleetx.optim.groups import GroupUpdateOptimizer

__all__ = ["Lamb"]


class Lamb(GroupUpdateOptimizer):
    """Adam moments with a layer-wise trust ratio.

    Args:
        params: parameters or parameter groups (a group may set any option below).
        lr: learning rate.
        betas: decay rates of the first and second moments.
        eps: added to the square root of the second moment.
        lamb_weight_decay: decoupled weight decay inside the update.
        always_adapt: apply the trust ratio also where ``lamb_weight_decay`` is 0.

    Raises:
        ValueError: an option out of range.

    Example:
        >>> w = torch.nn.Parameter(torch.ones(3))
        >>> opt = Lamb([w], lr=0.01)
        >>> w.grad = torch.ones(3); opt.step()
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 lamb_weight_decay: float = 0.01, always_adapt: bool = False) -> None:
        if lr < 0 or eps < 0 or lamb_weight_decay < 0:
            raise ValueError(f"Lamb lr, eps and lamb_weight_decay must be >= 0, got {lr}, {eps}, "
                             f"{lamb_weight_decay}")
        if not all(0 <= b < 1 for b in betas):
            raise ValueError(f"Lamb betas must be in [0, 1), got {betas}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                      lamb_weight_decay=lamb_weight_decay,
                                      always_adapt=bool(always_adapt)))

    def _state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def _update(self, group: dict, params: list[torch.Tensor]) -> None:
        grads = [p.grad for p in params]
        if any(g.is_sparse for g in grads):
            raise RuntimeError("Lamb does not support sparse gradients")
        states = [self._state(p) for p in params]
        m = [s["exp_avg"] for s in states]
        v = [s["exp_avg_sq"] for s in states]
        beta1, beta2 = group["betas"]
        torch._foreach_lerp_(m, grads, 1 - beta1)  # m = beta1 m + (1 - beta1) g
        torch._foreach_mul_(v, beta2)
        torch._foreach_addcmul_(v, grads, grads, value=1 - beta2)
        r = []
        for s, mi, vi in zip(states, m, v):
            s["step"] += 1
            t = s["step"]
            denom = (vi / (1 - beta2 ** t)).sqrt_().add_(group["eps"])
            r.append(mi / (1 - beta1 ** t) / denom)
        wd = group["lamb_weight_decay"]
        if wd:
            torch._foreach_add_(r, params, alpha=wd)
        if not (wd > 0 or group.get("always_adapt", False)):
            torch._foreach_mul_(r, -group["lr"])
            torch._foreach_add_(params, r)
            return
        w_norms = torch._foreach_norm(params)
        r_norms = torch._foreach_norm(r)
        steps = [torch.where((wn > 0) & (rn > 0), -group["lr"] * wn / rn,
                             torch.full_like(wn, -group["lr"]))
                 for wn, rn in zip(w_norms, r_norms)]
        torch._foreach_mul_(r, steps)
        torch._foreach_add_(params, r)
