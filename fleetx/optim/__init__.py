"""Optimizers Fleet has and PyTorch does not: LARS momentum and LAMB, for very large batches.

Both are plain ``torch.optim.Optimizer`` subclasses (usable without fleetx); the ``lars`` and
``lamb`` strategies build them from the user's Momentum (``torch.optim.SGD``) or Adam optimizer.
"""
from fleetx.optim.groups import check_exclusions, contains, ends_with, split_groups
from fleetx.optim.lamb import Lamb
from fleetx.optim.lars import LarsMomentum

__all__ = ["LarsMomentum", "Lamb", "check_exclusions", "contains", "ends_with", "split_groups"]
