"""Sharding stages 1/2/3 against plain data parallel, and against the PyTorch engines they wrap.

For each number of processes in ``--nproc`` (gloo, CPU, one thread per process) one spawn runs:

* **memory**: every case (``data_parallel``, ``stage1``, ``stage2``, ``stage3``, all through
  fleetx, Adam) takes a step, then one more measured step: ``fleet.state_bytes()`` after the
  forward, after the backward and after the optimizer step, and the bytes saved for backward
  by the forward (counted with ``torch.autograd.graph.saved_tensors_hooks``, parameters left
  out). Reported per rank: the state after the backward and step (the figure that falls as 1/N)
  and the peak, the largest of (state after forward + saved activations), state after backward,
  state after step. A model of the peak at three moments, not an allocator reading: inside the
  backward, stage 3 holds one gathered unit more.
* **speed** (only for the counts in ``--time-at``): rounds; each round builds every case afresh
  (the fleetx cases and the same engines used directly: ``DistributedDataParallel`` +
  ``ZeroRedundancyOptimizer`` for stage 1, FSDP2 ``fully_shard`` on each layer then the root for
  stages 2 and 3), warms it up and times a window of steps; the case order rotates every round.
  A window's time is the slowest rank's. Reported: samples/s, the ratio of each stage's step
  time to data parallel's and of fleetx's to the raw engine's (medians over rounds of per-round
  ratios, with interquartile ranges).

The model: an MLP ``--width`` wide with ``--layers`` hidden layers, batch ``--batch`` per rank,
random data. On a 2-core machine, times at 4 or more processes measure contention between the
processes, not the engines; memory figures do not depend on it.

    python benchmarks/sharding.py --nproc 2,4,8 --time-at 2,4 --rounds 7
    python benchmarks/sharding.py --nproc 2 --time-at 2 --rounds 1 --steps 2 --width 64   # smoke

Prints a summary and one JSON line.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import time
import warnings
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from ports import free_port, start_processes
from ratios import quartiles

from fleetx.strategy.measured import SavedForBackward

STAGES = ("stage1", "stage2", "stage3")
FLEETX = ("data_parallel",) + STAGES
RAW = tuple(f"raw_{s}" for s in STAGES)
KEYS = ("parameters", "gradients", "optimizer")
BUCKET_MB = 32  # fleetx's data-parallel bucket (Paddle's fuse_grad_size_in_MB); raw DDP the same


def mlp(width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(layers)]
    return nn.Sequential(*blocks, nn.Linear(width, width))


def build_fleetx(fleet, case: str, args) -> tuple[nn.Module, Callable, object]:
    """A fleetx trainer for ``case``: (model, step(x, y), the optimizer wrapper)."""
    s = fleet.DistributedStrategy()
    if case != "data_parallel":
        s.sharding = True
        s.sharding_configs = {"stage": int(case[-1])}
    fleet.init(is_collective=True, strategy=s)  # a fresh plan; the process group is kept
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the plan's notices, once per case and round
        model = fleet.distributed_model(mlp(args.width, args.layers))
        opt = fleet.distributed_optimizer(torch.optim.Adam(model.parameters(), lr=1e-4))

    def step(x, y):
        opt.minimize(nn.functional.mse_loss(model(x), y))
    return model, step, opt


def build_raw(case: str, args) -> tuple[nn.Module, Callable, None]:
    """The engine of ``raw_stageN`` used directly, as its documentation shows."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel
    model = mlp(args.width, args.layers)
    if case == "raw_stage1":
        model = DistributedDataParallel(model, bucket_cap_mb=BUCKET_MB)
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam,
                                      lr=1e-4)
    else:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model:  # each child holding parameters, then the root
            if any(True for _ in layer.parameters()):
                fully_shard(layer, mesh=mesh, reshard_after_forward=case == "raw_stage3")
        fully_shard(model, mesh=mesh, reshard_after_forward=case == "raw_stage3")
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)

    def step(x, y):
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model, step, None


def measure_memory(fleet, case: str, args, x, y) -> dict:
    """One step of ``case`` read at three moments (see the module docstring)."""
    model, step, opt = build_fleetx(fleet, case, args)
    step(x, y)  # every parameter gets its optimizer state
    with SavedForBackward() as saved:
        loss = nn.functional.mse_loss(model(x), y)
    after_forward = fleet.state_bytes()
    opt.backward(loss)
    after_backward = fleet.state_bytes()
    opt.step()
    after_step = fleet.state_bytes()
    opt.zero_grad()
    peak = max(sum(after_forward.values()) + saved.bytes, sum(after_backward.values()),
               sum(after_step.values()))
    return {"state": {k: after_step[k] for k in KEYS}, "in_forward": after_forward,
            "activations": saved.bytes, "peak": peak,
            "expected": str(fleet.explain(file=io.StringIO()).footprint)}


