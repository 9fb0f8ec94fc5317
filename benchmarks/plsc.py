"""Per-rank memory and step time of a class-sharded head (ShardedClassifier) at mp 1, 2, 4.

A synthetic 1M-class ArcFace head (in_features 128, batch 64, float32, SGD with momentum as in
PLSC) runs on ``mp`` gloo processes (CPU), each holding ``1M / mp`` class rows. For each degree:

* head bytes per rank: the weight shard + its gradient + the optimizer state (the momentum
  buffer), counted from the tensors themselves after a step; this falls as 1/mp;
* peak RSS per rank (``ru_maxrss``): the whole process (torch, the logits, the init chunk);
* step time: the median over ``--steps`` timed steps (forward, backward, optimizer step) after
  ``--warmup`` untimed ones, each started together after a barrier; the slowest rank counts.

Every process is limited to one thread. On a machine with fewer cores than processes (2 cores
at mp 4), the times measure contention for the cores as much as the head's compute.

``--keep-freed-memory`` sets glibc's ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` in
the processes so that freed blocks stay in the heap: by default every tensor over glibc's mmap
threshold is a fresh mapping, and the head's hundreds of MiB of temporaries are page-faulted in
again at every step (most of a step's time is then system time).

    python benchmarks/plsc.py                          # mp 1 2 4, 1M classes
    python benchmarks/plsc.py --keep-freed-memory      # the same, without the page faults
    python benchmarks/plsc.py --mp 1 2 --classes 100000 --steps 2   # seconds; smoke
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ports import free_port, start_processes  # noqa: E402


def head_bytes(head: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Parameter + gradient + optimizer-state bytes of ``head`` on this rank."""
    total = 0
    for p in head.parameters():
        total += p.nbytes + (p.grad.nbytes if p.grad is not None else 0)
        total += sum(t.nbytes for t in optimizer.state[p].values() if torch.is_tensor(t))
    return total


def _rank_run(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from fleetx.parallel.classifier import ShardedClassifier
    torch.manual_seed(0)
    head = ShardedClassifier(args.in_features, args.classes, "arcface", mp_group=dist.group.WORLD)
    optimizer = torch.optim.SGD(head.parameters(), lr=0.1, momentum=0.9)
    data = torch.Generator().manual_seed(1)  # the same batch on every rank of the group
    features = torch.randn(args.batch, args.in_features, generator=data)
    labels = torch.randint(0, args.classes, (args.batch,), generator=data)
    times = []
    for step in range(args.warmup + args.steps):
        dist.barrier()
        began = time.perf_counter()
        loss = head(features, labels).mean()
        optimizer.zero_grad(set_to_none=False)
        loss.backward()
        optimizer.step()
        if step >= args.warmup:
            times.append(time.perf_counter() - began)
    row = (head_bytes(head, optimizer), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
           times)
    gathered = [None] * world
    dist.all_gather_object(gathered, row)
    if rank == 0:
        torch.save(gathered, out)
    dist.destroy_process_group()


def measure(degree: int, args: argparse.Namespace) -> tuple:
    """``(head bytes per rank, peak RSS per rank, median step seconds)`` at ``mp = degree``."""
    out = f"/tmp/fleetx_plsc_bench_{os.getpid()}_{degree}.pt"
    start_processes(_rank_run, args=(degree, free_port(), args, out), nprocs=degree,
                       start_method="spawn")
    ranks = torch.load(out)
    os.remove(out)
    slowest = [max(r[2][i] for r in ranks) for i in range(args.steps)]
    return [r[0] for r in ranks], [r[1] for r in ranks], statistics.median(slowest)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--classes", type=int, default=1_000_000)
    parser.add_argument("--in-features", type=int, default=128)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--keep-freed-memory", action="store_true",
                        help="keep freed blocks in glibc's heap (no mmap/munmap per tensor)")
    args = parser.parse_args()
    if args.keep_freed_memory:  # read by glibc when each spawned process starts
        os.environ.update(MALLOC_MMAP_THRESHOLD_=str(2 ** 32 - 1),
                          MALLOC_TRIM_THRESHOLD_=str(2 ** 36))
    print(f"ArcFace head, {args.classes:,} classes x {args.in_features}, batch {args.batch}, "
          f"float32, SGD momentum; {os.cpu_count()} cores, 1 thread per process; freed memory "
          f"{'kept' if args.keep_freed_memory else 'returned (glibc default)'}")
    print("| mp | head MiB per rank (param + grad + momentum) | per rank x mp, over the first "
          "row | peak RSS MiB per rank | step ms (median) |")
    print("|---|---|---|---|---|")
    base = None
    for degree in args.mp:
        heads, rss, step = measure(degree, args)
        base = base or heads[0] * degree
        print(f"| {degree} | {', '.join(f'{b / 2**20:.1f}' for b in heads)} | "
              f"{heads[0] * degree / base:.3f} | {', '.join(f'{b / 2**20:.0f}' for b in rss)} | "
              f"{step * 1000:.0f} |", flush=True)


if __name__ == "__main__":
    main()
