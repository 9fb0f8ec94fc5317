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
  alive at once; 1F1B's theory is ``min(p - s, m)`` micro-batches on stage ``s``, FThenB's ``m``;
* step time against ``torch.distributed.pipelining``: the same stage module (this process's
  ``PipelineLayer``, built from the same seed) and the same micro-batches run through
  ``PipelineStage`` with ``Schedule1F1B`` (against 1F1B) or ``ScheduleGPipe`` (against FThenB),
  one ``SGD`` step per mini-batch on both; the median over ``--steps`` mini-batches after a
  warm-up one, each timed from a barrier to a barrier. Both engines start from the same
  weights, so their first mini-batch's mean loss must agree (printed as the largest difference).

    python benchmarks/pipeline.py --stages 2 4 --micro 1 4 8 16
    python benchmarks/pipeline.py --stages 2 --micro 2 --steps 1 --ms 1   # seconds; smoke

Prints one markdown table row per (p, m, schedule), then the step-time table.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ports import free_port, start_processes  # noqa: E402


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


def _stage(layers: list) -> nn.Module:
    """This process's stage, the same weights every call (the engines start equal)."""
    from fleetx.parallel.pipeline import PipelineLayer
    torch.manual_seed(0)
    return PipelineLayer(layers, loss_fn=nn.MSELoss(), group=dist.group.WORLD)


def _timed(step) -> tuple[float, object]:
    """Seconds of one mini-batch on every stage (barrier to barrier), and ``step()``'s value."""
    dist.barrier()
    start = time.perf_counter()
    value = step()
    dist.barrier()
    return time.perf_counter() - start, value


def _fleetx_engine(layers: list, m: int, mode: str, x, y, args) -> tuple:
    """(bubble and memory row, step seconds, first mini-batch's loss) of our pipeline."""
    from fleetx.parallel.pipeline_parallel import PipelineParallel
    stage = _stage(layers)
    model = PipelineParallel(stage, micro_batch_size=args.micro_batch_size,
                             accumulate_steps=m, schedule_mode=mode)
    opt = torch.optim.SGD(stage.parameters(), lr=0.01)
    times, losses = [], []
    for _ in range(args.steps + 1):  # the first is a warm-up
        saved = SavedBytes({p.data_ptr() for p in stage.parameters()})
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            seconds, loss = _timed(lambda: model.train_batch([x, y], opt))
        times.append(seconds)
        losses.append(loss.item())
    busy = sum(end - start for _, _, start, end in model.timeline)
    first = min(start for _, _, start, _ in model.timeline)
    last = max(end for _, _, _, end in model.timeline)
    row = (m, mode, busy, first, last, saved.peak, model.peak_in_flight)
    return row, statistics.median(times[1:]), losses[0]


