"""What naming stragglers costs a training step (``docs/reliability.md``, stragglers).

Data parallel over ``--nproc_per_node`` processes, a small MLP (784-256-10, batch 64 per rank,
SGD: a cheap step, so the cost shows). Each round runs ``--steps`` steps twice, alternately:
``off`` with the fleet's step timer removed, ``on`` with a fresh one (the timing of every step,
the step-time histogram in a log folder, the window exchange every ``--window`` steps). Prints
one JSON line (rank 0): the median microseconds per step of each, and ``on / off``.

    fleetrun --nproc_per_node 2 benchmarks/straggler_cost.py [--steps 2000] [--rounds 7]
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from fleetx import fleet
from fleetx.fleet.stragglers import StragglerWatch
from fleetx.observe.steptimes import StepTimes


def _steps(model, opt, batch, steps: int) -> float:
    x, y = batch
    start = time.perf_counter()
    for _ in range(steps):
        opt.minimize(torch.nn.functional.cross_entropy(model(x), y))
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--window", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    fleet.init(is_collective=True)
    rank, world = fleet.worker_index(), fleet.worker_num()
    torch.manual_seed(0)
    model = fleet.distributed_model(torch.nn.Sequential(
        torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)))
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.01))
    fleet._fleet._stragglers.close()  # the fleet's own timer: the benchmark adds its own
    batch = (torch.randn(64, 784), torch.randint(0, 10, (64,)))
    _steps(model, opt, batch, 50)  # warm up
    times: dict[str, list[float]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as log_dir:
        for _ in range(args.rounds):
            times["off"].append(_steps(model, opt, batch, args.steps))
            watch = StragglerWatch(opt, rank, world, args.window, StepTimes(log_dir, rank))
            times["on"].append(_steps(model, opt, batch, args.steps))
            watch.close()
    if rank == 0:
        off, on = (statistics.median(times[k]) for k in ("off", "on"))
        print(json.dumps({"world": world, "steps": args.steps, "rounds": args.rounds,
                          "window": args.window, "off_us": round(off * 1e6, 1),
                          "on_us": round(on * 1e6, 1), "on_over_off": round(on / off, 4)}))


if __name__ == "__main__":
    main()
