"""Tensor parallel from the model's own plan: a ``LlamaForCausalLM`` at mp 2 against the
unsplit model on one process and against data parallel on the same 2 processes, in one run.

Every case trains the same Llama config (float32, Adam, random byte ids, ``--layers`` decoder
layers of width ``--hidden``, grouped-query attention) on the same global batch of ``--batch``
sequences of ``--length`` tokens per step; one thread per process:

* ``unsplit``: the plain model on rank 0 alone (rank 1 waits at the barrier): the step a
  single process takes;
* ``mp2``: ``hybrid_configs = {"mp_degree": 2}``; ``fleet.distributed_model`` applies the
  model's ``_tp_plan`` (q/k/v/gate/up column-split, o/down row-split, the embedding and the
  head split by vocabulary); both ranks read the whole batch;
* ``data_parallel``: the whole model on each rank, half of the batch each.

Rounds; each builds every case afresh, warms it up and times a window of steps, barrier to
barrier; the order rotates every round. Reported: ms/step, each case's step time as a ratio
of ``unsplit``'s (median of the per-round ratios and the interquartile range), and the
parameter bytes per rank. Needs the ``hf`` extra (transformers).

    python benchmarks/tp_plan.py --rounds 7
    python benchmarks/tp_plan.py --rounds 1 --steps 1 --warmup 1 --layers 2 --hidden 64 \\
        --length 16 --batch 4        # seconds; smoke

Prints a summary and one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from ports import free_port, start_processes
from ratios import quartiles

CASES = ("unsplit", "mp2", "data_parallel")
VOCAB = 256


def llama(args) -> torch.nn.Module:
    import transformers
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3 // 8 * 8,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.heads // 2, max_position_embeddings=args.length,
        bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def build(fleet, case: str, args):
    """A step function for ``case`` on this rank (None where the rank sits out) and the
    parameter bytes it holds."""
    rank = dist.get_rank()
    if case == "unsplit":
        model = llama(args)
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)

        def step(ids):
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        held = sum(p.numel() * p.element_size() for p in model.parameters())
        return (step if rank == 0 else None), held
    s = fleet.DistributedStrategy()
    if case == "mp2":
        s.hybrid_configs = {"mp_degree": 2}
    fleet.init(is_collective=True, strategy=s)
    model = fleet.distributed_model(llama(args))
    opt = fleet.distributed_optimizer(torch.optim.Adam(model.parameters(), lr=1e-4))
    half = slice(rank * args.batch // 2, (rank + 1) * args.batch // 2)

    def fleet_step(ids):
        ids = ids if case == "mp2" else ids[half]
        opt.minimize(model(input_ids=ids, labels=ids).loss)
        opt.clear_grad()
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    return fleet_step, held


def _window(step, batches: list, steps: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    if step is not None:
        for i in range(steps):
            step(batches[i % len(batches)])
    dist.barrier()  # the window ends when the slowest rank is done
    return (time.perf_counter() - start) / steps


def _entry(rank: int, world: int, port: int, args, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from fleetx import fleet
    dist.init_process_group("gloo")  # the unsplit case's barriers; fleet.init reuses it
    g = torch.Generator().manual_seed(0)  # the same global batches on every rank
    batches = [torch.randint(VOCAB, (args.batch, args.length), generator=g) for _ in range(3)]
    times: dict = {c: [] for c in CASES}
    held: dict = {}
    for r in range(args.rounds):
        for case in CASES[r % len(CASES):] + CASES[:r % len(CASES)]:  # rotate the order
            step, held[case] = build(fleet, case, args)
            _window(step, batches, args.warmup)
            times[case].append(_window(step, batches, args.steps))
    gathered: list = [None] * world
    dist.all_gather_object(gathered, held)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"times": times, "held": gathered}, f)
    dist.barrier()


def report(data: dict) -> dict:
    times, summary = data["times"], {}
    for case in CASES:
        q1, med, q3 = quartiles([a / b for a, b in zip(times[case], times["unsplit"])])
        entry = {"ms_per_step": 1000 * statistics.median(times[case]),
                 "vs_unsplit": {"median": med, "q1": q1, "q3": q3},
                 "param_bytes_per_rank": [h[case] for h in data["held"]]}
        summary[case] = entry
        print(f"  {case:>13}: {entry['ms_per_step']:8.1f} ms/step, x{med:.3f} of unsplit "
              f"(IQR {q1:.3f}-{q3:.3f}), parameters per rank "
              f"{', '.join(f'{b:,}' for b in entry['param_bytes_per_rank'])} B")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per window")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="sequences per step, all ranks")
    parser.add_argument("--out", default="/tmp/fleetx_tp_plan.json")
    args = parser.parse_args()
    if args.batch % 2 or args.heads % 4:
        parser.error("--batch must be even and --heads a multiple of 4 (2 key/value heads per "
                     "rank at least)")
    start_processes(_entry, args=(2, free_port(), args, args.out), nprocs=2)
    with open(args.out) as f:
        data = json.load(f)
    print(f"Llama hidden {args.hidden}, {args.layers} layers, {args.heads} heads, "
          f"{args.length} tokens, {args.batch} sequences per step, float32 Adam, 1 thread/process")
    print(json.dumps({"benchmark": "tp_plan", "args": vars(args), "cases": report(data)}))


if __name__ == "__main__":
    main()
