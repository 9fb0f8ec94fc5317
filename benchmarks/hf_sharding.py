"""Sharding stages 2/3 on Hugging Face models: per-rank memory with the old and the new FSDP2 units,
and fleetx's step time against FSDP2 ``fully_shard`` used directly with the same units.

Two processes (gloo, CPU, one thread each) run, for ``GPT2LMHeadModel`` and ``LlamaForCausalLM``
built from configs of ``--layers`` layers (default 8), ``--width`` wide, a byte-level vocabulary
of 256, float32, Adam:

* **memory** at stage 3, for two unit rules on the same model, in the same run:
  ``old``, the rule before units followed the blocks (each child holding parameters, looking
  through ``ModuleList`` / ``ModuleDict`` / ``Sequential``, a tied child left in the root),
  applied with ``fully_shard`` directly; ``new``, fleetx's default (the repeated blocks), through
  ``fleet.distributed_model``. Per rank: the peak of the parameter bytes gathered at any module
  boundary of a forward (``sharding_engine.gathered_bytes``), and the state bytes held after a
  step (local parameter shards, gradients and Adam state). The bound the new rule must keep:
  root + two blocks (the root's own parameters and the largest block, in full).
* **speed** at stages 2 and 3: each round builds fleetx's trainer and the raw one (``fully_shard``
  on each block, then the root, ``reshard_after_forward`` as the stage, plain Adam), warms each
  up and times a window of steps, alternating the order every round; a window's time is the
  slowest rank's. Reported: the median over rounds of fleetx's time / raw time (goal <= 1.05).

    python benchmarks/hf_sharding.py --rounds 7
    python benchmarks/hf_sharding.py --part memory   # the byte counts alone, untimed
    python benchmarks/hf_sharding.py --layers 2 --width 32 --rounds 1 --steps 1 --warmup 1  # smoke

Prints a summary and one JSON line.
"""
from __future__ import annotations

import argparse
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

MODELS = ("gpt2", "llama")
LR = 1e-4


def build(name: str, args) -> nn.Module:
    """The model ``name`` from a config (no weights downloaded), dropout off, seed 0."""
    import transformers as tf
    torch.manual_seed(0)
    if name == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(
            vocab_size=256, n_positions=args.seq, n_embd=args.width, n_layer=args.layers,
            n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
            eos_token_id=0))
    return tf.LlamaForCausalLM(tf.LlamaConfig(
        vocab_size=256, hidden_size=args.width, intermediate_size=4 * args.width,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=args.seq, bos_token_id=0, eos_token_id=0, pad_token_id=0))


def blocks(model: nn.Module) -> list[nn.Module]:
    return list(model.transformer.h if hasattr(model, "transformer") else model.model.layers)


