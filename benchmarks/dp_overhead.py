"""What fleetx data parallel costs over plain torch DDP, measured in the same two processes.

Both trainers live in the same two gloo processes: plain ``DistributedDataParallel`` with
``loss.backward(); opt.step(); opt.zero_grad()``, and fleetx's ``distributed_model`` /
``distributed_optimizer`` with ``opt.minimize(loss)`` (same model, same bucket size, same data).
Windows of each alternate (A B A B ...); a window's time is the slowest rank's. Each pair gives a
ratio fleetx / torch; the script prints the median ratio and its interquartile range, which is
robust to the shared machine's noise because both sides of a pair see the same conditions.

Models and batches are the anchors' (``../shared/reference/anchors/torch_train.py``): MLP-small
32-128-128-2 with batch 32 per rank and MLP-large 1024-2048x3-10 with batch 128 per rank, SGD with
momentum 0.9, cross-entropy, one thread per process.

    python benchmarks/dp_overhead.py --model mlp_small --pairs 30
    python ../shared/reference/anchors/harness.py -- python benchmarks/dp_overhead.py --model mlp_large

Prints a human summary and one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from ports import free_port, start_processes
from ratios import quartiles

# model -> (layer widths, batch per rank, steps per window, warm-up steps)
MODELS = {
    "mlp_small": ((32, 128, 128, 2), 32, 100, 50),
    "mlp_large": ((1024, 2048, 2048, 2048, 10), 128, 3, 3),
}
BUCKET_MB = 25  # torch DDP's default; fleetx is given the same so only the wrapper differs


def mlp(widths: tuple) -> nn.Module:
    layers: list[nn.Module] = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def _window(step, batches, steps: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for i in range(steps):
        step(*batches[i % len(batches)])
    dist.barrier()  # the window ends when the slowest rank is done
    return time.perf_counter() - start


def _run(rank: int, world: int, port: int, model_name: str, pairs: int, out: str,
         control: bool) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from fleetx import fleet

    widths, batch, steps, warmup = MODELS[model_name]
    strategy = fleet.DistributedStrategy()
    strategy.fuse_grad_size_in_MB = BUCKET_MB
    fleet.init(is_collective=True, strategy=strategy)

    torch.manual_seed(0)
    plain = DistributedDataParallel(mlp(widths), bucket_cap_mb=BUCKET_MB)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.01, momentum=0.9)
    torch.manual_seed(0)
    ours = fleet.distributed_model(mlp(widths))
    ours_opt = fleet.distributed_optimizer(torch.optim.SGD(ours.parameters(), lr=0.01,
                                                           momentum=0.9))
    g = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(batch, widths[0], generator=g),
                torch.randint(0, widths[-1], (batch,), generator=g)) for _ in range(8)]

    def torch_step(x, y):
        loss = F.cross_entropy(plain(x), y)
        loss.backward()
        plain_opt.step()
        plain_opt.zero_grad()

    def fleetx_step(x, y):
        ours_opt.minimize(F.cross_entropy(ours(x), y))

    if control:  # A/A: the "fleetx" side is a second plain DDP trainer, to expose any bias
        torch.manual_seed(0)
        twin = DistributedDataParallel(mlp(widths), bucket_cap_mb=BUCKET_MB)
        twin_opt = torch.optim.SGD(twin.parameters(), lr=0.01, momentum=0.9)

        def fleetx_step(x, y):  # noqa: F811
            loss = F.cross_entropy(twin(x), y)
            loss.backward()
            twin_opt.step()
            twin_opt.zero_grad()

    _window(torch_step, batches, warmup)
    _window(fleetx_step, batches, warmup)
    times = []
    for i in range(pairs):
        # Alternate which side goes first so neither always follows the other.
        if i % 2 == 0:
            t_torch = _window(torch_step, batches, steps)
            t_ours = _window(fleetx_step, batches, steps)
        else:
            t_ours = _window(fleetx_step, batches, steps)
            t_torch = _window(torch_step, batches, steps)
        times.append((t_torch, t_ours))
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"times": times, "samples_per_window": steps * batch * world}, f)
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="mlp_small")
    parser.add_argument("--pairs", type=int, default=30, help="A/B window pairs (>= 20)")
    parser.add_argument("--out", default="/tmp/fleetx_dp_overhead.json")
    parser.add_argument("--smoke", action="store_true", help="allow fewer than 20 pairs")
    parser.add_argument("--control", action="store_true",
                        help="A/A run: compare plain DDP with a second plain DDP trainer")
    args = parser.parse_args()
    if args.pairs < 20 and not args.smoke:
        parser.error("--pairs must be >= 20 for a reportable figure (add --smoke for a quick run)")
    start_processes(_run, args=(2, free_port(), args.model, args.pairs, args.out,
                                   args.control), nprocs=2, start_method="spawn")
    with open(args.out) as f:
        data = json.load(f)
    ratios = [ours / plain for plain, ours in data["times"]]
    q1, med, q3 = quartiles(ratios)
    n = data["samples_per_window"]
    torch_rate = statistics.median(n / t for t, _ in data["times"])
    ours_rate = statistics.median(n / t for _, t in data["times"])
    label = "A/A control" if args.control else "fleetx"
    print(f"{args.model} ({label}): {len(ratios)} pairs; torch DDP {torch_rate:,.0f} samples/s, fleetx "
          f"{ours_rate:,.0f} samples/s; time ratio fleetx/torch median {med:.4f} "
          f"(IQR {q1:.4f}-{q3:.4f}) -> overhead {100 * (med - 1):+.2f} %")
    print(json.dumps({"bench": "dp_overhead", "control": args.control, "model": args.model, "pairs": len(ratios),
                      "ratio_median": med, "ratio_q1": q1, "ratio_q3": q3,
                      "torch_samples_per_s": torch_rate, "fleetx_samples_per_s": ours_rate}))


if __name__ == "__main__":
    main()
