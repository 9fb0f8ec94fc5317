"""Launched by tests/launch/test_elastic_resume.py: data-parallel SGD with momentum for
``--steps`` steps, each rank's batch chosen by (step, rank), so that any run of it ends with the
same parameters. The checkpoint folder is resumed from when it holds a checkpoint:

* ``--mode manual``: ``fleet.save_checkpoint(ckpt, extra={"step": ...})`` every ``--every``
  steps, ``fleet.load_checkpoint(ckpt)["step"]`` to resume;
* ``--mode auto``: ``fleet.auto_checkpoint(ckpt, every_steps=--every)`` does both.

With ``--kill-at S`` rank ``--kill-rank`` SIGKILLs itself right after step S in the first worker
group only (``TORCHELASTIC_RESTART_COUNT`` 0). Rank 0 saves the final parameters to ``--out``.
``--sleep`` slows each step down, for a test that stops a node in the middle of training.
"""
import argparse
import os
import signal
import time

import torch
import torch.nn.functional as F

from fleetx import env, fleet
from fleetx.checkpoint import has_checkpoint

parser = argparse.ArgumentParser()
parser.add_argument("--mode", choices=("manual", "auto"), default="manual")
parser.add_argument("--ckpt", required=True)
parser.add_argument("--out", required=True)
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--every", type=int, default=4)
parser.add_argument("--kill-at", type=int, default=-1)
parser.add_argument("--kill-rank", type=int, default=1)
parser.add_argument("--sleep", type=float, default=0.0, help="seconds per step")
args = parser.parse_args()

restart = env.get_int("TORCHELASTIC_RESTART_COUNT")
fleet.init(is_collective=True)
rank = fleet.worker_index()
torch.manual_seed(0)
model = fleet.distributed_model(torch.nn.Sequential(
    torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)))
optimizer = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.05,
                                                        momentum=0.9))
if args.mode == "auto":
    start = fleet.auto_checkpoint(args.ckpt, every_steps=args.every)
else:
    start = fleet.load_checkpoint(args.ckpt)["step"] if has_checkpoint(args.ckpt) else 0
print(f"rank {rank} restart {restart} starts at step {start} of {fleet.worker_num()}", flush=True)


def batch(step: int):
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 8, generator=generator), torch.randint(0, 3, (16,),
                                                                   generator=generator)


for step in range(start, args.steps):
    x, y = batch(step)
    optimizer.minimize(F.cross_entropy(model(x), y))
    done = step + 1
    if args.mode == "manual" and done % args.every == 0:
        fleet.save_checkpoint(args.ckpt, extra={"step": done})
    if restart == 0 and rank == args.kill_rank and done == args.kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
    if args.sleep:
        print(f"rank {rank} of {fleet.worker_num()} took step {done}", flush=True)
        time.sleep(args.sleep)
if rank == 0:
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, args.out)
