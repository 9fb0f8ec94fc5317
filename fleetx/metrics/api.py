"""The contract of ``fleetx.metrics``: what a reducer must offer and which inputs are accepted.

Every metric takes local statistics (numpy arrays, tensors, numbers, or names looked up in a
``scope`` mapping), sums or maxes them over the workers with ``util.all_reduce`` and computes
the value from the global totals. ``util=None`` means ``fleet.util``, read when the metric is
called, so a user who assigns ``fleet.util = MyUtil()`` gets their util here too.

That default is process-wide state: :func:`set_default_util` holds how to find ``fleet.util``,
and ``fleetx/fleet/__init__.py`` sets it when it is imported. It exists because Paddle's
``fleet.metrics.auc(...)`` takes no fleet; a call given ``util=`` never reads it.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Protocol

import numpy as np

__all__ = ["Reducer", "Gatherer", "MetricError", "resolve_util", "set_default_util", "as_array",
           "all_reduce"]


class Reducer(Protocol):
    """What a metric needs from ``util``: Fleet's ``all_reduce``.

    ``all_reduce(input, mode)`` returns the element-wise ``"sum"``, ``"max"`` or ``"min"`` of
    ``input`` over every worker, with ``input``'s shape (``fleet.util`` is one).
    """

    def all_reduce(self, input: Any, mode: str = "sum") -> Any: ...


class Gatherer(Reducer, Protocol):
    """A reducer that also offers Fleet's ``all_gather(input)``: every worker's ``input``, in
    rank order (``fleet.util`` is one). Metrics given such a util first exchange a fixed-size
    descriptor of their inputs, so workers that disagree get a :class:`MetricError` instead of a
    collective on mismatched buffers."""

    def all_gather(self, input: Any) -> Any: ...


class MetricError(ValueError):
    """A metric's input is unusable: wrong shape, missing from ``scope``, not finite, or not the
    same kind of input on every worker (the message names the metric, the input and the worker).
    """


# Where ``util=None`` comes from. ``fleetx.fleet`` installs ``lambda: fleet.util`` when it loads
# (it imports metrics, as ``fleet.metrics``): metrics never import the fleet, so the two packages
# form no import cycle, and a process that never loaded the fleet has no default to fall back on.
_default_util: Optional[Callable[[], Reducer]] = None


def set_default_util(provider: Optional[Callable[[], Reducer]]) -> None:
    """Make ``provider()`` the util a metric called with ``util=None`` uses (read at each call,
    so a replaced ``fleet.util`` is seen). ``fleetx.fleet`` calls this when it is imported.

    Args:
        provider: a function returning the reducer, or None to remove the default.
    """
    global _default_util
    _default_util = provider


def resolve_util(util: Optional[Reducer]) -> Reducer:
    """``util``, or ``fleet.util`` (looked up now: users may replace it) when it is None.

    Raises:
        MetricError: ``util`` is None and ``fleetx.fleet`` was never imported.
    """
    if util is not None:
        return util
    if _default_util is None:
        raise MetricError("util=None means fleet.util, but fleetx.fleet is not loaded: "
                          "`from fleetx import fleet` and call fleet.init() first, or pass util=")
    return _default_util()


def as_array(value: Any, scope: Optional[Mapping[str, Any]] = None,
             what: str = "input") -> np.ndarray:
    """``value`` as a numpy array; a string is a name looked up in ``scope``.

    Tensors are detached and copied to the host. Numbers become 0-d arrays.

    Raises:
        MetricError: ``value`` is a name and ``scope`` is None or lacks it.
    """
    if isinstance(value, str):
        if scope is None or value not in scope:
            where = "no scope was given" if scope is None else "it is not in scope"
            raise MetricError(f"{what} names {value!r}, but {where}")
        value = scope[value]
    if hasattr(value, "detach") and hasattr(value, "cpu"):  # a tensor; torch need not be loaded
        value = value.detach().cpu().numpy()
    return np.asarray(value)


def all_reduce(value: np.ndarray, mode: str, util: Reducer) -> np.ndarray:
    """``util.all_reduce(value, mode)`` as a numpy array of ``value``'s shape."""
    return np.asarray(util.all_reduce(value, mode)).reshape(value.shape)
