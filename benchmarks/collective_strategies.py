"""Communication-saving strategies against plain data parallel, in the same processes.

Each entry of :data:`CASES` is one configuration: the ``DistributedStrategy`` switches and,
optionally, a per-step learning-rate decay. Adding a strategy to the comparison is adding an
entry (``"fp16_allreduce": Case({"fp16_allreduce": True})`` for example); the measurements work
for any of them.

What is measured, per case and per *micro-step* (one ``minimize`` call on one batch of
``--batch_size`` images per process, so every case sees the same data at the same pace):

* ``--part speed``: the Fashion-MNIST CNN of ``examples/fashion_mnist/train.py`` on fixed random
  batches. Rounds interleave the cases (each round rebuilds every model, warms up, then times a
  window), so all see the same machine load. Reported: the median time per micro-step, its ratio
  to data parallel (median over rounds, with the interquartile range) and the bytes one rank
  handed to collectives (payload) and put on the wire (ring model: ``2(n-1)/n`` of an all-reduce
  buffer, ``n-1`` times an all-gather contribution).
* ``--part accuracy``: the same budget of epochs on Fashion-MNIST for every case: test accuracy
  after each epoch, seconds, bytes.

Bytes are counted at the Python collectives (``torch.distributed.all_reduce`` and friends, which
parameter averaging and comm hooks call); DDP's own all-reduce runs in C++, so when no strategy
installed a comm hook the benchmark installs DDP's default all-reduce hook behind a counter.

    python benchmarks/collective_strategies.py --part speed --rounds 7
    python benchmarks/collective_strategies.py --part accuracy --epochs 3
    python benchmarks/collective_strategies.py --part speed --rounds 1 --steps 4   # smoke test

One thread per process; do not run it beside other heavy work. Prints a summary and one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from ports import start_processes
from ratios import quartiles

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "fashion_mnist"))


@dataclass(frozen=True)
class Case:
    """One configuration: strategy switches and a per-micro-step learning-rate decay factor."""

    flags: dict = field(default_factory=dict)
    lr_decay: float = 1.0


CASES: dict[str, Case] = {
    "data_parallel": Case(),
    "gradient_merge k=4": Case({"gradient_merge": True,
                                "gradient_merge_configs": {"k_steps": 4, "avg": True}}),
    "localsgd k=4": Case({"localsgd": True, "localsgd_configs": {"k_steps": 4, "begin_step": 1}}),
    # init_k_steps=16 starts at k = ceil(sqrt(16)) = 4, like the fixed case; the decaying learning
    # rate then lengthens the interval.
    "adaptive_localsgd": Case({"adaptive_localsgd": True, "adaptive_localsgd_configs": {
        "init_k_steps": 16, "begin_step": 1}}, lr_decay=0.999),
}

_WIRE = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: n - 1,
         "all_gather_into_tensor": lambda n: n - 1, "broadcast": lambda n: (n - 1) / n,
         "reduce": lambda n: (n - 1) / n, "reduce_scatter_tensor": lambda n: (n - 1) / n}


def _contribution(op: str, args: tuple, kwargs: dict) -> torch.Tensor:
    """The tensor this rank hands to collective ``op`` (the input, not the output list)."""
    if op in ("all_gather", "all_gather_into_tensor", "reduce_scatter_tensor"):
        return args[1] if len(args) > 1 else kwargs.get("tensor", kwargs.get("input_tensor"))
    return args[0] if args else kwargs["tensor"]


class TrafficMeter:
    """Payload and wire bytes of every Python-level collective while ``on``."""

    def __init__(self, world: int) -> None:
        self.world, self.on = world, False
        self.payload = self.wire = 0.0
        for op in _WIRE:
            if hasattr(dist, op):
                setattr(dist, op, self._counted(op, getattr(dist, op)))

    def _counted(self, op, collective):
        def run(*args, **kwargs):
            if self.on:
                tensor = _contribution(op, args, kwargs)
                nbytes = tensor.numel() * tensor.element_size()
                self.payload += nbytes
                self.wire += nbytes * _WIRE[op](self.world)
            return collective(*args, **kwargs)
        return run

    def reading(self) -> tuple[float, float]:
        return self.payload, self.wire

    def attach(self, optimizer) -> None:
        """Route DDP's all-reduce through Python (so it is counted) unless a strategy already
        installed a comm hook; call before the model's first forward."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        ctx = optimizer._ctx
        if not ctx.comm_hooks:
            ctx.comm_hooks.append((None, allreduce_hook))


def _build(fleet, case: Case, lr: float, meter: TrafficMeter):
    from train import Net  # examples/fashion_mnist/train.py
    strategy = fleet.DistributedStrategy()
    for key, value in case.flags.items():
        setattr(strategy, key, value)
    torch.manual_seed(0)
    model = fleet.distributed_model(Net())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # replacing fleet.init's strategy is the point here
        opt = fleet.distributed_optimizer(
            torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9), strategy=strategy)
    meter.attach(opt)
    scheduler = torch.optim.lr_scheduler.ExponentialLR(opt, case.lr_decay)
    return model, opt, scheduler


def _steps(model, opt, scheduler, batches, n: int) -> None:
    for i in range(n):
        x, y = batches[i % len(batches)]
        opt.minimize(F.cross_entropy(model(x), y))
        scheduler.step()


