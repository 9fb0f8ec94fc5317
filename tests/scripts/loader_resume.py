"""Launched by tests/launch/test_loader_fleetrun.py: data-parallel SGD with momentum for 2
epochs over ``fleet.distributed_loader`` (42 samples, 3 per batch and rank, ``--workers``
DataLoader workers), ``fleet.auto_checkpoint(--ckpt, every_steps=--every)``. With ``--kill-at S``
rank 1 SIGKILLs itself right after step S in the first worker group only. Rank 0 saves the final
parameters and every rank its batches' sample indices to ``--out``.
"""
import argparse
import os
import signal

import torch
from torch import nn
from torch.utils.data import TensorDataset

from fleetx import env, fleet

parser = argparse.ArgumentParser()
parser.add_argument("--ckpt", required=True)
parser.add_argument("--out", required=True)
parser.add_argument("--every", type=int, default=4)
parser.add_argument("--workers", type=int, default=2)
parser.add_argument("--kill-at", type=int, default=-1)
args = parser.parse_args()

restart = env.get_int("TORCHELASTIC_RESTART_COUNT")
fleet.init(is_collective=True)
rank = fleet.worker_index()
g = torch.Generator().manual_seed(5)
data = TensorDataset(torch.randn(42, 4, generator=g), torch.randn(42, 1, generator=g),
                     torch.arange(42))
torch.manual_seed(0)
model = fleet.distributed_model(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)))
opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
loader = fleet.distributed_loader(data, 3, seed=11, num_workers=args.workers)
step = fleet.auto_checkpoint(args.ckpt, every_steps=args.every)
print(f"rank {rank} restart {restart} starts at step {step} epoch {loader.epoch}", flush=True)
seen = []
for epoch in range(loader.epoch, 2):
    for x, y, index in loader:
        opt.minimize(nn.functional.mse_loss(model(x), y))
        seen.append((step, index.tolist()))
        step += 1
        if restart == 0 and rank == 1 and step == args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
torch.save({"params": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "seen": seen}, f"{args.out}.{rank}")
