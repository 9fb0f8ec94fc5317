"""Launched by tests/launch/test_netns_jobs.py on two "nodes": data-parallel least squares in
float64 through the public fleet API (DDP over gloo, SGD with momentum).

Usage: netns_train.py OUT STEPS [SLEEP]. Rank r trains on rows r, r + world, ... of each step's
union batch (``union_batch``), so the averaged gradient is the union batch's; each step prints
``step N loss L`` and sleeps SLEEP seconds (so a test can cut the link mid-training). Rank 0
writes ``OUT/params.json``: the weight and bias after the last step.
"""
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from fleetx import fleet

FEATURES, BATCH, LR, MOMENTUM = 4, 8, 0.02, 0.5


def union_batch(step: int):
    """Step ``step``'s inputs and targets for the whole job (the same on every node)."""
    rng = np.random.RandomState(1000 + step)
    x = rng.randn(BATCH, FEATURES)
    y = x @ np.arange(1.0, FEATURES + 1) + 0.5 + 0.01 * rng.randn(BATCH)
    return x, y


if __name__ == "__main__":
    out, steps = Path(sys.argv[1]), int(sys.argv[2])
    pause = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
    fleet.init(is_collective=True)
    rank, world = fleet.worker_index(), fleet.worker_num()
    layer = torch.nn.Linear(FEATURES, 1).double()
    with torch.no_grad():  # a fixed start, the same as the test's reference
        layer.weight.zero_()
        layer.bias.zero_()
    model = fleet.distributed_model(layer)
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=LR,
                                                      momentum=MOMENTUM))
    for step in range(steps):
        x, y = union_batch(step)
        xs, ys = torch.from_numpy(x[rank::world]), torch.from_numpy(y[rank::world])
        loss = (model(xs).squeeze(1) - ys).pow(2).mean()
        loss.backward()
        opt.step()
        opt.clear_grad()
        print(f"step {step} loss {loss.item():.6f}", flush=True)
        time.sleep(pause)
    if rank == 0:
        (out / "params.json").write_text(json.dumps({
            "weight": layer.weight.detach().view(-1).tolist(), "bias": layer.bias.item()}))
