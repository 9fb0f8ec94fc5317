"""Test accuracy of a Fashion-MNIST classifier over every rank: the one evaluation the example,
the strategy examples and the collective benchmarks share.

Each rank scores its shard of the test set (every ``world``-th image from its rank) and the
counts of correct answers are summed with ``fleet.util.all_reduce``, so every rank returns the
accuracy on the whole test set; with one process it is the plain accuracy.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from fleetx import fleet


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 1000,
             device: Optional[torch.device] = None) -> float:
    """Fraction of ``x`` that ``model`` labels as ``y``, counted over all ranks.

    Args:
        model: the classifier (left in training mode afterwards).
        x, y: the whole test set, the same on every rank.
        batch: images per forward.
        device: where to run the forward (default: where ``x`` is).

    Example:
        >>> accuracy(model, x_test, y_test)  # doctest: +SKIP
        0.8813
    """
    rank, world = fleet.worker_index(), fleet.worker_num()
    xs, ys = x[rank::world], y[rank::world]
    model.eval()
    correct = 0
    with torch.no_grad():
        for i in range(0, len(xs), batch):
            inputs = xs[i:i + batch] if device is None else xs[i:i + batch].to(device)
            correct += int((model(inputs).argmax(1).cpu() == ys[i:i + batch]).sum())
    model.train()
    return fleet.util.all_reduce(correct) / len(x)
