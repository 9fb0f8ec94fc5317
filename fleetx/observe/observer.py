"""The opt-in view of a training loop: a tqdm bar on rank 0 and per-rank scalars every N steps.

The hot path is :meth:`Observer.step`: two additions, a reference to the loss tensor and, where
there is a bar, tqdm's own ``update`` (which redraws at most every ``mininterval`` seconds). The
losses are read only on logged steps, every ``every`` steps, all at once (one ``.item()``, one
device synchronisation).
"""
from __future__ import annotations

import math
import sys
import time
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional

from fleetx.observe.api import require, write_throughput
from fleetx.observe.scalars import ScalarWriter

__all__ = ["Observer"]


def _value(loss: Any) -> Optional[float]:
    if loss is None:
        return None
    return float(loss.detach().float().mean().item() if hasattr(loss, "detach") else loss)


def _mean(losses: list) -> Optional[float]:
    """The mean of the kept losses (each loss's own mean). Scalar tensors on one device, the
    usual case, are read in one operation and one device synchronisation, not one per step."""
    if not losses:
        return None
    torch = sys.modules.get("torch")  # present whenever a loss is a tensor
    if torch is not None and len(losses) > 1 and all(
            isinstance(v, torch.Tensor) and v.dim() == 0 for v in losses) \
            and len({v.device for v in losses}) == 1:
        with torch.no_grad():
            return float(torch.stack(losses).double().mean().item())
    return math.fsum(_value(v) for v in losses) / len(losses)


class Observer:
    """Progress bar and scalars for one process's loop; use it as a context manager.

    Args:
        rank: this process's rank; only rank 0 draws the bar.
        total: steps expected (the bar's length); None: unknown.
        batch_size: samples per step when :meth:`step` is not told ``samples``.
        every: log the scalars (and refresh the bar's loss) every this many steps (>= 1).
        progress: draw the bar (rank 0 only). Like tqdm's ``disable=None``, it is hidden when
            stderr is not a terminal, unless ``force_progress`` is True.
        force_progress: draw it whatever stderr is (fleetrun sets ``FLEETX_TTY=1`` when its own
            terminal shows rank 0's log live; ``fleet.observe`` passes that on).
        scalars_dir: write per-rank scalars there (CSV and TensorBoard); None: none.
        tensorboard: with ``scalars_dir``, also a TensorBoard run (needs ``tensorboard``).
        extras: called on logged steps; returns more scalars by column name (loss scale, DGC
            sparsity, PS latency: ``fleet.observe`` passes the strategies' ones).
        throughput_file: where to leave samples/s for fleetrun's end-of-job summary; None: not.
        clock: seconds, monotonic (tests pass their own).

    Raises:
        ValueError: ``every`` < 1 or ``batch_size`` < 1.
        MissingExtraError: the bar or TensorBoard is asked for and its package is missing.

    Example:
        >>> with Observer(rank=0, total=100, batch_size=32, scalars_dir="runs/a") as obs:
        ...     for batch in loader:
        ...         loss = train_step(batch)
        ...         obs.step(loss)
    """

    def __init__(self, *, rank: int = 0, total: Optional[int] = None,
                 batch_size: Optional[int] = None, every: int = 10, progress: bool = True,
                 force_progress: bool = False, scalars_dir: Optional[str] = None,
                 tensorboard: bool = True,
                 extras: Optional[Callable[[], Mapping[str, Optional[float]]]] = None,
                 throughput_file: Optional[str] = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be an int >= 1, got {every!r}")
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
        self.rank, self.every, self.batch_size = rank, every, batch_size
        self._extras, self._throughput_file, self._clock = extras, throughput_file, clock
        self.steps, self.samples = 0, 0
        self._losses: list = []
        self._start = self._last_time = clock()
        self._last_samples = 0
        self.bar = self._make_bar(total, progress, force_progress) if rank == 0 else None
        self._writer = ScalarWriter(scalars_dir, rank, tensorboard) if scalars_dir else None

    def _make_bar(self, total: Optional[int], progress: bool, force: bool) -> Any:
        if not progress:
            return None
        tqdm = require("tqdm", "the progress bar").tqdm
        # Counting samples makes tqdm's own rate samples/s; steps when the batch is unknown.
        unit, length = ("samples", total * self.batch_size if total and self.batch_size
                        else None) if self.batch_size else ("steps", total)
        return tqdm(total=length, unit=unit, unit_scale=True, dynamic_ncols=True,
                    disable=False if force else None, desc=f"rank {self.rank}")

    def step(self, loss: Any = None, samples: Optional[int] = None) -> None:
        """Count one training step of ``samples`` samples (default: ``batch_size``, else 0)
        with its ``loss`` (a tensor or a number; kept, not read, until a logged step)."""
        count = samples if samples is not None else (self.batch_size or 0)
        self.steps += 1
        self.samples += count
        if loss is not None:
            self._losses.append(loss)
        if self.bar is not None:
            self.bar.update(count if self.batch_size else 1)
        if self.steps % self.every == 0:
            self.log()

    def wrap(self, iterable: Iterable) -> Iterator:
        """Yield the items of ``iterable`` (a shortcut when each item is one step and the loss
        is not shown: ``for batch in obs.wrap(loader)``)."""
        for item in iterable:
            yield item
            self.step()

    def log(self) -> dict:
        """Write a row now (also done every ``every`` steps); returns it."""
        now = self._clock()
        elapsed = now - self._last_time
        row: dict = {"step": self.steps, "time": now - self._start,
                     "loss": _mean(self._losses),
                     "samples_per_s": (self.samples - self._last_samples) / elapsed
                     if elapsed > 0 else None}
        if self._extras is not None:
            row.update({k: v for k, v in self._extras().items() if v is not None})
        self._losses, self._last_time, self._last_samples = [], now, self.samples
        if self._writer is not None:
            self._writer.write(row)
        if self.bar is not None and row["loss"] is not None:
            self.bar.set_postfix(loss=f"{row['loss']:.4g}", refresh=False)
        if self._throughput_file is not None and now > self._start:
            write_throughput(self._throughput_file, self.samples / (now - self._start),
                             self.steps)
        return row

    def close(self) -> None:
        """Log the steps since the last row, close the bar and the files."""
        if self.steps % self.every:
            self.log()
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> "Observer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
