"""The same script on every role of a parameter-server job (tests/distributed/test_ps_fleet_*).

Workers train ``ps_fleet_model.Net`` on their share of each step's batch through the public
fleet API and write ``<out>/worker<rank>.npz``: the losses, the evaluation loss before and
after, how long a first evaluation took, and the final weights (rows read back with
evaluation lookups). Servers serve until every worker stopped.
"""
import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ps_fleet_model import (TAGS, VOCAB, batch, loss_of, make_model,  # noqa: E402
                            make_optimizer, snapshot)

from fleetx import fleet  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--mode", default="sync", choices=("sync", "async", "geo"))
ap.add_argument("--a-sync-configs", default="{}", help="JSON")
ap.add_argument("--optimizer", default="adagrad")
ap.add_argument("--lr", type=float, default=0.1)
ap.add_argument("--start", type=int, default=0)
ap.add_argument("--steps", type=int, default=4)
ap.add_argument("--save", default=None)
ap.add_argument("--save-at", action="append", default=[],
                help="STEP:MODE:DIR: save_persistables(DIR, MODE) after step STEP")
ap.add_argument("--load", default=None, help="a save folder, or base,delta,... (a chain)")
ap.add_argument("--sleep-rank1", type=float, default=0.0)
ap.add_argument("--stop-rank1-after", type=int, default=-1)
ap.add_argument("--pause", type=float, default=0.0, help="seconds to sleep after each step")
ap.add_argument("--prefetch", action="store_true", help="iterate through fleet.prefetch")
ap.add_argument("--observe", default=None, help="fleet.observe's scalars_dir (every step)")
args = ap.parse_args()

fleet.init()
model = fleet.distributed_model(make_model())
strategy = fleet.DistributedStrategy()
strategy.a_sync = args.mode != "sync"
strategy.a_sync_configs = json.loads(args.a_sync_configs)
opt = fleet.distributed_optimizer(make_optimizer(args.optimizer, model.parameters(), args.lr),
                                  strategy)

if fleet.is_server():
    fleet.init_server(args.load.split(",") if args.load and "," in args.load else args.load)
    fleet.run_server()
    sys.exit(0)


def evaluate() -> float:
    model.eval()
    with torch.no_grad():
        loss = np.mean([loss_of(model, *batch(s)).item() for s in range(8)])
    model.train()
    return float(loss)


rank, nranks = fleet.worker_index(), fleet.worker_num()
fleet.init_worker()
began = time.monotonic()
eval_before = evaluate()  # rank 1 may still be asleep: reads never wait for it
eval_seconds = time.monotonic() - began
if rank == 1:
    time.sleep(args.sleep_rank1)
pushes = []
comm = getattr(getattr(fleet._fleet._ctx.runtime, "_session", None), "comm", None)
if comm is not None:  # count the requests that carry gradients (async merging)
    push = comm.client.push
    comm.client.push = lambda *a, **k: (pushes.append(1), push(*a, **k))[1]
losses = []
steps = range(args.start, args.start + args.steps)
batches = ((s, batch(s, rank, nranks)) for s in steps)
if args.prefetch:  # the next batch's rows travel while this one trains (module or table name)
    batches = fleet.prefetch(batches, lambda b: {model.module.emb: b[1][0], "tags": b[1][1]})
observer = fleet.observe(every=1, progress=False, tensorboard=False,
                         scalars_dir=args.observe) if args.observe else None
for step, data in batches:
    if rank == 1 and step == args.stop_rank1_after:
        break
    loss = loss_of(model, *data)
    opt.minimize(loss)
    losses.append(loss.item())
    if observer is not None:
        observer.step(loss, samples=len(data[0]))
    if args.pause:
        print(f"worker {rank} step {step}", flush=True)
        time.sleep(args.pause)
    for at in args.save_at:
        at_step, mode, dirname = at.split(":", 2)
        if int(at_step) == step:
            fleet.save_persistables(dirname, mode=int(mode))
if observer is not None:
    observer.close()
backend = getattr(getattr(fleet._fleet._ctx.runtime, "_session", None), "backend", None)
prefetched = getattr(backend, "prefetched", None)
hits, misses = (prefetched.hits, prefetched.misses) if prefetched else (0, 0)
if args.save:
    fleet.save_persistables(args.save)
eval_after = evaluate()
model.eval()
with torch.no_grad():  # the rows as the servers (or, in GEO, this worker) hold them now
    emb = model.emb(torch.arange(VOCAB))
    tags = model.tags(torch.arange(TAGS).view(-1, 1))
    record = snapshot(emb, tags, model.mlp)
fleet.stop_worker()
np.savez(Path(args.out) / f"worker{rank}.npz", losses=np.array(losses), eval_before=eval_before,
         eval_after=eval_after, eval_seconds=eval_seconds, pushes=len(pushes),
         prefetch_hits=hits, prefetch_misses=misses, **record)
print(f"worker {rank} done: eval loss {eval_before:.4f} -> {eval_after:.4f}", flush=True)
