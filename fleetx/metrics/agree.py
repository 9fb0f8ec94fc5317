"""Workers agree on a metric's inputs before they reduce them.

A metric all-reduces each worker's statistics, so every worker must hand it the same kind of
array. When they do not (histograms with different bucket counts, an int64 count on one worker
and a float64 one on another, one worker calling ``auc`` while another calls ``acc``), the
collective runs on mismatched buffers: gloo aborts the process or sums garbage. And a worker
whose own input is unusable (a name missing from ``scope``, a NaN) must not leave the others
waiting in a collective it will never join.

So, when the util offers ``all_gather`` (``fleet.util`` does), each worker first gathers a
fixed-size int64 descriptor of its inputs — which metric, and per input: whether it loaded,
its shape, dtype and whether it holds NaN or inf — and every worker compares all of them. Any
disagreement becomes the same :class:`MetricError` on every worker, naming the metric, the input
and the worker. The descriptor costs one small all-gather per metric call (metrics are computed
once per epoch or log interval, not per step). A util with only ``all_reduce`` (Fleet's minimum)
gets the local checks alone.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np

from fleetx.metrics.api import MetricError, Reducer

__all__ = ["checked"]

_METRICS = ("sum", "max", "min", "auc", "mae", "mse", "rmse", "acc")
_MAGIC = 0x6D657431          # "met1": a descriptor, version 1
_SLOTS = 2                   # the most inputs one metric takes
_DIMS = 8                    # dimensions described; more are summarised by ndim and numel
_SLOT = 5 + _DIMS            # status, ndim, numel, dtype, non-finite flags, dims
_LOADED, _REJECTED = 1, 2
_NAN, _INF = 1, 2

Loader = Callable[[], np.ndarray]


@dataclass(frozen=True)
class _Input:
    """One worker's account of one input."""

    status: int
    shape: tuple
    ndim: int
    numel: int
    dtype: int
    nonfinite: int

    def describe(self, metric: str) -> str:
        dims = ", ".join(str(d) for d in self.shape) + (", ..." if self.ndim > _DIMS else "")
        buckets = f" ({self.shape[-1]} buckets)" if metric == "auc" and self.shape else ""
        return f"shape [{dims}]{buckets} {_dtype_name(self.dtype)}"


def _dtype_code(dtype: np.dtype) -> int:
    # kind and item size, not dtype.num: int64 has two numbers (long, longlong) on Linux.
    return ord(dtype.kind) * 100 + dtype.itemsize


def _dtype_name(code: int) -> str:
    return str(np.dtype(f"{chr(code // 100)}{code % 100}"))


def _nonfinite(array: np.ndarray) -> int:
    if array.dtype.kind not in "fc":
        return 0
    return (_NAN if np.isnan(array).any() else 0) | (_INF if np.isinf(array).any() else 0)


def _describe(array: Optional[np.ndarray]) -> list:
    if array is None:
        return [_REJECTED] + [0] * (_SLOT - 1)
    dims = list(array.shape[:_DIMS]) + [-1] * (_DIMS - min(array.ndim, _DIMS))
    return [_LOADED, array.ndim, array.size, _dtype_code(array.dtype), _nonfinite(array)] + dims


def _decode(row: np.ndarray, count: int) -> tuple[str, list]:
    row = np.asarray(row, dtype=np.int64).reshape(-1)
    if row.size != 2 + _SLOTS * _SLOT or row[0] != _MAGIC:
        return "(not a metric)", []
    code = int(row[1])
    metric = _METRICS[code] if 0 <= code < len(_METRICS) else f"metric #{code}"
    inputs = []
    for i in range(count):
        s = row[2 + i * _SLOT: 2 + (i + 1) * _SLOT]
        ndim = int(s[1])
        shape = tuple(int(d) for d in s[5:5 + min(ndim, _DIMS)])
        inputs.append(_Input(int(s[0]), shape, ndim, int(s[2]), int(s[3]), int(s[4])))
    return metric, inputs


