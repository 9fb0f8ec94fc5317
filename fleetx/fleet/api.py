"""The fleet package's errors, which its modules share and users catch."""

__all__ = ["FleetError", "RuntimeHandlerError"]


class FleetError(RuntimeError):
    """The fleet API was used out of order (e.g. before ``fleet.init``)."""


class RuntimeHandlerError(FleetError, ValueError):
    """``init_worker`` and the other runtime calls before a runtime exists. A ``ValueError`` as
    in Paddle ("Fleet can not find suitable runtime handler"), and a :class:`FleetError`."""
