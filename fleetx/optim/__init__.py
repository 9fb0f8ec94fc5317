"""Optimizers Fleet has and PyTorch does not, and the base of optimizer wrappers.

What it offers:

* :class:`LarsMomentum` and :class:`Lamb`, for very large batches: plain ``torch.optim.Optimizer``
  subclasses (usable without fleetx) whose updates are Paddle's ``lars_momentum`` and ``lamb``
  kernels; the ``lars`` and ``lamb`` strategies build them from the user's Momentum
  (``torch.optim.SGD``) or Adam optimizer;
* :func:`split_groups` / :func:`check_exclusions`: ``exclude_from_weight_decay`` by parameter
  name, with each optimizer's own matching rule (:func:`contains` for LARS, :func:`ends_with`
  for LAMB, as in Paddle);
* ``wrapper.OptimizerWrapper``: the base of optimizers that hold another by composition (the
  fleet's distributed optimizer, DGC's, the parameter-server one).

What it may import: torch and its own modules; no other fleetx package.

Invariants:

* an optimizer here keeps its state in ``state`` / ``param_groups`` like any torch optimizer,
  so ``state_dict`` round-trips and learning-rate schedulers work unchanged;
* a wrapper's groups, state and defaults *are* the inner optimizer's (never a copy);
* updates match the Paddle kernels they follow to rounding, in float64
  (``tests/unit/test_paddle_reference.py``).
"""
from fleetx.optim.groups import check_exclusions, contains, ends_with, split_groups
from fleetx.optim.lamb import Lamb
from fleetx.optim.lars import LarsMomentum

__all__ = ["LarsMomentum", "Lamb", "check_exclusions", "contains", "ends_with", "split_groups"]
