"""What the strategy examples share: arguments, the model, the training loop and the test.

Each example in this folder only builds its ``DistributedStrategy`` and its optimizer and calls
:func:`train`; the loop is the same for every strategy, which is the point of Fleet: the
strategy switches an algorithm on without touching the training loop.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fashion_mnist"))
import data  # noqa: E402  (examples/fashion_mnist/data.py: the dataset loader)
from evaluate import accuracy  # noqa: E402  (examples/fashion_mnist/evaluate.py)

from fleetx import fleet  # noqa: E402


def parse_args(description: str, lr: float, epochs: int = 2,
               batch_size: int = 64) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--epochs", type=int, default=epochs)
    parser.add_argument("--batch_size", type=int, default=batch_size, help="per process")
    parser.add_argument("--lr", type=float, default=lr)
    parser.add_argument("--limit", type=int, default=0,
                        help="use only this many training images (0: all), for quick runs")
    parser.add_argument("--target", type=float, default=0.0,
                        help="exit non-zero if the final test accuracy is below this")
    return parser.parse_args()


def make_model() -> nn.Module:
    """A small convolutional network (~50k parameters): quick on a CPU, ~88% in two epochs."""
    torch.manual_seed(0)  # the same initial weights on every rank
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 7 * 7, 32), nn.ReLU(), nn.Linear(32, 10))


def train(args: argparse.Namespace, strategy: fleet.DistributedStrategy,
          make_optimizer: Callable[[list], torch.optim.Optimizer],
          report: Optional[Callable[[torch.optim.Optimizer], str]] = None,
          make_scheduler: Optional[Callable[[torch.optim.Optimizer], object]] = None) -> float:
    """Train on Fashion-MNIST with ``strategy``; print the plan and one line per epoch.

    ``report(optimizer)`` adds strategy-specific text to the epoch line; ``make_scheduler``
    builds a learning-rate scheduler stepped after every optimizer step.
    """
    fleet.init(is_collective=True, strategy=strategy)
    rank, world = fleet.worker_index(), fleet.worker_num()
    x_train, y_train = data.load("train")
    x_test, y_test = data.load("test")
    if args.limit:
        x_train, y_train = x_train[:args.limit], y_train[:args.limit]
    model = fleet.distributed_model(make_model())
    optimizer = fleet.distributed_optimizer(make_optimizer(list(model.parameters())))
    scheduler = make_scheduler(optimizer) if make_scheduler else None
    if fleet.is_first_worker():
        fleet.explain()
    result = 0.0
    for epoch in range(1, args.epochs + 1):
        # Every rank draws the same permutation and takes its own stride of it.
        order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(epoch))
        mine = order[rank::world]
        steps = len(mine) // args.batch_size
        start, loss_sum = time.monotonic(), 0.0
        for step in range(steps):
            idx = mine[step * args.batch_size:(step + 1) * args.batch_size]
            loss = F.cross_entropy(model(x_train[idx]), y_train[idx])
            optimizer.minimize(loss)
            if scheduler is not None:
                scheduler.step()
            loss_sum += loss.item()
        elapsed = time.monotonic() - start
        mean_loss = fleet.util.all_reduce(loss_sum / max(steps, 1)) / world
        result = accuracy(model, x_test, y_test)
        extra = f"  {report(optimizer)}" if report else ""
        fleet.util.print_on_rank(f"epoch {epoch}/{args.epochs}: loss {mean_loss:.4f}  test "
                                 f"accuracy {result * 100:.2f}%  {elapsed:.1f} s{extra}", 0)
    if result < args.target:
        raise SystemExit(f"test accuracy {result * 100:.2f}% is below the target "
                         f"{args.target * 100:.2f}%")
    return result