def old_units(model: nn.Module) -> list[nn.Module]:
    """The rule before units followed the blocks: each child holding parameters, through
    containers, a child sharing a parameter with the rest of the model left in the root."""
    names: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    units = []

    def visit(module: nn.Module, prefix: str) -> None:
        for key, child in module.named_children():
            if isinstance(child, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
                visit(child, f"{prefix}{key}.")
            elif any(True for _ in child.parameters()) and all(
                    n.startswith(f"{prefix}{key}.") for p in child.parameters()
                    for n in names[id(p)]):
                units.append(child)
    visit(model, "")
    return units


def raw(model: nn.Module, units: list[nn.Module], stage: int) -> tuple[nn.Module, Callable]:
    """``fully_shard`` on ``units`` then the root, plain Adam: (model, step(x))."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for unit in units:
        fully_shard(unit, mesh=mesh, reshard_after_forward=stage == 3)
    fully_shard(model, mesh=mesh, reshard_after_forward=stage == 3)
    opt = torch.optim.Adam(model.parameters(), lr=LR)

    def step(x):
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    return model, step, opt


def through_fleetx(fleet, model: nn.Module, stage: int) -> tuple[nn.Module, Callable]:
    s = fleet.DistributedStrategy()
    s.sharding = True
    s.sharding_configs = {"stage": stage}
    fleet.init(is_collective=True, strategy=s)  # a fresh plan; the process group is kept
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrapped = fleet.distributed_model(model)
        opt = fleet.distributed_optimizer(torch.optim.Adam(wrapped.parameters(), lr=LR))

    def step(x):
        opt.minimize(wrapped(input_ids=x, labels=x).loss)
    return wrapped, step, opt


def _local(t: torch.Tensor) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def state_bytes(model: nn.Module, opt) -> int:
    """This rank's parameter shards, gradient shards and optimizer state, in bytes."""
    params = list(model.parameters())
    held = sum(_local(p) for p in params) + sum(_local(p.grad) for p in params
                                                if p.grad is not None)
    inner = getattr(opt, "inner_opt", None) or getattr(opt, "_inner_opt", None) or opt
    for state in inner.state.values():
        held += sum(_local(v) for v in state.values() if torch.is_tensor(v) and v.dim() > 0)
    return held


def peak_forward(model: nn.Module, x) -> int:
    """The most parameter bytes gathered at any module boundary of one forward."""
    from fleetx.strategy.algorithms.sharding_engine import gathered_bytes
    peak = [0]

    def note(*_):
        peak[0] = max(peak[0], gathered_bytes(model))
    hooks = [m.register_forward_pre_hook(note) for m in model.modules()]
    hooks += [m.register_forward_hook(note) for m in model.modules()]
    with torch.no_grad():
        model(input_ids=x, labels=x)
    for h in hooks:
        h.remove()
    return peak[0]


def full_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def measure_memory(fleet, name: str, args, x) -> dict:
    plain = build(name, args)
    block = max(full_bytes(b) for b in blocks(plain))
    figures = {"full": full_bytes(plain), "block": block,
               "root": full_bytes(plain) - sum(full_bytes(b) for b in blocks(plain))}
    for rule in ("old", "new"):
        model = build(name, args)
        if rule == "old":
            figures["old_units"] = len(old_units(model))
            model, step, opt = raw(model, old_units(model), 3)
        else:
            model, step, opt = through_fleetx(fleet, model, 3)
        step(x)  # every parameter gets its gradient and optimizer state
        figures[f"{rule}_peak"] = peak_forward(model, x)
        figures[f"{rule}_state"] = state_bytes(model, opt)
    return figures


def _window(step: Callable, x, steps: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step(x)
    dist.barrier()  # the window ends when the slowest rank is done
    return (time.perf_counter() - start) / steps


def measure_speed(fleet, name: str, args, x) -> dict:
    times: dict[str, list] = {}
    for stage in (2, 3):
        cases = (f"fleetx_stage{stage}", f"raw_stage{stage}")
        for r in range(args.rounds):
            for case in cases[r % 2:] + cases[:r % 2]:  # alternate the order
                model = build(name, args)
                _, step, _ = (through_fleetx(fleet, model, stage) if case.startswith("fleetx")
                              else raw(model, blocks(model), stage))
                _window(step, x, args.warmup)
                times.setdefault(case, []).append(_window(step, x, args.steps))
    return times


def _entry(rank: int, world: int, port: int, args, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from fleetx import fleet
    fleet.init(is_collective=True)
    x = torch.randint(0, 256, (args.batch, args.seq), generator=torch.Generator().manual_seed(rank))
    results = {}
    for name in MODELS:
        memory = measure_memory(fleet, name, args, x)
        gathered: list = [None] * world
        dist.all_gather_object(gathered, memory)
        times = measure_speed(fleet, name, args, x) if args.part != "memory" else None
        results[name] = {"memory": gathered, "times": times}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.barrier()


def report(name: str, data: dict) -> dict:
    mem = {k: max(r[k] for r in data["memory"]) for k in data["memory"][0]}  # the largest rank
    bound = mem["root"] + 2 * mem["block"]
    print(f"  {name}: {mem['full']:,} B of parameters (root {mem['root']:,}, block "
          f"{mem['block']:,}); old rule: {mem['old_units']} unit(s)")
    for rule in ("old", "new"):
        peak = mem[f"{rule}_peak"]
        print(f"    {rule}: forward peak {peak:>12,} B (x{peak / bound:.3f} of root + 2 blocks, "
              f"x{peak / mem['full']:.3f} of the model); state {mem[f'{rule}_state']:>12,} B")
    speed = {}
    for stage in (2, 3) if data["times"] is not None else ():
        fx, rw = data["times"][f"fleetx_stage{stage}"], data["times"][f"raw_stage{stage}"]
        q1, med, q3 = quartiles([a / b for a, b in zip(fx, rw)])
        speed[f"stage{stage}"] = {"fleetx_ms": 1000 * statistics.median(fx),
                                  "raw_ms": 1000 * statistics.median(rw),
                                  "ratio": {"median": med, "q1": q1, "q3": q3}}
        print(f"    stage {stage}: fleetx {1000 * statistics.median(fx):8.1f} ms/step, raw "
              f"fully_shard {1000 * statistics.median(rw):8.1f} ms/step, x{med:.3f} "
              f"(IQR {q1:.3f}-{q3:.3f})")
    return {"memory": mem, "within_bound": mem["new_peak"] <= bound, "speed": speed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4, help="sequences per process")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per window")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--part", choices=("all", "memory"), default="all",
                        help="memory: the byte counts only (counted, not timed: any machine)")
    parser.add_argument("--out", default="/tmp/fleetx_hf_sharding.json")
    args = parser.parse_args()
    start_processes(_entry, args=(2, free_port(), args, args.out), nprocs=2)
    with open(args.out) as f:
        data = json.load(f)
    print(f"2 processes, {args.layers} layers x {args.width}, {args.batch} x {args.seq} tokens "
          f"per rank, float32, Adam:")
    results = {name: report(name, data[name]) for name in MODELS}
    print(json.dumps({"bench": "hf_sharding", **{k: v for k, v in vars(args).items()
                                                if k != "out"}, "results": results}))


if __name__ == "__main__":
    main()
