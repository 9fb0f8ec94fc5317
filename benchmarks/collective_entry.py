"""What the entry of fleetx's collective calls costs (``docs/reliability.md``, checkpoints).

``fleet.save_checkpoint`` / ``load_checkpoint`` / ``consolidated_model`` (and ``state_dict`` at
sharding stages 2 and 3) first wait until every rank has entered them, so that a rank that will
not come is named at once. Two gloo processes, one thread each:

* ``entry``: microseconds per entry alone (``--calls`` entries in a row, best of ``--rounds``),
  against a ``dist.barrier()`` on the same processes (the cheapest collective: the baseline);
* ``save``: ``fleet.save_checkpoint`` of a small MLP with the entry and without it (the entry
  switched off), alternating, median over ``--rounds``: the entry's share of a real call.

    python benchmarks/collective_entry.py [--calls 200] [--rounds 7]

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


def _per_call(fn, calls: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def _run(rank: int, world: int, port: int, calls: int, rounds: int, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from fleetx import fleet
    from fleetx.fleet import _fleet

    fleet.init(is_collective=True)
    torch.manual_seed(0)
    model = fleet.distributed_model(nn.Sequential(nn.Linear(256, 256), nn.ReLU(),
                                                  nn.Linear(256, 10)))
    opt = fleet.distributed_optimizer(torch.optim.Adam(model.parameters(), lr=1e-3))
    opt.minimize(model(torch.randn(8, 256)).square().mean())
    comm = _fleet._comm
    entry = [_per_call(lambda: _fleet._enter("bench"), calls) for _ in range(rounds)]
    barrier = [_per_call(dist.barrier, calls) for _ in range(rounds)]
    folder, with_entry, without = tempfile.mkdtemp() if rank == 0 else None, [], []
    holder = [folder]
    dist.broadcast_object_list(holder, src=0)
    path = os.path.join(holder[0], "ckpt")
    enter = comm.enter
    for r in range(rounds):  # alternating, each first in every other round
        for on in ((True, False) if r % 2 else (False, True)):
            comm.enter = enter if on else (lambda what: None)
            (with_entry if on else without).append(
                _per_call(lambda: fleet.save_checkpoint(path), 5))
    comm.enter = enter
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"bench": "collective_entry", "calls": calls, "rounds": rounds,
                       "entry_us": 1e6 * min(entry), "barrier_us": 1e6 * min(barrier),
                       "save_with_entry_ms": 1e3 * statistics.median(with_entry),
                       "save_without_entry_ms": 1e3 * statistics.median(without),
                       "save_ratio": statistics.median(with_entry) / statistics.median(without)},
                      f)
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default="/tmp/fleetx_collective_entry.json")
    args = parser.parse_args()
    start_processes(_run, args=(2, free_port(), args.calls, args.rounds, args.out), nprocs=2,
                    start_method="spawn")
    with open(args.out) as f:
        print(f.read())


if __name__ == "__main__":
    main()