def _load(metric: str, name: str, load: Loader) -> tuple[Optional[np.ndarray], Optional[Exception]]:
    try:
        array = load()
    except MetricError as exc:
        return None, exc
    if array.dtype.kind not in "biufc":
        return None, MetricError(f"{metric}: {name} must hold numbers, got dtype {array.dtype}")
    return array, None


def _flags(flags: int) -> str:
    return " and ".join(w for bit, w in ((_NAN, "NaN"), (_INF, "inf")) if flags & bit)


def _compare(metric: str, names: Sequence[str], rows: Sequence[np.ndarray],
             finite: bool) -> None:
    """Raise the first disagreement among every worker's descriptor (the same on every worker)."""
    decoded = [_decode(row, len(names)) for row in rows]
    for rank, (other, _) in enumerate(decoded):
        if other != decoded[0][0]:
            raise MetricError(f"fleet.metrics: workers are not making the same call: worker 0 "
                              f"called {decoded[0][0]}, worker {rank} called {other}")
    for slot, name in enumerate(names):
        inputs = [inputs[slot] for _, inputs in decoded]
        for rank, got in enumerate(inputs):
            if got.status != _LOADED:
                raise MetricError(f"{metric}: worker {rank} rejected its {name} input (its own "
                                  f"error says why)")
        first = inputs[0]
        for rank, got in enumerate(inputs[1:], start=1):
            if (got.shape, got.ndim, got.numel, got.dtype) != (
                    first.shape, first.ndim, first.numel, first.dtype):
                raise MetricError(f"{metric}: {name} differs across workers: worker 0 has "
                                  f"{first.describe(metric)}, worker {rank} has "
                                  f"{got.describe(metric)}; every worker must pass the same "
                                  f"shape and dtype")
        for rank, got in enumerate(inputs):
            if finite and got.nonfinite:
                raise MetricError(f"{metric}: {name} is not finite on worker {rank} (it holds "
                                  f"{_flags(got.nonfinite)})")


def checked(metric: str, inputs: Sequence[tuple[str, Loader]], util: Reducer,
            finite: bool = True) -> list[np.ndarray]:
    """Load ``metric``'s inputs and make sure every worker agrees on them.

    Args:
        metric: the metric's name (one of ``sum max min auc mae mse rmse acc``).
        inputs: ``(name, load)`` per input; ``load()`` returns the array or raises
            :class:`MetricError`.
        util: the reducer; only one with ``all_gather`` lets workers compare their inputs.
        finite: NaN or inf in a floating input is an error.

    Returns:
        The loaded arrays, in order.

    Raises:
        MetricError: this worker's input is unusable (its own error), or with a gathering util,
            any worker's input is unusable, not finite, or differs in shape or dtype from worker
            0's, or a worker is computing another metric. Every worker raises together.
    """
    names = [name for name, _ in inputs]
    loaded = [_load(metric, name, load) for name, load in inputs]
    arrays = [array for array, _ in loaded]
    error = next((exc for _, exc in loaded if exc is not None), None)
    gather = getattr(util, "all_gather", None)
    if gather is None:
        if error is not None:
            raise error
        for name, array in zip(names, arrays):
            if finite and _nonfinite(array):
                raise MetricError(f"{metric}: {name} is not finite (it holds "
                                  f"{_flags(_nonfinite(array))})")
        return arrays
    rows = gather(_descriptor(metric, arrays))
    if error is not None:
        raise error
    _compare(metric, names, [np.asarray(row) for row in rows], finite)
    return arrays


def _descriptor(metric: str, arrays: Sequence[Optional[np.ndarray]]) -> np.ndarray:
    row = [_MAGIC, _METRICS.index(metric)]
    for slot in range(_SLOTS):
        row += _describe(arrays[slot]) if slot < len(arrays) else [0] * _SLOT
    return np.asarray(row, dtype=np.int64)
