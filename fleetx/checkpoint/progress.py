"""How far each rank's training got, so that fleetrun can say what a restart loses.

Every rank of a job started by fleetrun keeps two numbers in ``<log_dir>/progress.<rank>``: the
optimizer steps its training has taken (counting those restored from a checkpoint) and that
count at its last committed ``fleet.save_checkpoint``. The file is 16 bytes mapped into memory:
updating it is a memory write (no system call per step), and the kernel keeps the page when
the process is killed, even by SIGKILL. When the agent restarts the worker group it reads the
failed ranks' records and prints the steps since the last checkpoint: the work lost.

Torch-free, so that the launcher reads it without importing the training stack.
"""
from __future__ import annotations

import mmap
import os
import struct
from typing import Optional, Sequence

__all__ = ["ProgressRecord", "progress_path", "read_progress", "lost_work"]

_LAYOUT = struct.Struct("<qq")  # steps taken, steps at the last checkpoint (-1: none yet)
NO_CHECKPOINT = -1


def progress_path(log_dir: str, rank: int) -> str:
    """The record of ``rank`` in fleetrun's log folder."""
    return os.path.join(log_dir, f"progress.{rank}")


class ProgressRecord:
    """One rank's record, written as it trains.

    Args:
        log_dir: fleetrun's log folder (``FLEETX_LOG_DIR``).
        rank: the global rank.

    Raises:
        OSError: the file cannot be created in ``log_dir``.

    Example:
        >>> record = ProgressRecord("log", 0)
        >>> record.update(steps=10, saved_at=8)
    """

    def __init__(self, log_dir: str, rank: int) -> None:  # noqa: D107
        fd = os.open(progress_path(log_dir, rank), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            os.ftruncate(fd, _LAYOUT.size)
            self._map = mmap.mmap(fd, _LAYOUT.size)
        finally:
            os.close(fd)
        self.update(0, NO_CHECKPOINT)

    def update(self, steps: int, saved_at: int) -> None:
        """Record ``steps`` taken, the last checkpoint at ``saved_at`` (-1: none): the two
        little-endian int64 of the file, in this order (what :func:`read_progress` reads)."""
        _LAYOUT.pack_into(self._map, 0, steps, saved_at)


def read_progress(log_dir: str, rank: int) -> Optional[tuple[int, int]]:
    """(steps taken, steps at the last checkpoint or -1) of ``rank``; None when it kept no
    record (a script that took no step through a fleet optimizer, or a damaged file)."""
    try:
        with open(progress_path(log_dir, rank), "rb") as f:
            raw = f.read(_LAYOUT.size)
    except OSError:
        return None
    if len(raw) != _LAYOUT.size:
        return None
    return _LAYOUT.unpack(raw)


def lost_work(log_dir: str, ranks: Sequence[int]) -> Optional[str]:
    """What a restart of ``ranks`` loses, in words, from their records; None when none of them
    kept a record (no fleet optimizer ran there).

    Example:
        "work lost: 3 step(s) since the last checkpoint (rank 1 at step 7, checkpoint at step 4)"
    """
    records = {r: p for r in ranks if (p := read_progress(log_dir, r)) is not None}
    if not records:
        return None
    rank, (steps, saved_at) = max(records.items(), key=lambda kv: kv[1][0] - max(kv[1][1], 0))
    if saved_at == NO_CHECKPOINT:
        return (f"work lost: all {steps} step(s), no checkpoint was saved (rank {rank} at step "
                f"{steps}): the processes start over")
    return (f"work lost: {steps - saved_at} step(s) since the last checkpoint (rank {rank} at "
            f"step {steps}, checkpoint at step {saved_at})")
