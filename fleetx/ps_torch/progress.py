"""A worker's progress lines: samples/s and the mean loss every few seconds.

The parameter-server runtime counts the samples of every training forward (through
:class:`CountedModel`, the model as the worker runs it) and the losses passed to ``minimize``,
and after each optimizer step prints a line when ``interval`` seconds have passed.
"""
from __future__ import annotations

import sys
import time
from typing import Any, Optional, TextIO

import torch
from torch import nn

__all__ = ["Progress", "CountedModel"]


class Progress:
    """Counts training samples and losses; prints a line every ``interval`` seconds.

    Example line: ``fleetx ps worker 0: step 120, 5321.4 samples/s, loss 0.41234``.
    """

    def __init__(self, rank: int, interval: float, out: Optional[TextIO] = None) -> None:
        self.rank, self.interval, self.out = rank, interval, out
        self.steps = 0
        self._samples, self._losses = 0, []
        self._since = time.monotonic()

    def samples(self, count: int) -> None:
        self._samples += count

    def loss(self, loss: Any) -> None:
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            self._losses.append(loss.detach())  # read when printing: no device sync per step

    def step(self) -> None:
        self.steps += 1
        now = time.monotonic()
        if self.interval <= 0 or now - self._since < self.interval:
            return
        rate = self._samples / (now - self._since)
        mean = float(torch.stack([x.float().reshape(()) for x in self._losses]).mean().cpu()) \
            if self._losses else None
        loss = f", loss {mean:.5f}" if mean is not None else ""
        print(f"fleetx ps worker {self.rank}: step {self.steps}, {rate:.1f} samples/s{loss}",
              file=self.out or sys.stdout, flush=True)
        self._samples, self._losses, self._since = 0, [], now


class CountedModel(nn.Module):
    """The model as run by a worker: counts the samples of training forwards (the length of
    the first tensor argument)."""

    def __init__(self, module: nn.Module, progress: Progress) -> None:
        super().__init__()
        self.module = module
        self.__dict__["_progress"] = progress

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.training and torch.is_grad_enabled():
            first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)),
                         None)
            if first is not None and first.dim() > 0:
                self._progress.samples(int(first.shape[0]))
        return self.module(*args, **kwargs)
