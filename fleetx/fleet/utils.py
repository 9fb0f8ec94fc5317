"""``fleet.utils``, the module of Paddle 2.2 (not ``fleet.util``, the :class:`UtilBase` instance
of host-side collectives): its ``recompute(function, *args, **kwargs)``.

Example:
    >>> from fleetx import fleet
    >>> y = fleet.utils.recompute(block, x)  # block's activations are recomputed in backward
"""
from fleetx.strategy.recompute import recompute

__all__ = ["recompute"]
