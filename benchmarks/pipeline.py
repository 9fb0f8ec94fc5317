"""The pipeline's bubble and activation memory per stage, 1F1B against FThenB, beside the theory.

Each of ``p`` processes (gloo, CPU) runs one stage of ``layers_per_stage`` blocks; a block is a
``Linear(width, width)`` followed by a simulated compute time (``--ms`` of sleep in forward,
twice that in backward, through a custom autograd function). Sleeping instead of computing
keeps the stage times equal and independent of how many cores the machine lends the
processes, so the measured bubble is the schedule's, not CPU contention's.

For every schedule and number of micro-batches ``m`` the script runs ``--steps`` mini-batches
and keeps the last:

* bubble: per stage ``1 - busy / span``, where ``busy`` is the time the stage spent in its
  forwards and backwards and ``span`` the whole mini-batch (first forward anywhere to last
  backward anywhere, one monotonic clock on one machine); the mean over stages, against
  ``(p - 1) / (m + p - 1)``;
* peak activation memory per stage: the largest number of bytes saved for backward alive at once
  (``torch.autograd.graph.saved_tensors_hooks``, parameters left out) and the most micro-batches
  alive at once; 1F1B's theory is ``min(p - s, m)`` micro-batches on stage ``s``, FThenB's ``m``.

    python benchmarks/pipeline.py --stages 2 4 --micro 1 4 8 16
    python benchmarks/pipeline.py --stages 2 --micro 2 --steps 1 --ms 1   # seconds; smoke

Prints one markdown table row per (p, m, schedule).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ports import free_port  # noqa: E402


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds):  # type: ignore[override]
        ctx.seconds = seconds
        time.sleep(seconds)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        time.sleep(2 * ctx.seconds)  # backward costs about twice the forward
        return grad, None


class Block(nn.Module):
    def __init__(self, width: int, seconds: float) -> None:
        super().__init__()
        self.linear, self.seconds = nn.Linear(width, width), seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(torch.tanh(self.linear(x)), self.seconds)


class SavedBytes:
    """Live and peak bytes saved for backward (parameters left out)."""

    def __init__(self, params: set) -> None:
        self.params, self.live, self.peak = params, 0, 0

    def pack(self, t: torch.Tensor):
        if t.data_ptr() in self.params:
            return t
        holder = _Holder(t)
        self.live += t.nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(holder, self._free, t.nbytes)
        return holder

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes

    @staticmethod
    def unpack(h):
        return h.t if isinstance(h, _Holder) else h


class _Holder:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


def _stage_run(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from fleetx.parallel.pipeline import LayerDesc, PipelineLayer
    from fleetx.parallel.pipeline_parallel import PipelineParallel
    seconds = args.ms / 1000
    layers = [LayerDesc(Block, args.width, seconds) for _ in range(world * args.layers_per_stage)]
    rows = []
    for m in args.micro:
        for mode in ("1F1B", "FThenB"):
            stage = PipelineLayer(layers, loss_fn=nn.MSELoss(), group=dist.group.WORLD)
            model = PipelineParallel(stage, micro_batch_size=args.micro_batch_size,
                                     accumulate_steps=m, schedule_mode=mode)
            opt = torch.optim.SGD(stage.parameters(), lr=0.01)
            n = args.micro_batch_size * m
            x, y = torch.randn(n, args.width), torch.randn(n, args.width)
            for _ in range(args.steps):
                saved = SavedBytes({p.data_ptr() for p in stage.parameters()})
                dist.barrier()
                with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
                    model.train_batch([x, y], opt)
            busy = sum(end - start for _, _, start, end in model.timeline)
            first = min(start for _, _, start, _ in model.timeline)
            last = max(end for _, _, _, end in model.timeline)
            rows.append((m, mode, busy, first, last, saved.peak, model.peak_in_flight))
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        torch.save(gathered, out)
    dist.destroy_process_group()


def measure(p: int, args: argparse.Namespace) -> list:
    out = f"/tmp/fleetx_pipeline_bench_{os.getpid()}_{p}.pt"
    mp.start_processes(_stage_run, args=(p, free_port(), args, out), nprocs=p,
                       start_method="spawn")
    per_stage = torch.load(out)
    os.remove(out)
    table = []
    for i, (m, mode, *_rest) in enumerate(per_stage[0]):
        stages = [rows[i] for rows in per_stage]
        span = max(r[4] for r in stages) - min(r[3] for r in stages)
        bubble = sum(1 - r[2] / span for r in stages) / p
        table.append((p, m, mode, bubble, (p - 1) / (m + p - 1), [r[5] for r in stages],
                      [r[6] for r in stages]))
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--micro", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--layers-per-stage", type=int, default=2)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--ms", type=float, default=10.0, help="simulated forward ms per block")
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    print("| p | m | schedule | bubble measured | bubble theory (p-1)/(m+p-1) | peak saved KiB "
          "per stage | peak micro-batches alive per stage |")
    print("|---|---|---|---|---|---|---|")
    for p in args.stages:
        for p_, m, mode, bubble, theory, peak, alive in measure(p, args):
            kib = ", ".join(f"{b / 1024:.0f}" for b in peak)
            print(f"| {p_} | {m} | {mode} | {bubble:.3f} | {theory:.3f} | {kib} | "
                  f"{', '.join(map(str, alive))} |", flush=True)


if __name__ == "__main__":
    main()
