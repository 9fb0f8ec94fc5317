"""A collective job that shows its progress and logs its scalars: ``fleet.observe``.

    python examples/observe.py --scalars_dir runs/obs                      # 1 process
    fleetrun --nproc_per_node 2 examples/observe.py --scalars_dir runs/obs  # 2 processes
    fleetrun --plot runs/obs                                              # runs/obs/scalars.png
    tensorboard --logdir runs/obs/tb                                      # one run per rank

Worker 0 draws a tqdm bar (samples/s and loss) on the terminal; every rank writes
``scalars.<rank>.csv`` and a TensorBoard run every ``--every`` steps; fleetrun's end-of-job
summary shows each rank's samples/s. Needs ``pip install "fleetx[observe]"``. The data is
synthetic (a linear teacher plus noise), so the example runs anywhere in seconds.
"""
from __future__ import annotations

import argparse

import torch
from torch import nn

from fleetx import fleet


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch_size", type=int, default=64, help="per process")
    parser.add_argument("--every", type=int, default=10, help="log the scalars every N steps")
    parser.add_argument("--scalars_dir", default="runs/observe")
    parser.add_argument("--amp", action="store_true", help="also log amp's loss scale")
    args = parser.parse_args()

    strategy = fleet.DistributedStrategy()
    strategy.amp = args.amp
    fleet.init(is_collective=True, strategy=strategy)
    torch.manual_seed(fleet.worker_index())  # each rank its own data
    teacher = torch.randn(32, 1, generator=torch.Generator().manual_seed(0))
    model = fleet.distributed_model(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)))
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.05))

    with fleet.observe(total=args.steps, batch_size=args.batch_size, every=args.every,
                       scalars_dir=args.scalars_dir) as obs:
        for _ in range(args.steps):
            x = torch.randn(args.batch_size, 32)
            y = x @ teacher + 0.1 * torch.randn(args.batch_size, 1)
            loss = nn.functional.mse_loss(model(x), y)
            opt.minimize(loss)
            obs.step(loss)  # the loss is read only every --every steps
    if fleet.worker_index() == 0:
        print(f"scalars in {args.scalars_dir}; plot them with: fleetrun --plot {args.scalars_dir}")


if __name__ == "__main__":
    main()
