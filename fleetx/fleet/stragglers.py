"""Stragglers named: a rank whose steps stay 1.5x slower than the others' is named in the log.

Under synchronous data parallel every rank's step takes the same wall time: the fast ranks wait
for the slow one inside the gradient all-reduce. What differs is the *busy* time of a step:
from the end of the previous optimizer step to the end of this rank's own backward (the moment
its first parameter's gradient is accumulated, which a sequential model computes last), i.e.
data loading, the loop's own work, the forward and the backward, before the wait. Each rank
measures it for every optimizer step taken; every ``FLEETX_STRAGGLER_WINDOW`` steps the ranks
all-gather their window's median on a gloo group of their own (created once, at the first
window; inline at the step boundary, never from a thread) and rank 0 names each rank whose
median is at least :data:`FACTOR` times the median of the others' medians, in one warning line
of logger ``fleetx``::

    fleetx: rank 2 is a straggler: busy 0.051 s per step, 5.1x the median of the others
    (0.010 s; window steps 20-40)

Under fleetrun every rank also counts its step times (wall and busy) in
``<log_dir>/steptimes.<rank>`` (:mod:`fleetx.observe.steptimes`) for the end-of-job table.
"""
from __future__ import annotations

import logging
import statistics
import time
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

__all__ = ["FACTOR", "StragglerWatch", "stragglers"]

log = logging.getLogger("fleetx")

#: a rank is a straggler when its window median is at least this many times the others'
FACTOR = 1.5


def stragglers(medians: Sequence[float], factor: float = FACTOR) -> list[tuple[int, float, float]]:
    """Pure: ``(rank, ratio, median of the others)`` of every rank whose median busy time is at
    least ``factor`` times the median of the other ranks' medians (float64 arithmetic).

    Example:
        >>> stragglers([1.0, 1.5, 5.0])
        [(2, 4.0, 1.25)]
    """
    found = []
    for rank, mine in enumerate(medians):
        others = [float(m) for r, m in enumerate(medians) if r != rank]
        if not others:
            continue
        base = statistics.median(others)
        if base > 0 and float(mine) >= factor * base:
            found.append((rank, float(mine) / base, base))
    return found


class StragglerWatch:
    """One rank's step timer, attached to the optimizer the fleet counts steps of.

    Args:
        optimizer: the fleet's optimizer wrapper (its step post hooks run on steps taken).
        rank, world_size: this process in the job.
        window: optimizer steps per exchange (0: never exchange; the record is still kept).
        record: a :class:`fleetx.observe.steptimes.StepTimes`, or None.
        timeout: seconds the exchange may wait for a rank.
        steps: returns the job's count of optimizer steps (the fleet's, restored ones
            included): the exchanges happen at its multiples of ``window``, so a process that
            resumed or joined later exchanges at the same steps as the others. None: this
            watch's own count.
    """

    def __init__(self, optimizer: Any, rank: int, world_size: int, window: int,
                 record: Any = None, timeout: float = 300.0,
                 steps: Optional[Callable[[], int]] = None) -> None:  # noqa: D107
        self.rank, self.world_size, self.window = rank, world_size, window
        self.record, self.timeout, self._job_steps = record, timeout, steps
        self.busy: list[float] = []
        self.steps = 0
        self._group: Any = None
        self._last_end = time.monotonic()
        self._grad_end: Optional[float] = None
        self._hook = None
        first = next((p for g in optimizer.inner.param_groups for p in g["params"]
                      if p.requires_grad), None)
        if first is not None and hasattr(first, "register_post_accumulate_grad_hook"):
            self._hook = first.register_post_accumulate_grad_hook(self._grad_done)
        self._step_hook = optimizer.register_step_post_hook(self._step_done)

    def _grad_done(self, _: torch.Tensor) -> None:
        self._grad_end = time.monotonic()

    def _step_done(self, *_: Any) -> None:
        now = time.monotonic()
        wall = now - self._last_end
        busy = wall if self._grad_end is None else min(wall, self._grad_end - self._last_end)
        self._last_end, self._grad_end = now, None
        self.steps += 1
        if self.record is not None:
            self.record.add(wall, busy)
        if self.window <= 0 or self.world_size < 2:
            return
        self.busy.append(busy)
        step = self._job_steps() if self._job_steps is not None else self.steps
        if step % self.window == 0:
            self._exchange(step)
            # the exchange's own time is not the next step's work
            self._last_end = time.monotonic()

    def _exchange(self, step: int) -> None:
        mine, self.busy = statistics.median(self.busy), []
        if self._group is None:
            self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout))
        gathered = [torch.zeros(1, dtype=torch.float64) for _ in range(self.world_size)]
        dist.all_gather(gathered, torch.tensor([mine], dtype=torch.float64), group=self._group)
        if self.rank != 0:
            return
        medians = [float(t.item()) for t in gathered]
        first = step - self.window
        for rank, ratio, base in stragglers(medians):
            log.warning("fleetx: rank %d is a straggler: busy %.3g s per step, %.2fx the median "
                        "of the others (%.3g s; window steps %d-%d)", rank, medians[rank], ratio,
                        base, first, step)

    def close(self) -> None:
        """Stop timing (a new optimizer starts a new watch)."""
        for handle in (self._hook, self._step_hook):
            if handle is not None:
                handle.remove()
        self._hook = self._step_hook = None
