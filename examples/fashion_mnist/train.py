"""Train a small CNN on Fashion-MNIST with fleetx data parallel.

    fleetrun --nproc_per_node 2 examples/fashion_mnist/train.py --epochs 4

Each process trains on its shard of every epoch; DDP averages the gradients. Rank 0 prints a
progress bar on a terminal (a line every few seconds in a log) and, after each epoch, the mean
training loss, the test accuracy over the whole test set (counted on every rank and summed with
``fleet.util.all_reduce``) and the throughput of the whole job.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
import data  # noqa: E402  (the example's own loader, beside this file)
import evaluate  # noqa: E402  (the test accuracy, beside this file)
from progress import Progress  # noqa: E402  (examples/progress.py, shared by the examples)

from fleetx import fleet  # noqa: E402


class Net(nn.Module):
    """Two conv blocks and two linear layers: ~0.42M parameters, ~91% after a few epochs."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.fc1 = nn.Linear(64 * 7 * 7, 128)
        self.fc2 = nn.Linear(128, 10)
        self.drop = nn.Dropout(0.25)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = self.drop(F.relu(self.fc1(x.flatten(1))))
        return self.fc2(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch_size", type=int, default=64, help="per process")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--limit", type=int, default=0,
                        help="use only this many training images (0: all), for quick runs")
    parser.add_argument("--target", type=float, default=0.0,
                        help="exit non-zero if the final test accuracy is below this")
    args = parser.parse_args()

    fleet.init(is_collective=True)
    rank, world = fleet.worker_index(), fleet.worker_num()
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    x_train, y_train = data.load("train")
    x_test, y_test = data.load("test")
    if args.limit:
        x_train, y_train = x_train[:args.limit], y_train[:args.limit]

    device = fleet.local_device()  # this process's GPU under NCCL, else the CPU
    model = fleet.distributed_model(Net().to(device))
    optimizer = fleet.distributed_optimizer(torch.optim.Adam(model.parameters(), lr=args.lr))
    if fleet.is_first_worker():
        fleet.explain()
        print(f"training on {len(x_train)} images, {world} process(es) on {device.type}, "
              f"batch {args.batch_size} per process", flush=True)

    accuracy = 0.0
    for epoch in range(1, args.epochs + 1):
        # Every rank draws the same permutation and takes its own stride of it.
        order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(epoch))
        mine = order[rank::world]
        steps = len(mine) // args.batch_size
        progress = Progress(steps * args.batch_size * world, enabled=fleet.is_first_worker())
        start, loss_sum = time.monotonic(), 0.0
        for step in range(steps):
            idx = mine[step * args.batch_size:(step + 1) * args.batch_size]
            loss = F.cross_entropy(model(x_train[idx].to(device)), y_train[idx].to(device))
            optimizer.minimize(loss)
            loss_sum += loss.item()
            progress.update((step + 1) * args.batch_size * world, loss.item())
        progress.close()
        elapsed = time.monotonic() - start
        mean_loss = fleet.util.all_reduce(loss_sum / max(steps, 1)) / world
        accuracy = evaluate.accuracy(model, x_test, y_test, device=device)
        samples = fleet.util.all_reduce(steps * args.batch_size)
        fleet.util.print_on_rank(
            f"epoch {epoch}/{args.epochs}: loss {mean_loss:.4f}  test accuracy "
            f"{accuracy * 100:.2f}%  {samples / elapsed:,.0f} samples/s", 0)
    if accuracy < args.target:
        raise SystemExit(f"test accuracy {accuracy * 100:.2f}% is below the target "
                         f"{args.target * 100:.2f}%")


if __name__ == "__main__":
    main()
