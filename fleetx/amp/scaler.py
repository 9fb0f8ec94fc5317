"""Dynamic loss scaling, with Paddle's rule.

Low-precision gradients underflow to zero when they are small, so the loss is multiplied by a
*scale* before backward and the gradients divided by it before the optimizer step. A step whose
gradients hold inf or nan is skipped. With dynamic scaling the scale then adapts:

* after ``decr_every_n_nan_or_inf`` bad steps *in a row* it is multiplied by ``decr_ratio``
  (never below 1), and the bad-step count starts again;
* after ``incr_every_n_steps`` good steps in a row it is multiplied by ``incr_ratio`` (unless that
  leaves float32's range), and the good-step count starts again;
* a good step resets the bad-step count and a bad step the good-step count.

``torch.amp.GradScaler`` halves on *every* bad step; Paddle waits for several in a row
(``decr_every_n_nan_or_inf``), which is why this scaler is our own.
"""
from __future__ import annotations

from typing import Iterable

import torch

__all__ = ["LossScaler"]

_FLOAT32_MAX = torch.finfo(torch.float32).max
# gradient dtypes torch's fused unscale-and-check kernel takes with a float32 inverse scale
_FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class LossScaler:
    """Loss scale and the counters of Paddle's ``update_loss_scaling`` rule.

    Args:
        init_loss_scaling: the scale at the first step.
        incr_every_n_steps: good steps in a row before the scale grows.
        decr_every_n_nan_or_inf: bad steps in a row before the scale shrinks.
        incr_ratio: growth factor (> 1).
        decr_ratio: shrink factor (in (0, 1)).
        dynamic: adapt the scale; ``False`` keeps ``init_loss_scaling`` (bad steps are still
            skipped).

    Example:
        >>> s = LossScaler(1024.0, incr_every_n_steps=2, decr_every_n_nan_or_inf=1,
        ...                decr_ratio=0.5)
        >>> s.update(found_inf=True); s.scale
        512.0
        >>> s.update(False); s.update(False); s.scale
        1024.0
    """

    def __init__(self, init_loss_scaling: float = 32768.0, incr_every_n_steps: int = 1000,
                 decr_every_n_nan_or_inf: int = 2, incr_ratio: float = 2.0,
                 decr_ratio: float = 0.8, dynamic: bool = True) -> None:
        self.scale = float(init_loss_scaling)
        self.incr_every_n_steps = int(incr_every_n_steps)
        self.decr_every_n_nan_or_inf = int(decr_every_n_nan_or_inf)
        self.incr_ratio = float(incr_ratio)
        self.decr_ratio = float(decr_ratio)
        self.dynamic = bool(dynamic)
        self.good_steps = 0
        self.bad_steps = 0
        self.skipped_steps = 0  # total, for reports

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale`` (what backward runs on)."""
        return loss * self.scale

    def unscale_(self, params: Iterable[torch.Tensor]) -> bool:
        """Divide every gradient by the scale, in place; True when one holds inf or nan."""
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return False
        flags = []
        groups: dict = {}
        for g in grads:
            groups.setdefault((g.device, g.dtype, g.is_sparse), []).append(g)
        for (device, dtype, sparse), group in groups.items():
            if not sparse and dtype in _FUSED_DTYPES:
                # GradScaler's kernel: unscale and look for inf/nan in one pass over the whole
                # group (one launch instead of several per tensor; on a GPU those launches
                # cost more than the arithmetic).
                found = torch.zeros(1, dtype=torch.float32, device=device)
                inv = torch.full((1,), 1.0 / self.scale, dtype=torch.float32, device=device)
                torch._amp_foreach_non_finite_check_and_unscale_(group, found, inv)
                flags.append(found)
                continue
            if not sparse:  # float64: the inverse scale in double, not float32
                torch._foreach_mul_(group, 1.0 / self.scale)
            values = []
            for g in group:
                if sparse:
                    g.mul_(1.0 / self.scale)
                values.append(g.coalesce().values() if sparse else g)
            flags.extend((~torch.isfinite(v).all()).float().reshape(1) for v in values)
        # A single host sync for the whole model.
        first = flags[0].device
        return bool(torch.cat([f.to(first) for f in flags]).any())

    def update(self, found_inf: bool) -> None:
        """Record one step (skipped when ``found_inf``) and adapt the scale."""
        if found_inf:
            self.skipped_steps += 1
        if not self.dynamic:
            return
        if found_inf:
            self.good_steps, self.bad_steps = 0, self.bad_steps + 1
            if self.bad_steps == self.decr_every_n_nan_or_inf:
                self.scale = max(self.scale * self.decr_ratio, 1.0)
                self.bad_steps = 0
        else:
            self.good_steps, self.bad_steps = self.good_steps + 1, 0
            if self.good_steps == self.incr_every_n_steps:
                grown = self.scale * self.incr_ratio
                # Paddle keeps the scale in float32: growth past its range is not taken.
                self.scale = grown if grown <= _FLOAT32_MAX else self.scale
                self.good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "bad_steps": self.bad_steps,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.bad_steps = int(state["bad_steps"])
        self.skipped_steps = int(state.get("skipped_steps", 0))

    def __repr__(self) -> str:
        return (f"LossScaler(scale={self.scale:g}, good_steps={self.good_steps}, "
                f"bad_steps={self.bad_steps}, dynamic={self.dynamic})")
