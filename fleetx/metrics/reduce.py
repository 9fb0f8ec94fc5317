"""Fleet's distributed metrics: global reductions and the values computed from them.

Each function all-reduces its local statistics over the workers and computes the metric from
the global totals, so every worker returns the same value. Signatures follow Fleet's
``f(..., scope=None, util=None)``: ``scope`` is a mapping from names to values (used when an
input is given by name), ``util`` a :class:`~fleetx.metrics.api.Reducer` (default
``fleet.util``). Ratio metrics use only the first element of each reduced array.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Optional

import numpy as np

from fleetx.metrics.agree import checked
from fleetx.metrics.api import MetricError, Reducer, all_reduce, as_array, resolve_util

__all__ = ["sum", "max", "min", "auc", "mae", "mse", "rmse", "acc", "auc_from_histograms"]

Scope = Optional[Mapping[str, Any]]


def _reduced(input: Any, mode: str, scope: Scope, util: Optional[Reducer]) -> np.ndarray:
    # NaN and inf pass through sum/max/min as through any reduction (inf is a fine max start).
    reducer = resolve_util(util)
    [array] = checked(mode, [("input", lambda: as_array(input, scope))], reducer, finite=False)
    return all_reduce(array, mode, reducer)


def sum(input: Any, scope: Scope = None, util: Optional[Reducer] = None) -> np.ndarray:
    """Element-wise sum of ``input`` over all workers, as a numpy array of its shape.

    Example:
        >>> metrics.sum(np.array([[1, 2]]))    # two workers with the same input
        array([[2, 4]])
    """
    return _reduced(input, "sum", scope, util)


def max(input: Any, scope: Scope = None, util: Optional[Reducer] = None) -> np.ndarray:
    """Element-wise maximum of ``input`` over all workers, as a numpy array of its shape."""
    return _reduced(input, "max", scope, util)


def min(input: Any, scope: Scope = None, util: Optional[Reducer] = None) -> np.ndarray:
    """Element-wise minimum of ``input`` over all workers, as a numpy array of its shape."""
    return _reduced(input, "min", scope, util)


def _first(array: np.ndarray) -> float:
    if array.size == 0:
        raise MetricError("expected at least one element, got an empty array")
    return float(array.reshape(-1)[0])


_RATIO_INPUTS = {"mae": ("abserr", "total_ins_num"), "mse": ("sqrerr", "total_ins_num"),
                 "rmse": ("sqrerr", "total_ins_num"), "acc": ("correct", "total")}


def _ratio(name: str, num: Any, den: Any, scope: Scope, util: Optional[Reducer]) -> float:
    reducer = resolve_util(util)
    names = _RATIO_INPUTS[name]
    num_array, den_array = checked(name, [(names[0], lambda: as_array(num, scope, name)),
                                          (names[1], lambda: as_array(den, scope, name))],
                                   reducer)
    top = _first(all_reduce(num_array, "sum", reducer))
    bottom = _first(all_reduce(den_array, "sum", reducer))
    if bottom == 0:
        raise ZeroDivisionError(f"{name}: the instance count sums to 0 over all workers")
    return top / bottom


def mae(abserr: Any, total_ins_num: Any, scope: Scope = None,
        util: Optional[Reducer] = None) -> float:
    """Mean absolute error: global ``Σabserr[0] / Σtotal_ins_num[0]``.

    Args:
        abserr: this worker's sum of ``|prediction - label|`` (its first element is used).
        total_ins_num: this worker's number of instances (array-like or a number).

    Raises:
        ZeroDivisionError: no worker counted an instance.
        MetricError: an input is NaN or inf, or (with ``fleet.util``) workers pass inputs of
            different shapes or dtypes; the message names the input and the worker.

    Example:
        >>> metrics.mae(np.array([3.0]), np.array([4]))   # one worker
        0.75
    """
    return _ratio("mae", abserr, total_ins_num, scope, util)


def mse(sqrerr: Any, total_ins_num: Any, scope: Scope = None,
        util: Optional[Reducer] = None) -> float:
    """Mean squared error: global ``Σsqrerr[0] / Σtotal_ins_num[0]`` (see :func:`mae`)."""
    return _ratio("mse", sqrerr, total_ins_num, scope, util)


def rmse(sqrerr: Any, total_ins_num: Any, scope: Scope = None,
         util: Optional[Reducer] = None) -> float:
    """Root mean squared error: ``sqrt(mse(sqrerr, total_ins_num))``."""
    return math.sqrt(_ratio("rmse", sqrerr, total_ins_num, scope, util))


def acc(correct: Any, total: Any, scope: Scope = None, util: Optional[Reducer] = None) -> float:
    """Accuracy: global ``Σcorrect[0] / Σtotal[0]`` (see :func:`mae`)."""
    return _ratio("acc", correct, total, scope, util)


def _histogram(value: Any, scope: Scope, name: str) -> np.ndarray:
    """Row 0 of a ``[1, B]`` histogram (a flat ``[B]`` one is accepted too)."""
    array = as_array(value, scope, name)
    if array.ndim == 1:
        array = array.reshape(1, -1)
    if array.ndim != 2 or array.shape[1] == 0:
        raise MetricError(f"{name} must be a bucket histogram of shape [1, B]; "
                          f"got shape {list(array.shape)}")
    return array


def auc_from_histograms(stat_pos: np.ndarray, stat_neg: np.ndarray) -> float:
    """The area under the ROC curve from per-bucket positive and negative counts.

    Buckets are ordered by increasing score. Walking from the highest bucket down, each bucket
    adds a trapezoid: its negatives times the mean of the positives seen before and after it.
    The area is normalised by ``positives × negatives``; with no positives, no negatives or no
    instances at all the AUC is undefined and 0.5 is returned.
    """
    pos = np.asarray(stat_pos, dtype=np.float64).reshape(-1)[::-1]
    neg = np.asarray(stat_neg, dtype=np.float64).reshape(-1)[::-1]
    if pos.shape != neg.shape:
        raise MetricError(f"stat_pos and stat_neg differ in length: {pos.size} and {neg.size}")
    after = np.cumsum(pos)              # positives at or above each bucket
    before = after - pos                # positives strictly above it
    area = float(np.dot(neg, before + after)) / 2.0
    total_pos, total_neg = float(after[-1]) if pos.size else 0.0, float(neg.sum())
    if total_pos * total_neg == 0:
        return 0.5
    return area / (total_pos * total_neg)


def auc(stat_pos: Any, stat_neg: Any, scope: Scope = None, util: Optional[Reducer] = None) -> float:
    """Global AUC from every worker's bucket histograms.

    Args:
        stat_pos: positives per score bucket, shape ``[1, B]``, bucket index increasing with
            the score (only row 0 is used; a flat ``[B]`` array is accepted too).
        stat_neg: negatives per bucket, same shape.

    Returns:
        The AUC of the summed histograms; 0.5 when there are no positives or no negatives.

    Raises:
        MetricError: a histogram is not ``[1, B]``, the two differ in length, a count is NaN
            or inf, or (with ``fleet.util``) workers pass different bucket counts or dtypes.

    Example:
        >>> metrics.auc(np.array([[0, 1, 1]]), np.array([[1, 1, 0]]))   # one worker
        0.875
    """
    reducer = resolve_util(util)
    pos, neg = checked("auc", [("stat_pos", lambda: _histogram(stat_pos, scope, "stat_pos")),
                               ("stat_neg", lambda: _histogram(stat_neg, scope, "stat_neg"))],
                       reducer)
    pos = all_reduce(pos, "sum", reducer)
    neg = all_reduce(neg, "sum", reducer)
    return auc_from_histograms(pos[0], neg[0])
