"""The smallest complete fleetx collective job: read this file top to bottom.

Run it on one process or many; nothing in the script changes:

    python examples/minimal_collective.py                      # 1 process
    fleetrun --nproc_per_node 2 examples/minimal_collective.py  # 2 processes, data parallel

It trains a two-layer perceptron on a slice of Fashion-MNIST (Debian package
``dataset-fashion-mnist``) and shows every piece of the public collective API a script needs.
"""
from __future__ import annotations

import argparse
import gzip
import os
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fleetx import fleet

DATA = os.environ.get("FASHION_MNIST_DIR", "/usr/share/datasets/fashion-mnist")


def load_slice(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``n`` training images (flattened, scaled to [0, 1]) and their labels."""
    def read(name: str, header: int) -> np.ndarray:
        path = os.path.join(DATA, name)
        if not os.path.exists(path):
            raise SystemExit(f"{path} not found: apt-get install -y dataset-fashion-mnist")
        with gzip.open(path, "rb") as f:
            return np.frombuffer(f.read(), np.uint8, offset=header)
    x = read("train-images-idx3-ubyte.gz", 16).reshape(-1, 784)[:n].astype(np.float32) / 255
    y = read("train-labels-idx1-ubyte.gz", 8)[:n].astype(np.int64)
    return torch.from_numpy(x), torch.from_numpy(y)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=12000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch_size", type=int, default=50, help="per process")
    parser.add_argument("--save", default="", help="write the trained weights here")
    args = parser.parse_args()

    # 1. A strategy says which distributed algorithms to use. The defaults are plain data
    #    parallel; here we only choose a smaller gradient bucket for this small model.
    strategy = fleet.DistributedStrategy()
    strategy.fuse_grad_size_in_MB = 4

    # 2. Join the job. Under fleetrun (or torchrun) this connects to the other processes; run
    #    with plain `python` it is a one-process job.
    fleet.init(is_collective=True, strategy=strategy)
    rank, world = fleet.worker_index(), fleet.worker_num()

    # 3. Build the model exactly as on one machine. The same seed on every rank gives the same
    #    initial weights (DDP also broadcasts rank 0's weights to be sure).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10))

    # 4. Wrap model and optimizer. With several processes the model becomes data parallel; the
    #    optimizer wrapper runs every step through the strategies of the plan.
    model = fleet.distributed_model(model)
    optimizer = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1,
                                                            momentum=0.9))
    if fleet.is_first_worker():
        fleet.explain()  # what will run, and why

    # 5. Each rank trains on its own shard of the data.
    x, y = load_slice(args.samples)
    x_mine, y_mine = x[rank::world], y[rank::world]
    steps = len(x_mine) // args.batch_size
    for epoch in range(args.epochs):
        start, total = time.monotonic(), 0.0
        for step in range(steps):
            sl = slice(step * args.batch_size, (step + 1) * args.batch_size)
            loss = F.cross_entropy(model(x_mine[sl]), y_mine[sl])
            optimizer.minimize(loss)  # backward + step + zero_grad
            total += loss.item()
        # 6. fleet.util reduces plain numbers across ranks (on a gloo group, also beside NCCL).
        mean_loss = fleet.util.all_reduce(total / steps) / world
        rate = fleet.util.all_reduce(steps * args.batch_size) / (time.monotonic() - start)
        fleet.util.print_on_rank(f"epoch {epoch}: loss {mean_loss:.4f}, {rate:,.0f} samples/s", 0)

    # 7. Every rank holds the same weights; the first worker saves them. The keys are the plain
    #    model's, so the file loads into a one-process model unchanged.
    with torch.no_grad():
        accuracy = (model(x).argmax(1) == y).float().mean().item()
    fleet.util.print_on_rank(f"accuracy on the {len(x)} training images: {accuracy:.3f}", 0)
    if args.save and fleet.is_first_worker():
        torch.save(model.state_dict(), args.save)
    # No final barrier: the other ranks may end while this one saves (fleetrun ends every
    # process cleanly; under torchrun, start the script with `python -m fleetx.run`).


if __name__ == "__main__":
    main()
