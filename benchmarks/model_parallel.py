"""The example GPT split over 2 processes, tensor-parallel (mp 2) and pipelined (pp 2), against
data parallel on the same 2 processes: samples/s and memory per rank, in the same run.

Every case trains ``examples/gpt/model.py``'s GPT (float32, AdamW, random token ids over a
99-id vocabulary, the example's) on the same global batch of ``--batch`` windows of
``--block_size`` tokens per step, built through fleetx on 2 gloo processes (CPU, one thread
each):

* ``data_parallel``: the whole model on each rank under DDP, ``--batch / 2`` windows per rank;
* ``mp2``: ``GPTConfig(tensor_parallel=True)``, ``hybrid_configs = {"mp_degree": 2}``: both
  ranks read the same ``--batch`` windows, each holds half of every block's weights;
* ``pp2``: ``model.pipeline_layers`` as a ``PipelineLayer`` of 2 stages (head tied to the
  embedding), ``train_batch`` over ``--micro`` micro-batches (1F1B).

Memory, per rank, on a step after a first one (so the optimizer holds its state):
``fleet.state_bytes()`` (parameters + gradients + optimizer state) read by a step pre-hook,
when the gradients are complete, plus the peak bytes saved for backward alive at once during
the step's forwards and backwards (``torch.autograd.graph.saved_tensors_hooks``, each storage
once, parameters left out; the pipeline holds several micro-batches at once). The sum is the
peak a rank would hold if the activations' peak and the gradients coincided: a model of the
peak from counted tensors, not an allocator reading.

Speed: rounds; each builds every case afresh (``fleet.init`` with its degrees), warms it up and
times a window of steps, barrier to barrier; the case order rotates every round. Reported:
samples/s and each split's step time as a ratio of data parallel's (median of the per-round
ratios, with the interquartile range). On 2 cores, two processes each have a core.

    python benchmarks/model_parallel.py --rounds 7
    python benchmarks/model_parallel.py --rounds 1 --steps 1 --warmup 1 --n_embd 32 \\
        --n_layer 2 --block_size 16 --batch 8 --micro 2        # seconds; smoke

Prints a summary and one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
import weakref
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from ports import free_port, start_processes
from ratios import quartiles

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "gpt"))
from model import GPT, GPTConfig, lm_loss, pipeline_layers  # noqa: E402

CASES = ("data_parallel", "mp2", "pp2")
KEYS = ("parameters", "gradients", "optimizer")
VOCAB = 99  # the example's character vocabulary


class LiveSaved:
    """Bytes saved for backward alive now and at most, each storage once, parameters left out
    (``exclude``: their storages)."""

    def __init__(self, exclude: set) -> None:
        self.exclude, self.refs, self.live, self.peak = exclude, {}, 0, 0

    def pack(self, t: torch.Tensor) -> object:
        ptr = t.untyped_storage().data_ptr()
        base = t._base if t._base is not None else t
        if ptr in self.exclude or (base.is_leaf and base.requires_grad):
            return t
        if ptr not in self.refs:
            self.live += t.untyped_storage().nbytes()
            self.peak = max(self.peak, self.live)
        self.refs[ptr] = self.refs.get(ptr, 0) + 1
        holder = _Holder(t)
        weakref.finalize(holder, self._release, ptr, t.untyped_storage().nbytes())
        return holder

    def _release(self, ptr: int, nbytes: int) -> None:
        self.refs[ptr] -= 1
        if not self.refs[ptr]:
            del self.refs[ptr]
            self.live -= nbytes

    @staticmethod
    def unpack(h: object) -> torch.Tensor:
        return h.t if isinstance(h, _Holder) else h

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class _Holder:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


def build(fleet, case: str, args) -> tuple[Callable, object, torch.nn.Module]:
    """``case`` through fleetx: (step(x, y) over the global batch, optimizer, model)."""
    from fleetx.fleet import meta_parallel as mpu
    s = fleet.DistributedStrategy()
    if case == "mp2":
        s.hybrid_configs = {"mp_degree": 2}
        s.tensor_parallel_configs = {"tensor_init_seed": 0}
    elif case == "pp2":
        s.hybrid_configs = {"pp_degree": 2}
        s.pipeline_configs = {"micro_batch_size": args.batch // args.micro,
                              "accumulate_steps": args.micro}
    fleet.init(is_collective=True, strategy=s)  # a fresh plan and groups; the world is kept
    cfg = GPTConfig(VOCAB, args.block_size, args.n_layer, args.n_head, args.n_embd,
                    tensor_parallel=case == "mp2")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the plan's notices, once per case and round
        net = (mpu.PipelineLayer(pipeline_layers(cfg), loss_fn=lm_loss,
                                 seg_method="layer:PipeBlock") if case == "pp2"
               else GPT(cfg))
        model = fleet.distributed_model(net)
        opt = fleet.distributed_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))
    rank, world = dist.get_rank(), dist.get_world_size()

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        if case == "pp2":
            model.train_batch([x, y], opt)
        elif case == "mp2":
            opt.minimize(lm_loss(model(x), y))
        else:  # each rank its share of the global batch
            opt.minimize(lm_loss(model(x[rank::world]), y[rank::world]))
    return step, opt, net


def measure_memory(fleet, case: str, args, x, y) -> dict:
    """The second step's state at the step and peak saved activations, on this rank."""
    step, opt, net = build(fleet, case, args)
    step(x, y)
    state: dict = {}
    opt.register_step_pre_hook(lambda *_: state.update(fleet.state_bytes()))
    saved = LiveSaved({p.untyped_storage().data_ptr() for p in net.parameters()})
    with saved.hooks():
        step(x, y)
    total = sum(state[k] for k in KEYS) + saved.peak
    return {"state": {k: state[k] for k in KEYS}, "activations": saved.peak, "peak": total}


