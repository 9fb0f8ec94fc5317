"""A data-parallel toy job for ``fleetrun --fault_tolerance heal`` tests.

Every rank trains a linear model with SGD on batches chosen by the step and by the rank's
launch id, logs one JSON line per step (its pid, rank, world size, loss, and the parameters after
the step), and a rank named by ``--kill RANK:STEP`` SIGKILLs (or ``--freeze``: SIGSTOPs) itself
after that step, once (its first process only). ``--strategy`` picks amp, gradient_merge,
localsgd or sharding on top of data parallel.
"""
import argparse
import json
import os
import signal
import time

import torch

from fleetx import DistributedStrategy, env, fleet

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--kill", default="")
parser.add_argument("--freeze", action="store_true")
parser.add_argument("--strategy", default="")
parser.add_argument("--out", required=True)
parser.add_argument("--sleep", type=float, default=0.05)
args = parser.parse_args()

strategy = DistributedStrategy()
if args.strategy == "amp":
    strategy.amp = True
elif args.strategy == "gradient_merge":
    strategy.gradient_merge = True
    strategy.gradient_merge_configs = {"k_steps": 2, "avg": True}
elif args.strategy == "localsgd":
    strategy.localsgd = True
    strategy.localsgd_configs = {"k_steps": 2, "begin_step": 1}
elif args.strategy == "sharding":
    strategy.sharding = True
    strategy.sharding_configs = {"stage": 1}
fleet.init(is_collective=True, strategy=strategy)
slot = env.get_int("RANK")
torch.manual_seed(0)
model = fleet.distributed_model(torch.nn.Linear(4, 1, bias=False))
opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
k = 2 if args.strategy == "gradient_merge" else 1
kill_rank, _, kill_step = args.kill.partition(":")
first = env.get_int("FLEETX_HEAL_RESTARTS") == 0 and env.get_int("TORCHELASTIC_RESTART_COUNT") == 0


def batch(step: int, who: int):
    g = torch.Generator().manual_seed(1000 * step + who)
    x = torch.randn(8, 4, generator=g)
    return x, x @ torch.tensor([[1.0], [-2.0], [3.0], [0.5]])


out = open(f"{args.out}.{slot}", "a")
start = fleet.start_step()
out.write(json.dumps({"event": "start", "pid": os.getpid(), "start": start}) + "\n")
for step in range(start * k, args.steps * k):
    x, y = batch(step, slot)
    loss = (model(x) - y).square().mean()
    taken = opt.minimize(loss)
    out.write(json.dumps({"step": step, "pid": os.getpid(), "rank": fleet.worker_index(),
                          "world": fleet.worker_num(), "loss": loss.item(), "taken": taken,
                          "w": model.module.weight.detach().flatten().tolist(),
                          "t": time.time()}) + "\n")
    out.flush()
    if first and kill_rank and int(kill_rank) == slot and step == int(kill_step):
        os.kill(os.getpid(), signal.SIGSTOP if args.freeze else signal.SIGKILL)
    time.sleep(args.sleep)
opt.average_parameters()
out.write(json.dumps({"event": "end", "pid": os.getpid(),
                      "w": model.module.weight.detach().flatten().tolist()}) + "\n")
out.close()
