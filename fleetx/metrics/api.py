"""The contract of ``fleetx.metrics``: what a reducer must offer and which inputs are accepted.

Every metric takes local statistics (numpy arrays, tensors, numbers, or names looked up in a
``scope`` mapping), sums or maxes them over the workers with ``util.all_reduce`` and computes
the value from the global totals. ``util=None`` means ``fleet.util``, read when the metric is
called, so a user who assigns ``fleet.util = MyUtil()`` gets their util here too.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Protocol

import numpy as np

__all__ = ["Reducer", "Gatherer", "MetricError", "resolve_util", "as_array", "all_reduce"]


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


def resolve_util(util: Optional[Reducer]) -> Reducer:
    """``util``, or ``fleet.util`` (looked up now: users may replace it) when it is None."""
    if util is not None:
        return util
    from fleetx import fleet  # late: metrics work with any reducer and need not load the fleet
    return fleet.util


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