def _window(step: Callable, batches: list, steps: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for i in range(steps):
        step(*batches[i % len(batches)])
    dist.barrier()  # the window ends when the slowest rank is done
    return (time.perf_counter() - start) / steps


def measure_speed(fleet, args, batches: list) -> dict:
    times: dict[str, list] = {c: [] for c in CASES}
    for r in range(args.rounds):
        for case in CASES[r % len(CASES):] + CASES[:r % len(CASES)]:  # rotate the order
            step, _, _ = build(fleet, case, args)
            _window(step, batches, args.warmup)
            times[case].append(_window(step, batches, args.steps))
    return times


def _entry(rank: int, world: int, port: int, args, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from fleetx import fleet
    g = torch.Generator().manual_seed(0)  # the same global batches on every rank
    batches = []
    for _ in range(4):
        ids = torch.randint(VOCAB, (args.batch, args.block_size + 1), generator=g)
        batches.append((ids[:, :-1], ids[:, 1:]))
    memory = {case: measure_memory(fleet, case, args, *batches[0]) for case in CASES}
    dist.barrier()
    gathered: list = [None] * world
    dist.all_gather_object(gathered, memory)
    times = measure_speed(fleet, args, batches) if args.rounds else None
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"memory": gathered, "times": times}, f)
    dist.barrier()


def report_memory(ranks: list) -> dict:
    """Per case and rank: state bytes, activations, the peak, and the peak as a fraction of data
    parallel's on the same rank."""
    print("memory per rank (bytes): parameters + gradients + optimizer at the step, peak "
          "saved activations, their sum")
    for case in CASES:
        for rank, r in enumerate(ranks):
            m, base = r[case], r["data_parallel"]["peak"]
            print(f"  {case:>13} rank {rank}: " + "  ".join(
                f"{k} {m['state'][k]:>11,}" for k in KEYS) +
                f"  activations {m['activations']:>11,}  peak {m['peak']:>11,} "
                f"(x{m['peak'] / base:.3f} of data parallel)")
    return {case: [r[case] for r in ranks] for case in CASES}


def report_speed(times: dict, samples: int) -> dict:
    print("speed (global batch of %d windows per step):" % samples)
    summary = {}
    for case in CASES:
        entry = {"ms_per_step": 1000 * statistics.median(times[case]),
                 "samples_per_s": samples / statistics.median(times[case])}
        text = ""
        if case != "data_parallel":
            q1, med, q3 = quartiles([a / b for a, b in zip(times[case], times["data_parallel"])])
            entry["vs_data_parallel"] = {"median": med, "q1": q1, "q3": q3}
            text = f", step time x{med:.3f} of data_parallel (IQR {q1:.3f}-{q3:.3f})"
        summary[case] = entry
        print(f"  {case:>13}: {entry['ms_per_step']:8.1f} ms/step, "
              f"{entry['samples_per_s']:7,.1f} samples/s{text}")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="0: memory only")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per window")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--n_embd", type=int, default=256)
    parser.add_argument("--n_layer", type=int, default=4)
    parser.add_argument("--n_head", type=int, default=4)
    parser.add_argument("--block_size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16, help="windows per step, all ranks")
    parser.add_argument("--micro", type=int, default=4, help="pp2's micro-batches per step")
    parser.add_argument("--out", default="/tmp/fleetx_model_parallel.json")
    args = parser.parse_args()
    if args.batch % 2 or args.batch % args.micro:
        parser.error("--batch must be even and a multiple of --micro")
    start_processes(_entry, args=(2, free_port(), args, args.out), nprocs=2,
                       start_method="spawn")
    with open(args.out) as f:
        data = json.load(f)
    print(f"GPT n_embd {args.n_embd}, {args.n_layer} blocks, {args.block_size} tokens, "
          f"{args.batch} windows per step, 2 processes, float32 AdamW")
    results = {"memory": report_memory(data["memory"])}
    if data["times"] is not None:
        results["speed"] = report_speed(data["times"], args.batch)
    print(json.dumps({"bench": "model_parallel", **{k: v for k, v in vars(args).items()
                                                   if k != "out"}, "results": results}))


if __name__ == "__main__":
    main()