def _window(step: Callable, batches: list, steps: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for i in range(steps):
        step(*batches[i % len(batches)])
    dist.barrier()  # the window ends when the slowest rank is done
    return (time.perf_counter() - start) / steps


def measure_speed(fleet, args, batches: list) -> dict:
    cases = FLEETX + RAW
    times: dict[str, list] = {c: [] for c in cases}
    for r in range(args.rounds):
        for case in cases[r % len(cases):] + cases[:r % len(cases)]:  # rotate the order
            _, step, _ = build_raw(case, args) if case in RAW else build_fleetx(fleet, case, args)
            _window(step, batches, args.warmup)
            times[case].append(_window(step, batches, args.steps))
    return times


def _entry(rank: int, world: int, port: int, args, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from fleetx import fleet
    fleet.init(is_collective=True)
    g = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(args.batch, args.width, generator=g),
                torch.randn(args.batch, args.width, generator=g)) for _ in range(4)]
    memory = {case: measure_memory(fleet, case, args, *batches[0]) for case in FLEETX}
    gathered: list = [None] * world
    dist.all_gather_object(gathered, memory)
    times = measure_speed(fleet, args, batches) if world in args.time_at else None
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"memory": gathered, "times": times}, f)
    dist.barrier()


def report_memory(world: int, ranks: list) -> dict:
    """Per case: the largest rank's figures, each as a fraction of data parallel's, and the
    mean over ranks of the optimizer state (ZeRO's partition is uneven when parameters are)."""
    summary = {}
    base = {k: max(r["data_parallel"]["state"][k] for r in ranks) for k in KEYS}
    base["peak"] = max(r["data_parallel"]["peak"] for r in ranks)
    for case in FLEETX:
        top = {k: max(r[case]["state"][k] for r in ranks) for k in KEYS}
        top["peak"] = max(r[case]["peak"] for r in ranks)
        top["activations"] = max(r[case]["activations"] for r in ranks)
        top["optimizer_mean"] = statistics.mean(r[case]["state"]["optimizer"] for r in ranks)
        summary[case] = top
        shares = "  ".join(f"{k} {top[k]:>12,} B (x{top[k] / base[k]:.3f})" for k in
                           KEYS + ("peak",))
        print(f"  N={world} {case:>13}: {shares}  (optimizer mean over ranks "
              f"x{top['optimizer_mean'] / base['optimizer']:.3f})")
    print(f"  N={world} expected at stage 3: {ranks[0]['stage3']['expected']}")
    return summary


def report_speed(world: int, times: dict, samples: int) -> dict:
    summary = {}
    for case in FLEETX + RAW:
        entry = {"ms_per_step": 1000 * statistics.median(times[case]),
                 "samples_per_s": samples / statistics.median(times[case])}
        versus = [("data_parallel", "vs_data_parallel")]
        if case in STAGES:
            versus.append((f"raw_{case}", "vs_raw"))
        text = ""
        for other, key in versus if case != "data_parallel" else ():
            q1, med, q3 = quartiles([a / b for a, b in zip(times[case], times[other])])
            entry[key] = {"median": med, "q1": q1, "q3": q3}
            text += f", x{med:.3f} of {other} (IQR {q1:.3f}-{q3:.3f})"
        summary[case] = entry
        print(f"  N={world} {case:>13}: {entry['ms_per_step']:8.1f} ms/step, "
              f"{entry['samples_per_s']:9,.0f} samples/s{text}")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", default="2,4,8", help="process counts, comma-separated")
    parser.add_argument("--time-at", default="2,4", help="process counts that are also timed")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per window")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=7,
                        help="hidden layers; 7 gives 8 weights of one size, which ZeRO (stage 1, "
                             "whole parameters per rank) splits evenly over 2, 4 and 8 ranks")
    parser.add_argument("--batch", type=int, default=32, help="per process")
    parser.add_argument("--out", default="/tmp/fleetx_sharding.json")
    args = parser.parse_args()
    args.time_at = {int(n) for n in args.time_at.split(",") if n}
    results = {}
    for world in (int(n) for n in args.nproc.split(",")):
        out = f"{args.out}.{world}"
        start_processes(_entry, args=(world, free_port(), args, out), nprocs=world,
                           start_method="spawn")
        with open(out) as f:
            data = json.load(f)
        print(f"{world} processes, MLP {args.width} x {args.layers + 1} layers, Adam:")
        results[world] = {"memory": report_memory(world, data["memory"])}
        if data["times"] is not None:
            results[world]["speed"] = report_speed(world, data["times"], world * args.batch)
    print(json.dumps({"bench": "sharding", **{k: v for k, v in vars(args).items()
                                             if k not in ("out", "time_at")},
                      "time_at": sorted(args.time_at), "results": results}))


if __name__ == "__main__":
    main()
