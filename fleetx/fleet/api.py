"""The fleet package's contract: the errors its modules share and users catch, and the default
:class:`~fleetx.fleet.fleet.Fleet`.

The default fleet is the one process-wide object of the package: the module-level functions
(``fleet.init``, ``fleet.distributed_model``...) are its bound methods. ``fleetx/fleet/__init__.py``
builds it and registers it here, once, at import; a :class:`~fleetx.fleet.util.UtilBase` or a
:class:`~fleetx.fleet.ps_util.DistributedInfer` built without a fleet serves it (Paddle's
``fleet.utils.DistributedInfer(...)`` takes no fleet). Those modules sit below the package's
``__init__``, so they read it here rather than from the package.
"""
from typing import Any, Optional

__all__ = ["FleetError", "RuntimeHandlerError", "default_fleet", "set_default_fleet"]

_default: Optional[Any] = None  # the Fleet behind the module-level functions


class FleetError(RuntimeError):
    """The fleet API was used out of order (e.g. before ``fleet.init``)."""


class RuntimeHandlerError(FleetError, ValueError):
    """``init_worker`` and the other runtime calls before a runtime exists. A ``ValueError`` as
    in Paddle ("Fleet can not find suitable runtime handler"), and a :class:`FleetError`."""


def set_default_fleet(fleet: Any) -> None:
    """Register the default fleet (``fleetx/fleet/__init__.py`` does, at import).

    Args:
        fleet: the :class:`~fleetx.fleet.fleet.Fleet` behind the module-level functions.
    """
    global _default
    _default = fleet


def default_fleet() -> Any:
    """The default fleet, the one behind the module-level functions.

    Raises:
        FleetError: none is registered (only before ``fleetx.fleet`` has finished importing).
    """
    if _default is None:
        raise FleetError("the default fleet does not exist yet: import fleetx.fleet first")
    return _default