def _torch_engine(layers: list, m: int, mode: str, x, y, args) -> tuple:
    """(step seconds, first mini-batch's mean loss on the last stage, else None) of
    ``torch.distributed.pipelining`` on the same stage module and micro-batches; (None, the
    error) when it refuses the configuration (its ``Schedule1F1B`` wants ``m >= p``)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    rank, world = dist.get_rank(), dist.get_world_size()
    stage = _stage(layers)
    engine = {"1F1B": Schedule1F1B, "FThenB": ScheduleGPipe}[mode]
    try:  # a check of the arguments alone: every rank refuses alike, nothing is left waiting
        schedule = engine(PipelineStage(stage, rank, world, torch.device("cpu")), m,
                          loss_fn=nn.MSELoss())
    except ValueError as error:
        return None, " ".join(str(error).split())
    opt = torch.optim.SGD(stage.parameters(), lr=0.01)

    def step() -> list:
        losses: list = []
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return losses

    times, first = [], None
    for i in range(args.steps + 1):
        seconds, losses = _timed(step)
        times.append(seconds)
        if i == 0 and losses:
            first = torch.stack([loss.detach() for loss in losses]).mean().item()
    return statistics.median(times[1:]), first


def _stage_run(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from fleetx.parallel.pipeline import LayerDesc
    seconds = args.ms / 1000
    layers = [LayerDesc(Block, args.width, seconds) for _ in range(world * args.layers_per_stage)]
    rows = []
    for m in args.micro:
        for mode in ("1F1B", "FThenB"):
            n = args.micro_batch_size * m
            g = torch.Generator().manual_seed(m)
            x, y = torch.randn(n, args.width, generator=g), torch.randn(n, args.width, generator=g)
            row, ours, our_loss = _fleetx_engine(layers, m, mode, x, y, args)
            theirs, their_loss = _torch_engine(layers, m, mode, x, y, args)
            if theirs is None:  # refused: keep its words for the table
                gap = their_loss
            else:
                gap = abs(our_loss - their_loss) if their_loss is not None else None
            rows.append(row + (ours, theirs, gap))
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        torch.save(gathered, out)
    dist.destroy_process_group()


def measure(p: int, args: argparse.Namespace) -> list:
    out = f"/tmp/fleetx_pipeline_bench_{os.getpid()}_{p}.pt"
    start_processes(_stage_run, args=(p, free_port(), args, out), nprocs=p,
                       start_method="spawn")
    per_stage = torch.load(out)
    os.remove(out)
    table = []
    for i, (m, mode, *_rest) in enumerate(per_stage[0]):
        stages = [rows[i] for rows in per_stage]
        span = max(r[4] for r in stages) - min(r[3] for r in stages)
        bubble = sum(1 - r[2] / span for r in stages) / p
        ours = max(r[7] for r in stages)
        if stages[0][8] is None:
            theirs, gap = None, stages[0][9]
        else:
            theirs = max(r[8] for r in stages)
            gap = max(r[9] for r in stages if r[9] is not None)
        table.append((p, m, mode, bubble, (p - 1) / (m + p - 1), [r[5] for r in stages],
                      [r[6] for r in stages], ours, theirs, gap))
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
    timings = []
    for p in args.stages:
        for p_, m, mode, bubble, theory, peak, alive, ours, theirs, gap in measure(p, args):
            kib = ", ".join(f"{b / 1024:.0f}" for b in peak)
            print(f"| {p_} | {m} | {mode} | {bubble:.3f} | {theory:.3f} | {kib} | "
                  f"{', '.join(map(str, alive))} |", flush=True)
            timings.append((p_, m, mode, ours, theirs, gap))
    _print_timings(timings, args)


def _print_timings(timings: list, args: argparse.Namespace) -> None:
    """The step-time table: fleetx against torch.distributed.pipelining, per (p, m, schedule)."""
    # With equal stages of sleeping blocks a mini-batch cannot take less than (m + p - 1)
    # micro-batch slots of 3 x blocks x ms (forward ms, backward 2 ms per block).
    print("\n| p | m | schedule (torch's) | fleetx ms/step | torch.distributed.pipelining "
          "ms/step | torch / fleetx | ideal ms (m+p-1) x 3 x blocks x ms | first-loss "
          "difference |")
    print("|---|---|---|---|---|---|---|---|")
    for p, m, mode, ours, theirs, gap in timings:
        bound = (m + p - 1) * 3 * args.layers_per_stage * args.ms
        engine = "Schedule1F1B" if mode == "1F1B" else "ScheduleGPipe"
        if theirs is None:
            print(f"| {p} | {m} | {mode} ({engine}) | {ours * 1e3:.1f} | refused: {gap} | - | "
                  f"{bound:.0f} | - |", flush=True)
            continue
        print(f"| {p} | {m} | {mode} ({engine}) | {ours * 1e3:.1f} | {theirs * 1e3:.1f} | "
              f"{theirs / ours:.3f} | {bound:.0f} | {gap:.1e} |", flush=True)


if __name__ == "__main__":
    main()
