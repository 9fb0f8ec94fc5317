"""Launched by tests/launch: 2-rank data-parallel training in which rank 1 stops calling
collectives, or calls them differently, at step 3.

Usage: collective_hang.py MODE
  sleep   rank 1 sleeps for good before step 3's backward (rank 0 waits in DDP's all-reduce)
  util    rank 1 sleeps for good instead of step 3's fleet.util.all_reduce
  skip    rank 1 skips step 3's fleet.util.all_reduce
  shape   rank 1's fleet.util.all_reduce of step 3 has another shape
"""
import sys
import time

import numpy as np
import torch

from fleetx import fleet

mode = sys.argv[1]
torch.manual_seed(0)
fleet.init(is_collective=True)
rank = fleet.worker_index()
model = fleet.distributed_model(torch.nn.Linear(4, 1))
opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
for step in range(6):
    loss = model(torch.randn(8, 4)).pow(2).mean()
    if step == 3 and rank == 1 and mode == "sleep":
        print("rank 1: sleeping instead of step 3's backward", flush=True)
        time.sleep(600)
    loss.backward()
    opt.step()
    opt.clear_grad()
    value = np.array([loss.item()])
    if step == 3 and rank == 1 and mode == "util":
        print("rank 1: sleeping instead of step 3's fleet.util.all_reduce", flush=True)
        time.sleep(600)
    if step == 3 and rank == 1 and mode == "skip":
        print("rank 1: skipping step 3's fleet.util.all_reduce", flush=True)
        continue
    if step == 3 and rank == 1 and mode == "shape":
        value = np.array([loss.item(), 0.0])
    total = fleet.util.all_reduce(value)
    print(f"step {step} loss {total[0] / fleet.worker_num():.4f}", flush=True)
