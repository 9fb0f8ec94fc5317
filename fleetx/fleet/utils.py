"""``fleet.utils``, the module of Paddle 2.2 (not ``fleet.util``, the :class:`UtilBase` instance
of host-side collectives): its ``recompute(function, *args, **kwargs)``, and ``ps_util`` with
``DistributedInfer`` (also here, as ``fleet.utils.DistributedInfer``).

Example:
    >>> from fleetx import fleet
    >>> y = fleet.utils.recompute(block, x)  # block's activations are recomputed in backward
    >>> infer = fleet.utils.ps_util.DistributedInfer(model)  # doctest: +SKIP
"""
from fleetx.fleet import ps_util
from fleetx.fleet.ps_util import DistributedInfer
from fleetx.strategy.algorithms.recompute import recompute

__all__ = ["recompute", "ps_util", "DistributedInfer"]