def _speed(rank: int, world: int, args, fleet, meter: TrafficMeter) -> dict:
    g = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(args.batch_size, 1, 28, 28, generator=g),
                torch.randint(0, 10, (args.batch_size,), generator=g)) for _ in range(4)]
    times = {name: [] for name in CASES}
    traffic = {}
    for _ in range(args.rounds):
        for name, case in CASES.items():
            model, opt, scheduler = _build(fleet, case, 0.01, meter)
            _steps(model, opt, scheduler, batches, args.warmup)
            dist.barrier()
            meter.on, before, start = True, meter.reading(), time.perf_counter()
            _steps(model, opt, scheduler, batches, args.steps)
            meter.on = False
            dist.barrier()
            times[name].append((time.perf_counter() - start) / args.steps)
            traffic[name] = [(b - a) / args.steps for a, b in zip(before, meter.reading())]
    return {"times": times, "traffic": traffic}


def _accuracy(rank: int, world: int, args, fleet, meter: TrafficMeter) -> dict:
    import data  # examples/fashion_mnist/data.py
    x_train, y_train = data.load("train")
    x_test, y_test = data.load("test")
    if args.limit:
        x_train, y_train = x_train[:args.limit], y_train[:args.limit]
    steps = len(x_train) // world // args.batch_size
    result = {}
    for name, case in CASES.items():
        model, opt, scheduler = _build(fleet, case, args.lr, meter)
        accuracies, seconds, before = [], 0.0, meter.reading()
        for epoch in range(1, args.epochs + 1):
            mine = torch.randperm(len(x_train),
                                  generator=torch.Generator().manual_seed(epoch))[rank::world]
            batches = [(x_train[mine[i * args.batch_size:(i + 1) * args.batch_size]],
                        y_train[mine[i * args.batch_size:(i + 1) * args.batch_size]])
                       for i in range(steps)]
            meter.on, start = True, time.perf_counter()
            _steps(model, opt, scheduler, batches, steps)
            meter.on, seconds = False, seconds + time.perf_counter() - start
            accuracies.append(_test(fleet, model, x_test, y_test))
            fleet.util.print_on_rank(f"  {name} epoch {epoch}: {accuracies[-1] * 100:.2f}%", 0)
        payload, wire = [(b - a) / (steps * args.epochs) for a, b in zip(before, meter.reading())]
        result[name] = {"accuracy": accuracies, "seconds": seconds, "payload": payload,
                        "wire": wire}
    return result


def _test(fleet, model, x, y) -> float:
    rank, world = fleet.worker_index(), fleet.worker_num()
    model.eval()
    with torch.no_grad():
        correct = sum(int((model(x[i:i + 1000]).argmax(1) == y[i:i + 1000]).sum())
                      for i in range(rank * 1000, len(x), world * 1000))
    model.train()
    return fleet.util.all_reduce(correct) / len(x)


def _entry(rank: int, world: int, port: int, args) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from fleetx import fleet
    fleet.init(is_collective=True)
    meter = TrafficMeter(world)
    data = (_speed if args.part == "speed" else _accuracy)(rank, world, args, fleet, meter)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(data, f)
    dist.barrier()


def report_speed(data: dict) -> dict:
    base_times, base_bytes = data["times"]["data_parallel"], data["traffic"]["data_parallel"][0]
    summary = {}
    for name, times in data["times"].items():
        q1, med, q3 = quartiles([t / b for t, b in zip(times, base_times)])
        payload, wire = data["traffic"][name]
        summary[name] = {"ms_per_microstep": 1000 * statistics.median(times),
                         "ratio_median": med, "ratio_q1": q1, "ratio_q3": q3,
                         "payload_bytes": payload, "wire_bytes": wire,
                         "bytes_reduction": base_bytes / payload if payload else None}
        less = f"{base_bytes / payload:.1f}x less" if payload else "none"
        print(f"{name:>20}: {summary[name]['ms_per_microstep']:7.1f} ms/micro-step, x{med:.3f} "
              f"of data parallel (IQR {q1:.3f}-{q3:.3f}); {payload:,.0f} B payload ({less}), "
              f"{wire:,.0f} B on the wire per micro-step")
    return summary


def report_accuracy(data: dict) -> dict:
    base = data["data_parallel"]["payload"]
    for name, run in data.items():
        less = (f" ({base / run['payload']:.1f}x less than data parallel)"
                if run["payload"] and name != "data_parallel" else "")
        print(f"{name:>20}: test accuracy {run['accuracy'][-1] * 100:.2f}% after "
              f"{len(run['accuracy'])} epochs ({run['seconds']:.0f} s training), "
              f"{run['payload']:,.0f} B/micro-step{less}")
    return data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("speed", "accuracy"), default="speed")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7, help="speed: interleaved rounds")
    parser.add_argument("--steps", type=int, default=16,
                        help="speed: timed micro-steps per window (a multiple of 4 keeps the "
                             "k=4 cases' windows whole)")
    parser.add_argument("--warmup", type=int, default=4, help="speed: micro-steps before timing")
    parser.add_argument("--batch_size", type=int, default=64, help="per process")
    parser.add_argument("--epochs", type=int, default=3, help="accuracy: the budget")
    parser.add_argument("--lr", type=float, default=0.05, help="accuracy: SGD learning rate")
    parser.add_argument("--limit", type=int, default=0,
                        help="accuracy: use only this many training images (0: all)")
    parser.add_argument("--out", default="/tmp/fleetx_collective_strategies.json")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start_processes(_entry, args=(args.nproc, port, args), nprocs=args.nproc,
                       start_method="spawn")
    with open(args.out) as f:
        data = json.load(f)
    summary = report_speed(data) if args.part == "speed" else report_accuracy(data)
    print(json.dumps({"bench": "collective_strategies", "part": args.part,
                      **{k: v for k, v in vars(args).items() if k not in ("out", "part")},
                      "results": summary}))


if __name__ == "__main__":
    main()
