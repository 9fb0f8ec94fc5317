"""What ``fleet.observe`` costs a training loop (``docs/observability.md``).

One process, a small MLP (784-256-10, batch 64, SGD: about the cheapest step worth observing, so
the cost shows), ``--steps`` steps per run, four variants run alternately, best of ``--rounds``:

* ``plain``: no observer;
* ``counting``: ``obs.step(loss)`` with no bar and no scalars (the hot path alone);
* ``scalars``: CSV and TensorBoard scalars every 10 steps (``.item()`` of the kept losses, a row
  per file);
* ``bar+scalars``: the same with the tqdm bar drawn (to /dev/null).

    python benchmarks/observe_cost.py [--steps 2000] [--rounds 5]

Prints one JSON line: per variant, the microseconds per step spent inside ``obs.step`` (timed
around each call, amortised over the logged steps: the observer's own price, precise), and the
whole loop's microseconds per step (median over the rounds) with its extra over ``plain``
(coarser: a loop's run-to-run spread is larger than the observer's price on this step).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time

import torch

from fleetx import fleet

VARIANTS = ("plain", "counting", "scalars", "bar+scalars")


def _observer(variant: str, steps: int, folder: str):
    if variant == "plain":
        return contextlib.nullcontext(None)
    return fleet.observe(total=steps, batch_size=64, every=10,
                         progress=variant == "bar+scalars",
                         force_progress=variant == "bar+scalars",
                         scalars_dir=None if variant == "counting" else folder)


def run(variant: str, steps: int, model, opt, batches) -> tuple[float, float]:
    """Seconds per step of ``steps`` steps under ``variant``: the whole loop's, and the part
    spent inside ``obs.step``."""
    inside = 0.0
    clock = time.perf_counter
    with tempfile.TemporaryDirectory() as folder, open(os.devnull, "w") as null, \
            contextlib.redirect_stderr(null):
        start = clock()
        with _observer(variant, steps, folder) as obs:
            for i in range(steps):
                x, y = batches[i % len(batches)]
                loss = torch.nn.functional.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                if obs is not None:
                    t = clock()
                    obs.step(loss)
                    inside += clock() - t
        return (clock() - start) / steps, inside / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    fleet.init(is_collective=True)
    model = fleet.distributed_model(torch.nn.Sequential(
        torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)))
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.01))
    batches = [(torch.randn(64, 784), torch.randint(0, 10, (64,))) for _ in range(16)]
    run("plain", 200, model, opt, batches)  # warm up
    loops = {v: [] for v in VARIANTS}
    inside = {v: [] for v in VARIANTS}
    for _ in range(args.rounds):  # alternating: drifts of the machine hit every variant alike
        for v in VARIANTS:
            loop, spent = run(v, args.steps, model, opt, batches)
            loops[v].append(loop)
            inside[v].append(spent)
    loop = {v: statistics.median(x) for v, x in loops.items()}
    plain = loop["plain"]
    out = {"steps": args.steps, "rounds": args.rounds,
           "inside_obs_step_us": {v: round(statistics.median(inside[v]) * 1e6, 2)
                                  for v in VARIANTS if v != "plain"},
           "loop_us_per_step": {v: round(s * 1e6, 1) for v, s in loop.items()},
           "loop_extra_us_per_step": {v: round((s - plain) * 1e6, 1) for v, s in loop.items()
                                      if v != "plain"},
           "loop_spread_us": {v: round((max(x) - min(x)) * 1e6, 1) for v, x in loops.items()}}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
