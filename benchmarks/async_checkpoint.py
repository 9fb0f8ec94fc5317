"""How long a checkpoint blocks the training loop: ``fleet.save_checkpoint`` synchronous
against ``async_save=True``, in the same run, alternating (``docs/reliability.md``).

Two gloo processes, one thread each, train an MLP whose state (parameters and Adam's two
moments) is ``--mb`` megabytes per rank. Each round measures the median step time without a
save (the baseline), then one save of each kind (their order alternates between rounds):

* blocked by a synchronous save: the time of the call;
* blocked by an asynchronous save: the time of the call (the entry, the save id, the copy into
  CPU memory) plus the slowdown of the steps that run while it writes, that is the time of the
  steps from the call until the save is done (and two more) minus as many baseline steps.

The ratio is the median over rounds of the asynchronous figure over the synchronous one.

    python benchmarks/async_checkpoint.py [--mb 120] [--rounds 7] [--ranks 2]

Prints one JSON line (rank 0's figures).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn

from ports import free_port, start_processes

_BATCH = 32


def _model(mb: float) -> nn.Module:
    # Adam keeps two moments per parameter: the state is 3 x 4 bytes per parameter
    width = max(16, int((mb * 1e6 / 12 / 2) ** 0.5))
    return nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))


def _step(model, opt, x) -> float:
    start = time.perf_counter()
    opt.minimize(model(x).square().mean())
    return time.perf_counter() - start


def _blocked_sync(fleet, model, opt, x, path: str) -> float:
    start = time.perf_counter()
    fleet.save_checkpoint(path)
    return time.perf_counter() - start


def _blocked_async(fleet, model, opt, x, path: str, base: float) -> tuple:
    start = time.perf_counter()
    handle = fleet.save_checkpoint(path, async_save=True)
    call = time.perf_counter() - start
    steps, spent = 0, 0.0
    # every rank runs as many steps as the slowest needs (the loop's collectives must match)
    while True:
        done = torch.tensor([1 if handle.done() else 0])
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
        if done.item() and steps >= 2:
            break
        spent += _step(model, opt, x)
        steps += 1
    handle.wait()
    return call + max(0.0, spent - steps * base), call, steps


def _run(rank: int, world: int, port: int, mb: float, rounds: int, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from fleetx import fleet

    fleet.init(is_collective=True)
    torch.manual_seed(0)
    plain = _model(mb)
    model = fleet.distributed_model(plain)
    opt = fleet.distributed_optimizer(torch.optim.Adam(model.parameters(), lr=1e-4))
    x = torch.randn(_BATCH, plain[0].in_features)
    _step(model, opt, x)
    state_mb = sum(t.numel() * t.element_size() for t in model.parameters()) * 3 / 1e6
    holder = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    path = os.path.join(holder[0], "ckpt")
    fleet.save_checkpoint(path, async_save=True).wait()  # the staging buffers, made once
    sync, asyn, calls, overlapped, bases = [], [], [], [], []
    for r in range(rounds):
        base = statistics.median(_step(model, opt, x) for _ in range(5))
        bases.append(base)
        for kind in (("sync", "async") if r % 2 else ("async", "sync")):
            if kind == "sync":
                sync.append(_blocked_sync(fleet, model, opt, x, path))
            else:
                blocked, call, steps = _blocked_async(fleet, model, opt, x, path, base)
                asyn.append(blocked)
                calls.append(call)
                overlapped.append(steps)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"bench": "async_checkpoint", "ranks": world, "rounds": rounds,
                       "state_mb_per_rank": round(state_mb, 1),
                       "step_ms": 1e3 * statistics.median(bases),
                       "sync_blocked_ms": 1e3 * statistics.median(sync),
                       "async_blocked_ms": 1e3 * statistics.median(asyn),
                       "async_call_ms": 1e3 * statistics.median(calls),
                       "steps_during_async_write": statistics.median(overlapped),
                       "ratio": statistics.median(a / s for a, s in zip(asyn, sync))}, f)
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=120.0,
                        help="state per rank in MB (parameters + Adam's moments)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--ranks", type=int, default=2,
                        help="training processes, one thread each (1 leaves a core idle, as "
                             "on a GPU host whose CPU waits for the device)")
    parser.add_argument("--out", default="/tmp/fleetx_async_checkpoint.json")
    args = parser.parse_args()
    start_processes(_run, args=(args.ranks, free_port(), args.mb, args.rounds, args.out),
                    nprocs=args.ranks,
                    start_method="spawn")
    with open(args.out) as f:
        print(f.read())


if __name__ == "__main__":
    main()
