"""Gradient communication strategies against plain data parallel, in the same processes.

``--part speed``: the Fashion-MNIST CNN of ``examples/fashion_mnist/train.py`` (421k parameters,
two of them >= 16384 elements) on fixed random batches, for each configuration: plain data
parallel (DDP's own all-reduce), ``fp16_allreduce``, ``dgc`` at sparsity 0.999,
``nccl_comm_num = 2`` and, with 4 processes, hierarchical all-reduce as 2 nodes of 2. Rounds
interleave the configurations (each round rebuilds every model and times a window of steps after
a warm-up), so all see the same machine load; the script prints each configuration's median
step time, its ratio to plain data parallel (median over rounds, with the interquartile range),
and the gradient bytes per step that one rank handed to collectives (payload) and put on the
wire (ring model: 2(n-1)/n of the buffer for an all-reduce, (n-1) times the contribution for an
all-gather). Plain data parallel's bytes are its bucket bytes, since DDP runs its all-reduce in
C++ without the pipeline.

``--part accuracy``: DGC against plain data parallel on Fashion-MNIST for the same number of
epochs (SGD momentum 0.9): test accuracy after each epoch and the gradient bytes. DGC warms up as
in the DGC paper: sparsity 75%, 93.75%, 98.4375%, 99.6%, 99.9% over the first epoch.

    python benchmarks/collective_comm.py --part speed --nproc 2 --rounds 7
    python benchmarks/collective_comm.py --part speed --nproc 4 --rounds 5
    python benchmarks/collective_comm.py --part accuracy --epochs 4

One thread per process; do not run it beside other heavy work. Prints a human summary and one
JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from ports import free_port, start_processes
from ratios import quartiles

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "fashion_mnist"))

DGC_WARMUP = [0.75, 0.9375, 0.984375, 0.996, 0.999]


def speed_configs(world: int) -> dict:
    configs = {
        "data_parallel": {},
        "fp16_allreduce": {"fp16_allreduce": True},
        "dgc": {"dgc": True, "dgc_configs": {"sparsity": [0.999]}},
        "nccl_comm_num=2": {"nccl_comm_num": 2, "fuse_grad_size_in_MB": 1},
    }
    if world == 4:
        configs["hierarchical"] = {"use_hierarchical_allreduce": True,
                                   "hierarchical_allreduce_inter_nranks": 2}
    return configs


def _strategy(fleet, flags: dict):
    s = fleet.DistributedStrategy()
    for key, value in flags.items():
        setattr(s, key, value)
    return s


def _build(fleet, flags: dict, lr: float):
    from train import Net  # examples/fashion_mnist/train.py
    torch.manual_seed(0)
    model = fleet.distributed_model(Net())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the strategy replaces fleet.init's on purpose
        opt = fleet.distributed_optimizer(
            torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9), strategy=_strategy(fleet, flags))
    return model, opt


def _traffic(opt) -> dict:
    return dict(opt.state_dict().get("fleetx", {}).get("data_parallel", {}))


def _speed(rank: int, world: int, args, out: str) -> None:
    from fleetx import fleet
    fleet.init(is_collective=True)
    g = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(args.batch_size, 1, 28, 28, generator=g),
                torch.randint(0, 10, (args.batch_size,), generator=g)) for _ in range(4)]
    configs = speed_configs(world)
    times = {name: [] for name in configs}
    traffic = {}
    for _ in range(args.rounds):
        for name, flags in configs.items():
            model, opt = _build(fleet, flags, lr=0.01)
            for i in range(args.warmup):
                opt.minimize(F.cross_entropy(model(batches[i % 4][0]), batches[i % 4][1]))
            before = _traffic(opt)
            dist.barrier()
            start = time.perf_counter()
            for i in range(args.steps):
                opt.minimize(F.cross_entropy(model(batches[i % 4][0]), batches[i % 4][1]))
            dist.barrier()
            times[name].append((time.perf_counter() - start) / args.steps)
            after = _traffic(opt)
            traffic[name] = {k: (after[k] - before[k]) / args.steps
                             for k in ("payload_bytes", "wire_bytes", "collectives")
                             } if after else None
    numel = sum(p.numel() for p in model.parameters())
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"times": times, "traffic": traffic, "numel": numel}, f)
    dist.barrier()


def _accuracy(rank: int, world: int, args, out: str) -> None:
    import data  # examples/fashion_mnist/data.py
    from evaluate import accuracy  # examples/fashion_mnist/evaluate.py
    from fleetx import fleet
    fleet.init(is_collective=True)
    x_train, y_train = data.load("train")
    x_test, y_test = data.load("test")
    if args.limit:
        x_train, y_train = x_train[:args.limit], y_train[:args.limit]
    steps = len(x_train) // world // args.batch_size
    runs = {"data_parallel": {},
            "dgc": {"dgc": True, "dgc_configs": {"rampup_begin_step": 0, "rampup_step": steps,
                                                 "sparsity": DGC_WARMUP}}}
    result = {}
    for name, flags in runs.items():
        model, opt = _build(fleet, flags, lr=args.lr)
        accuracies, epoch_bytes, start = [], [], time.perf_counter()
        for epoch in range(1, args.epochs + 1):
            before = _traffic(opt).get("payload_bytes", 0)
            order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(epoch))
            mine = order[rank::world]
            for step in range(steps):
                idx = mine[step * args.batch_size:(step + 1) * args.batch_size]
                opt.minimize(F.cross_entropy(model(x_train[idx]), y_train[idx]))
            accuracies.append(accuracy(model, x_test, y_test))
            epoch_bytes.append(_traffic(opt).get("payload_bytes", 0) - before)
            fleet.util.print_on_rank(f"  {name} epoch {epoch}: test accuracy "
                                     f"{accuracies[-1] * 100:.2f}%", 0)
        result[name] = {"accuracy": accuracies, "seconds": time.perf_counter() - start,
                        "traffic": _traffic(opt), "steps": steps * args.epochs,
                        "last_epoch_bytes_per_step": epoch_bytes[-1] / steps}
    result["numel"] = sum(p.numel() for p in model.parameters())
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.barrier()


def _entry(rank: int, world: int, port: int, part: str, args, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    (_speed if part == "speed" else _accuracy)(rank, world, args, out)


def report_speed(data: dict, world: int) -> dict:
    dense_bytes = 4 * data["numel"]
    dense_wire = dense_bytes * 2 * (world - 1) / world
    base = data["times"]["data_parallel"]
    summary = {}
    for name, times in data["times"].items():
        ratios = [t / b for t, b in zip(times, base)]
        q1, med, q3 = quartiles(ratios)
        traffic = data["traffic"][name] or {"payload_bytes": dense_bytes,
                                            "wire_bytes": dense_wire}
        summary[name] = {"step_ms": 1000 * statistics.median(times), "ratio_median": med,
                         "ratio_q1": q1, "ratio_q3": q3,
                         "payload_bytes": traffic["payload_bytes"],
                         "wire_bytes": traffic["wire_bytes"],
                         "bytes_reduction": dense_bytes / traffic["payload_bytes"]}
        print(f"{name:>16}: {summary[name]['step_ms']:7.1f} ms/step, x{med:.3f} of data "
              f"parallel (IQR {q1:.3f}-{q3:.3f}); {traffic['payload_bytes']:,.0f} B/step "
              f"payload ({summary[name]['bytes_reduction']:.1f}x less), "
              f"{traffic['wire_bytes']:,.0f} B/step on the wire")
    return summary


def report_accuracy(data: dict) -> dict:
    summary = {}
    for name in ("data_parallel", "dgc"):
        run = data[name]
        payload = run["traffic"].get("payload_bytes", 4 * data["numel"] * run["steps"])
        summary[name] = {"accuracy": run["accuracy"][-1], "seconds": run["seconds"],
                         "bytes_per_step": payload / run["steps"]}
        print(f"{name:>16}: test accuracy {run['accuracy'][-1] * 100:.2f}% after "
              f"{len(run['accuracy'])} epochs ({run['seconds']:.0f} s), "
              f"{payload / run['steps']:,.0f} gradient bytes/step")
    gap = 100 * (summary["data_parallel"]["accuracy"] - summary["dgc"]["accuracy"])
    ratio = summary["data_parallel"]["bytes_per_step"] / summary["dgc"]["bytes_per_step"]
    last = summary["data_parallel"]["bytes_per_step"] / data["dgc"]["last_epoch_bytes_per_step"]
    print(f"DGC: {-gap:+.2f} accuracy points against dense; {ratio:.1f}x fewer gradient bytes "
          f"over the run (ramp-up epoch included), {last:.1f}x in the last epoch")
    summary["gap_points"], summary["bytes_reduction"] = gap, ratio
    summary["bytes_reduction_last_epoch"] = last
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("speed", "accuracy"), default="speed")
    parser.add_argument("--nproc", type=int, choices=(2, 4), default=2)
    parser.add_argument("--rounds", type=int, default=7, help="speed: interleaved rounds")
    parser.add_argument("--steps", type=int, default=10, help="speed: timed steps per window")
    parser.add_argument("--warmup", type=int, default=3, help="speed: steps before timing")
    parser.add_argument("--batch_size", type=int, default=64, help="per process")
    parser.add_argument("--epochs", type=int, default=4, help="accuracy: epochs per run")
    parser.add_argument("--lr", type=float, default=0.05, help="accuracy: SGD learning rate")
    parser.add_argument("--limit", type=int, default=0,
                        help="accuracy: use only this many training images (0: all)")
    parser.add_argument("--out", default="/tmp/fleetx_collective_comm.json")
    args = parser.parse_args()
    start_processes(_entry, args=(args.nproc, free_port(), args.part, args, args.out),
                       nprocs=args.nproc, start_method="spawn")
    with open(args.out) as f:
        data = json.load(f)
    if args.part == "speed":
        summary = report_speed(data, args.nproc)
    else:
        summary = report_accuracy(data)
    print(json.dumps({"bench": "collective_comm", "part": args.part, "nproc": args.nproc,
                      **{k: v for k, v in vars(args).items() if k not in ("out", "part")},
                      "results": summary}))


if __name__ == "__main__":
    main()
