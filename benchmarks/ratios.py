"""Summaries of per-round ratios shared by the benchmarks."""
from __future__ import annotations

import statistics


def quartiles(values: list) -> tuple:
    """(first quartile, median, third quartile) of ``values``; one value gives it three times."""
    if len(values) < 2:
        return values[0], values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], statistics.median(values), q[2]
