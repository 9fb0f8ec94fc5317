"""Launched by tests/launch/test_first_hour.py under ``fleetrun --nproc_per_node 2``.

A Paddle user's first script: ``fleet.init(strategy=s)`` without ``is_collective=True``, a
``fleet.UtilBase`` subclass assigned to ``fleet.util``, the runtime calls of Paddle's API before
and after ``distributed_optimizer``, and what the plan applied, in Paddle's words. Writes
``<FLEETX_LOG_DIR>/first_hour.<rank>.json``.
"""
import io
import json
import os
import sys

import torch
from torch import nn

from fleetx import env, fleet


class MyUtil(fleet.UtilBase):
    """Paddle's documented pattern: a plain ``super().__init__()``."""

    def __init__(self):
        super().__init__()

    def get_user_id(self):
        return 10


def stderr_of(call):
    """What ``call`` writes to stderr (the logging module's last-resort handler writes there)."""
    old, sys.stderr = sys.stderr, io.StringIO()
    try:
        call()
        return sys.stderr.getvalue()
    finally:
        sys.stderr = old


def runtime_error(call):
    try:
        call()
    except ValueError as err:
        return str(err)
    return None


strategy = fleet.DistributedStrategy()
strategy.amp = True
strategy.recompute = True  # accepted, but nothing in fleetx applies it
fleet.init(strategy=strategy)
rank = fleet.worker_index()
fleet.util = MyUtil()
record = {
    "worker_index": rank, "worker_num": fleet.worker_num(),
    "user_id": fleet.util.get_user_id(),
    "all_reduce": int(fleet.util.all_reduce(rank + 1)),
    "init_worker_before": runtime_error(fleet.init_worker),
    "stop_worker_before": runtime_error(fleet.stop_worker),
    "meta_before": fleet._get_applied_meta_list(),
}
torch.manual_seed(0)
model = fleet.distributed_model(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
final = fleet._final_strategy()
record.update({
    "meta": fleet._get_applied_meta_list(),
    "graph": fleet._get_applied_graph_list(),
    "final": {"amp": final.amp, "recompute": final.recompute, "type": type(final).__name__},
    "init_worker_after": stderr_of(fleet.init_worker),
    "stop_worker_after": stderr_of(fleet.stop_worker),
    "updated": opt.minimize(model(torch.randn(4, 4)).square().mean()),
})
with open(os.path.join(env.get("FLEETX_LOG_DIR"), f"first_hour.{rank}.json"), "w") as f:
    json.dump(record, f)
