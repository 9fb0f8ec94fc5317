"""Train an embedding network with a class-sharded ArcFace head on Fashion-MNIST (PLSC).

    fleetrun --nproc_per_node 2 examples/plsc/train.py --epochs 3 --target 0.85

``hybrid_configs = {"mp_degree": 2}``: both processes run the same backbone on the same batch
(a small CNN that maps an image to a 64-dimensional feature); the head's 10 class centres are
split over them, 5 each, and the ArcFace loss (s = 64, m = 0.5) is computed from each rank's
5 cosines without gathering them. The test accuracy uses ``head.predict``: the argmax over both
ranks' classes, found with two all-reduces of one number per image.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fashion_mnist"))
import data  # noqa: E402  (examples/fashion_mnist/data.py: the Debian package's files)

from fleetx import fleet  # noqa: E402
from fleetx.fleet import meta_parallel as mpu  # noqa: E402


class Backbone(nn.Module):
    """Two conv blocks and a linear layer to a ``dim``-dimensional feature."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc = nn.Linear(32 * 7 * 7, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


def accuracy(backbone: nn.Module, head: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Fraction of the test set ``head.predict`` labels right (the same on every rank)."""
    backbone.eval()
    with torch.no_grad():
        correct = sum(int((head.predict(backbone(x[i:i + 1000])) == y[i:i + 1000]).sum())
                      for i in range(0, len(x), 1000))
    backbone.train()
    return correct / len(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch_size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--mp_degree", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--limit", type=int, default=0,
                        help="use only this many training images (0: all), for quick runs")
    parser.add_argument("--target", type=float, default=0.0,
                        help="exit non-zero if the final test accuracy is below this")
    args = parser.parse_args()

    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": 1, "mp_degree": args.mp_degree, "pp_degree": 1}
    fleet.init(is_collective=True, strategy=strategy)
    torch.manual_seed(args.seed)  # the same on every rank: the same backbone, one head
    backbone = Backbone(64)
    head = mpu.ShardedClassifier(64, len(data.CLASSES), margin="arcface")
    optimizer = torch.optim.Adam([*backbone.parameters(), *head.parameters()], lr=args.lr)
    x_train, y_train = data.load("train")
    x_test, y_test = data.load("test")
    if args.limit:
        x_train, y_train = x_train[:args.limit], y_train[:args.limit]
    first = fleet.worker_index() == 0
    if first:
        start, end = head.class_range
        print(f"{head}\nrank 0 holds classes [{start}, {end}) of {head.num_classes}; "
              f"{len(x_train)} training images, batch {args.batch_size}", flush=True)

    acc = 0.0
    for epoch in range(1, args.epochs + 1):
        # every rank draws the same permutation: model-parallel ranks see the same batch
        order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(epoch))
        steps, total, began = len(order) // args.batch_size, 0.0, time.monotonic()
        for step in range(steps):
            idx = order[step * args.batch_size:(step + 1) * args.batch_size]
            loss = head(backbone(x_train[idx]), y_train[idx]).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.item()
        acc = accuracy(backbone, head, x_test, y_test)
        if first:
            print(f"epoch {epoch}/{args.epochs}: arcface loss {total / max(steps, 1):.3f}  "
                  f"test accuracy {acc * 100:.2f}%  "
                  f"{steps * args.batch_size / (time.monotonic() - began):,.0f} images/s",
                  flush=True)
    if acc < args.target:
        raise SystemExit(f"test accuracy {acc * 100:.2f}% is below the target "
                         f"{args.target * 100:.2f}%")


if __name__ == "__main__":
    main()
