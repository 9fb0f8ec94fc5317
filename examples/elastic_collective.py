"""A collective job that survives a lost process: ``fleet.auto_checkpoint`` saves every k
optimizer steps and, when fleetrun restarts the worker group, restores the training and says
where to resume.

    fleetrun --nproc_per_node 2 --max_restarts 3 examples/elastic_collective.py --ckpt ckpt
    # on each of 1 to 2 nodes, sharing the folder ckpt (a shared filesystem):
    fleetrun --nnodes 1:2 --master 10.0.0.1:29400 --max_restarts 3 \\
        examples/elastic_collective.py --ckpt /shared/ckpt

``--kill-at S`` makes rank 1 kill itself (SIGKILL) after step S in the first worker group only,
to watch a restart: fleetrun names the killed rank and the steps lost since the checkpoint, and
the restarted ranks go on from it. The batches are chosen by step and rank, so the parameters at
the end are those of a run that was never interrupted (at the same world size).
"""
from __future__ import annotations

import argparse
import os
import signal

import torch
import torch.nn.functional as F
from torch import nn

from fleetx import env, fleet


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of ``rank`` at ``step``: a function of both, so that a resumed run sees the
    same data as an uninterrupted one (a real loader would seek to the step)."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(32, 20, generator=generator)
    return x, (x[:, :5].sum(1) > 0).long()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", default="ckpt", help="checkpoint folder")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=20, help="optimizer steps between saves")
    parser.add_argument("--kill-at", type=int, default=-1)
    args = parser.parse_args()

    fleet.init(is_collective=True)
    rank = fleet.worker_index()
    torch.manual_seed(0)
    model = fleet.distributed_model(nn.Sequential(nn.Linear(20, 32), nn.ReLU(),
                                                  nn.Linear(32, 2)))
    optimizer = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.05,
                                                            momentum=0.9))
    # Restores model, optimizer and strategy state when the folder holds a checkpoint (a
    # restarted job) and returns the optimizer steps it had taken; 0 on a fresh start.
    start = fleet.auto_checkpoint(args.ckpt, every_steps=args.every)
    restart = env.get_int("TORCHELASTIC_RESTART_COUNT")
    fleet.util.print_on_rank(f"restart {restart}: starting at step {start} of {args.steps} "
                             f"with {fleet.worker_num()} process(es)", 0)
    for step in range(start, args.steps):
        x, y = batch(step, rank)
        loss = F.cross_entropy(model(x), y)
        optimizer.minimize(loss)  # saves into --ckpt after every --every steps
        if restart == 0 and rank == 1 and step + 1 == args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if (step + 1) % 50 == 0:
            fleet.util.print_on_rank(f"step {step + 1}: loss {loss.item():.4f}", 0)


if __name__ == "__main__":
    main()
