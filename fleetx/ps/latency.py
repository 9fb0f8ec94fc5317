"""Request latency as the client sees it: a log-bucketed histogram per message kind.

:class:`~fleetx.ps.tracker.Tracker` stamps each request when it is registered (just before it
is sent) and, when its reply resolves it, adds the elapsed nanoseconds to the histogram of the
request's kind. A request that failover sends again to a restarted server is timed from its
first send, so the outage shows in the tail, as the caller waited it out. Failed requests
(their peer was declared lost) have no reply and are not counted.

Buckets are HdrHistogram's: below 128 ns one per nanosecond; above, each power of two is
split into 64 equal buckets, so a bucket is at most 1/64 (1.6 %) of its lower edge wide, and
a quantile, reported as its bucket's middle, is within 0.8 % of the exact sample quantile. A
bucket index is a ``bit_length`` and two shifts (no logarithm). ``BUCKETS`` buckets cover
1 ns to 2**44 ns (about 4.9 hours; longer ones land in the last bucket), so a histogram's
memory is fixed (one list of ``BUCKETS`` counts per kind seen) whatever the run's length.
Recording is done under the tracker's lock that the reply takes anyway.

Example:
    >>> hist = Histogram()
    >>> for ns in (1_000, 2_000, 3_000):
    ...     hist.add(ns)
    >>> round(hist.quantile(0.5) * 1e9)
    2008
"""
from __future__ import annotations

import math
from typing import Iterable, Optional

__all__ = ["Histogram", "Latencies", "BUCKETS", "SUB_BITS", "QUANTILES", "bucket", "bounds"]

SUB_BITS = 7   # a value's top 7 bits pick its bucket: 64 buckets per power of two
MAX_BITS = 44  # 2**44 ns: 4.9 hours
BUCKETS = ((MAX_BITS - SUB_BITS) << (SUB_BITS - 1)) + (1 << SUB_BITS)
#: the quantiles :meth:`Latencies.summary` reports, with their names
QUANTILES = (("p50", 0.5), ("p99", 0.99), ("p999", 0.999))


def bucket(ns: int) -> int:
    """The bucket of a duration of ``ns`` nanoseconds (an int; negative: bucket 0)."""
    if ns < 1 << SUB_BITS:
        return max(ns, 0)
    shift = ns.bit_length() - SUB_BITS
    return min((shift << (SUB_BITS - 1)) + (ns >> shift), BUCKETS - 1)


def bounds(b: int) -> tuple[int, int]:
    """``[low, high)`` in ns of the durations bucket ``b`` holds (the last one holds more)."""
    if b < 1 << SUB_BITS:
        return b, b + 1
    shift = (b >> (SUB_BITS - 1)) - 1
    m = (b & ((1 << (SUB_BITS - 1)) - 1)) + (1 << (SUB_BITS - 1))
    return m << shift, (m + 1) << shift


class Histogram:
    """Counts of durations in ``BUCKETS`` buckets of at most 1/64 of their value: fixed memory.

    Not locked: the tracker adds to it under its own lock; read a :meth:`copy`.
    """

    __slots__ = ("counts",)

    def __init__(self, counts: Optional[list] = None) -> None:
        self.counts = list(counts) if counts is not None else [0] * BUCKETS

    def add(self, ns: int) -> None:
        """Count one duration of ``ns`` nanoseconds."""
        self.counts[bucket(ns)] += 1

    def copy(self) -> "Histogram":
        return Histogram(self.counts)

    @property
    def count(self) -> int:
        return sum(self.counts)

    def quantile(self, q: float) -> Optional[float]:
        """The ``q`` quantile in seconds (nearest rank: the ``ceil(q * n)``-th smallest duration,
        numpy's ``method="inverted_cdf"``), as its bucket's middle; None when empty.

        Raises:
            ValueError: ``q`` outside [0, 1].
        """
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantile {q} outside [0, 1]")
        n = self.count
        if n == 0:
            return None
        rank, seen = max(1, math.ceil(q * n)), 0
        for b, c in enumerate(self.counts):
            seen += c
            if seen >= rank:
                low, high = bounds(b)
                return (low + high - 1) * 0.5e-9  # integer durations: the middle of low..high-1
        raise AssertionError("unreachable: the counts sum to n")

    def merged(self, other: "Histogram", sign: int = 1) -> "Histogram":
        """A new histogram: this one plus (``sign=-1``: minus) ``other``."""
        return Histogram([a + sign * b for a, b in zip(self.counts, other.counts)])

    def to_json(self) -> dict:
        """``{"sub_bits", "buckets", "counts": {bucket: count}}`` (non-empty buckets only)."""
        return {"sub_bits": SUB_BITS, "buckets": BUCKETS,
                "counts": {str(b): c for b, c in enumerate(self.counts) if c}}

    @classmethod
    def from_json(cls, data: dict) -> "Histogram":
        """The inverse of :meth:`to_json`.

        Raises:
            ValueError: written with other buckets.
        """
        if data.get("sub_bits") != SUB_BITS or data.get("buckets") != BUCKETS:
            raise ValueError(f"histogram with sub_bits {data.get('sub_bits')} and "
                             f"{data.get('buckets')} buckets; this fleetx uses {SUB_BITS} and "
                             f"{BUCKETS}")
        hist = cls()
        for b, c in data["counts"].items():
            hist.counts[int(b)] = int(c)
        return hist


class Latencies:
    """One histogram per message kind name (``"PULL"``, ``"PUSH"``, ...).

    Args:
        histograms: kind name -> :class:`Histogram` (default: none yet).
    """

    def __init__(self, histograms: Optional[dict] = None) -> None:
        self.histograms: dict = dict(histograms or {})

    def of(self, kind: str) -> Histogram:
        """The histogram of ``kind``, created on first use."""
        hist = self.histograms.get(kind)
        if hist is None:
            hist = self.histograms[kind] = Histogram()
        return hist

    def copy(self) -> "Latencies":
        return Latencies({k: h.copy() for k, h in self.histograms.items()})

    def summary(self) -> dict:
        """``{kind: {"count", "p50", "p99", "p999"}}``, quantiles in seconds."""
        return {k: {"count": h.count, **{name: h.quantile(q) for name, q in QUANTILES}}
                for k, h in sorted(self.histograms.items()) if h.count}

    def minus(self, earlier: "Latencies") -> "Latencies":
        """What was recorded since ``earlier`` (an older copy of this one)."""
        return Latencies({k: h.merged(earlier.histograms[k], -1) if k in earlier.histograms
                          else h.copy() for k, h in self.histograms.items()})

    @classmethod
    def combined(cls, many: Iterable["Latencies"]) -> "Latencies":
        """The sum of several (every worker's, for the job's quantiles)."""
        out = cls()
        for lat in many:
            for k, h in lat.histograms.items():
                out.histograms[k] = out.of(k).merged(h)
        return out

    def to_json(self) -> dict:
        return {k: h.to_json() for k, h in sorted(self.histograms.items())}

    @classmethod
    def from_json(cls, data: dict) -> "Latencies":
        return cls({k: Histogram.from_json(v) for k, v in data.items()})
