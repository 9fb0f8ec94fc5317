"""Each rank's step times, kept for fleetrun's end-of-job table (step time p50 / p99).

A rank of a job started by fleetrun keeps two histograms in ``<log_dir>/steptimes.<rank>``: its
optimizer steps' wall time (from the end of one step to the end of the next) and their *busy*
time (from the end of one step to the end of this rank's own backward, before it waits for the
others' gradients; see :mod:`fleetx.fleet.stragglers`). The buckets are log-spaced, 16 per
octave from 1 us (each about 4.4 % wide, so a percentile read back is within about 2.2 % of
the true one); the file is mapped into memory, so a step costs a memory write, and the counts
survive a SIGKILL.

Torch-free, so that the launcher reads it without importing the training stack.

Example:
    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> record = StepTimes(d, 0)
    >>> for _ in range(99):
    ...     record.add(0.1, 0.05)
    >>> record.add(1.0, 0.9)
    >>> p50, p99, busy = read_step_times(d, 0)
    >>> round(p50, 2), round(busy, 2)
    (0.1, 0.05)
"""
from __future__ import annotations

import math
import mmap
import os
import struct
from typing import Optional, Sequence

__all__ = ["StepTimes", "steptimes_path", "read_step_times", "percentile"]

_PER_OCTAVE = 16
_LOWEST_S = 1e-6
_BUCKETS = 36 * _PER_OCTAVE  # 1 us to about 19 hours
_COUNT = struct.Struct("<q")
_SIZE = 2 * _BUCKETS * _COUNT.size  # wall, then busy


def steptimes_path(log_dir: str, rank: int) -> str:
    """The step-time record of ``rank`` in fleetrun's log folder."""
    return os.path.join(log_dir, f"steptimes.{rank}")


def _bucket(seconds: float) -> int:
    if not seconds > _LOWEST_S:  # also NaN
        return 0
    return min(_BUCKETS - 1, int(math.log2(seconds / _LOWEST_S) * _PER_OCTAVE))


def _value(bucket: int) -> float:
    return _LOWEST_S * 2 ** ((bucket + 0.5) / _PER_OCTAVE)


class StepTimes:
    """One rank's record, written as it trains.

    Args:
        log_dir: fleetrun's log folder (``FLEETX_LOG_DIR``).
        rank: the global rank.

    Raises:
        OSError: the file cannot be created in ``log_dir``.
    """

    def __init__(self, log_dir: str, rank: int) -> None:  # noqa: D107
        fd = os.open(steptimes_path(log_dir, rank), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, _SIZE)
            self._map = mmap.mmap(fd, _SIZE)
        finally:
            os.close(fd)

    def add(self, wall_s: float, busy_s: float) -> None:
        """Count one step of ``wall_s`` seconds, ``busy_s`` of them busy."""
        for offset in (_bucket(wall_s), _BUCKETS + _bucket(busy_s)):
            at = offset * _COUNT.size
            _COUNT.pack_into(self._map, at, _COUNT.unpack_from(self._map, at)[0] + 1)


def percentile(counts: Sequence[int], q: float) -> Optional[float]:
    """The ``q`` quantile (0 to 1) of a histogram of :func:`_bucket` counts; None if empty."""
    total = sum(counts)
    if total == 0:
        return None
    rank = max(1, math.ceil(q * total))
    seen = 0
    for bucket, count in enumerate(counts):
        seen += count
        if seen >= rank:
            return _value(bucket)
    return _value(len(counts) - 1)


def read_step_times(log_dir: str, rank: int) -> Optional[tuple[float, float, float]]:
    """(wall p50, wall p99, busy p50) in seconds of ``rank``'s steps; None when it kept no
    record (no step through a fleet optimizer) or the file is damaged."""
    try:
        with open(steptimes_path(log_dir, rank), "rb") as f:
            raw = f.read(_SIZE)
    except OSError:
        return None
    if len(raw) != _SIZE:
        return None
    counts = [c for (c,) in _COUNT.iter_unpack(raw)]
    wall, busy = counts[:_BUCKETS], counts[_BUCKETS:]
    if not sum(wall):
        return None
    return percentile(wall, 0.5), percentile(wall, 0.99), percentile(busy, 0.5)
