"""Server-side update rules: how a row (weights + optimizer state) absorbs a gradient.

A rule owns the layout of the state columns that follow a row's ``dim`` weights and applies
its update to many rows at once through :mod:`fleetx.ps.kernels`. The arithmetic is
torch.optim's (same names, same order of operations), so a table trained on the servers
matches the same optimizer run locally; the tests compare against torch at 1e-6.

Sparse rows keep their own step counter, so Adam's bias correction is per row: a row first
touched at step 1000 is corrected as a fresh parameter, as torch would do for a tensor that
starts receiving gradients then (Paddle's ``SparseAdamSGDRule`` keeps per-row beta powers for
the same reason). Dense tables are one row of width ``numel``, so their step is the job's.

Example:
    >>> import numpy as np
    >>> from fleetx.ps.api import RuleConfig
    >>> rule = make_rule(RuleConfig("sgd", lr=0.5))
    >>> slab = np.ones((1, rule.width(2)), np.float32)
    >>> rule.apply(slab, np.array([0]), np.ones((1, 2), np.float32), 2)
    >>> slab.tolist()
    [[0.5, 0.5]]
"""
from __future__ import annotations

from typing import Callable, ClassVar

import numpy as np

from fleetx.ps import kernels
from fleetx.ps.api import PSConfigError, RuleConfig

__all__ = ["Rule", "SGDRule", "AdagradRule", "AdamRule", "SumRule", "make_rule"]


class Rule:
    """Base class: ``width(dim)`` columns per row, ``init_state`` for new rows, ``apply``."""

    name: ClassVar[str]

    def __init__(self, config: RuleConfig) -> None:
        self.config = config

    @property
    def lr(self) -> float:
        return self.config.lr

    def set_lr(self, lr: float) -> None:
        """Change the learning rate from the next update on (``fleet.set_lr``)."""
        self.config = self.config.with_lr(lr)

    def state_width(self, dim: int) -> int:
        return 0

    def width(self, dim: int) -> int:
        """Floats per row: the weights, then the optimizer state."""
        return dim + self.state_width(dim)

    def init_state(self, state: np.ndarray, dim: int) -> None:
        """Fill the state columns of freshly created rows (``state`` is a writable view)."""
        state[:] = 0.0

    def apply(self, slab: np.ndarray, rows: np.ndarray, grads: np.ndarray, dim: int) -> None:
        """Update ``slab[rows]`` in place with ``grads`` (``(len(rows), dim)`` float32; ``rows``
        unique)."""
        raise NotImplementedError


class SGDRule(Rule):
    """torch.optim.SGD: weight decay, momentum (dampening 0) and Nesterov."""

    name = "sgd"

    def state_width(self, dim: int) -> int:
        return dim if self.config.momentum > 0 else 0

    def apply(self, slab, rows, grads, dim):
        c = self.config
        kernels.apply_sgd(slab, rows, grads, dim, c.lr, c.weight_decay, c.momentum, c.nesterov)


class AdagradRule(Rule):
    """torch.optim.Adagrad (lr_decay 0): one sum of squares per element."""

    name = "adagrad"

    def state_width(self, dim: int) -> int:
        return dim

    def init_state(self, state, dim):
        state[:] = self.config.initial_accumulator_value

    def apply(self, slab, rows, grads, dim):
        c = self.config
        kernels.apply_adagrad(slab, rows, grads, dim, c.lr, c.weight_decay, c.eps)


class AdamRule(Rule):
    """torch.optim.Adam / AdamW: first and second moments plus a step counter per row."""

    name = "adam"

    def state_width(self, dim: int) -> int:
        return 2 * dim + 1

    def apply(self, slab, rows, grads, dim):
        c = self.config
        kernels.apply_adam(slab, rows, grads, dim, c.lr, c.betas[0], c.betas[1], c.eps,
                           c.weight_decay, c.decoupled_weight_decay)


class SumRule(Rule):
    """GEO: the pushed value is a parameter delta, added as is (the learning rate is unused)."""

    name = "sum"

    def apply(self, slab, rows, grads, dim):
        kernels.apply_sum(slab, rows, grads, dim)


_RULES: dict[str, Callable[[RuleConfig], Rule]] = {
    cls.name: cls for cls in (SGDRule, AdagradRule, AdamRule, SumRule)}


def make_rule(config: RuleConfig) -> Rule:
    """The rule object for ``config``.

    Raises:
        PSConfigError: no rule is registered under ``config.name``.
    """
    try:
        return _RULES[config.name](config)
    except KeyError:
        raise PSConfigError(f"no update rule named {config.name!r}; known: "
                          f"{', '.join(sorted(_RULES))}") from None
