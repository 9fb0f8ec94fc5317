"""fleetx's amp and recompute on one CUDA GPU against the torch code a user would write instead.

Five trainers of the same GPT (``examples/gpt/model.py``, same initial weights, same batches,
AdamW), one process:

* ``fp32``: plain torch, float32;
* ``torch_amp``: ``torch.autocast("cuda", float16)`` around the forward and a
  ``torch.amp.GradScaler`` around backward and step (the hand-written mixed precision loop);
* ``fleetx_amp``: ``strategy.amp`` through ``fleet.distributed_model`` /
  ``distributed_optimizer`` and ``opt.minimize(loss)``;
* ``torch_amp_ckpt``: ``torch_amp`` with every block under
  ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``;
* ``fleetx_amp_recompute``: ``strategy.amp`` and ``strategy.recompute`` naming every block.

Each round runs a window of ``--steps`` steps of every trainer (after warm-up steps), the order
rotating every round, timed with ``torch.cuda.synchronize``; the peak of allocated CUDA memory is
read per window. The script prints, per trainer, the median ms/step and peak memory, and the
medians over rounds of the ratios that matter: torch_amp/fp32 (what float16 buys),
fleetx_amp/torch_amp and fleetx_amp_recompute/torch_amp_ckpt (what fleetx's layer costs over the
engines it wraps), and the memory recompute saves.

    python benchmarks/gpu_step.py --rounds 5
    python benchmarks/gpu_step.py --rounds 2 --steps 2 --size tiny   # seconds; any device
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "gpt"))
from model import GPT, GPTConfig, block_names, lm_loss  # noqa: E402  (examples/gpt/model.py)

from fleetx import DistributedStrategy  # noqa: E402
from fleetx.fleet import Fleet  # noqa: E402

SIZES = {"full": dict(n_layer=12, n_embd=768, n_head=12, block_size=512, batch=16),
         "tiny": dict(n_layer=2, n_embd=64, n_head=2, block_size=32, batch=4)}
VOCAB = 128
CASES = ("fp32", "torch_amp", "fleetx_amp", "torch_amp_ckpt", "fleetx_amp_recompute")


class Checkpointed(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.inner, x, use_reentrant=False)


def gpt(size: dict, device: str) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=VOCAB, block_size=size["block_size"], n_layer=size["n_layer"],
                    n_head=size["n_head"], n_embd=size["n_embd"])
    return GPT(cfg).to(device)


def torch_trainer(size: dict, device: str, amp: bool, ckpt: bool) -> Callable[[tuple], None]:
    model = gpt(size, device)
    if ckpt:
        model.blocks = nn.ModuleList(Checkpointed(b) for b in model.blocks)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler(device, enabled=amp)

    def step(batch: tuple) -> None:
        x, y = batch
        with torch.autocast(device, dtype=torch.float16, enabled=amp):
            logits = model(x)
        scaler.scale(lm_loss(logits.float(), y)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    return step


def fleetx_trainer(size: dict, device: str, recompute: bool) -> Callable[[tuple], None]:
    model = gpt(size, device)
    s = DistributedStrategy()
    s.amp = True
    if recompute:
        s.recompute = True
        s.recompute_configs = {"checkpoints": block_names(model)}
    fleet = Fleet()
    fleet.init(is_collective=True, strategy=s)
    wrapped = fleet.distributed_model(model)
    opt = fleet.distributed_optimizer(torch.optim.AdamW(wrapped.parameters(), lr=1e-4))

    def step(batch: tuple) -> None:
        x, y = batch
        opt.minimize(lm_loss(wrapped(x).float(), y))
        opt.clear_grad()
    return step


def trainers(size: dict, device: str) -> dict[str, Callable[[tuple], None]]:
    return {"fp32": torch_trainer(size, device, amp=False, ckpt=False),
            "torch_amp": torch_trainer(size, device, amp=True, ckpt=False),
            "fleetx_amp": fleetx_trainer(size, device, recompute=False),
            "torch_amp_ckpt": torch_trainer(size, device, amp=True, ckpt=True),
            "fleetx_amp_recompute": fleetx_trainer(size, device, recompute=True)}


def window(step: Callable[[tuple], None], batches: list, device: str) -> tuple[float, int]:
    """ms per step over ``batches`` and the peak of allocated CUDA memory (0 on the CPU)."""
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for b in batches:
        step(b)
    if cuda:
        torch.cuda.synchronize()
    ms = (time.perf_counter() - start) * 1000 / len(batches)
    return ms, (torch.cuda.max_memory_allocated() if cuda else 0)


def measure(size: dict, device: str, rounds: int, steps: int, warmup: int) -> dict:
    g = torch.Generator().manual_seed(1)
    shape = (size["batch"], size["block_size"])
    batches = [(torch.randint(0, VOCAB, shape, generator=g).to(device),
                torch.randint(0, VOCAB, shape, generator=g).to(device)) for _ in range(steps)]
    run = trainers(size, device)
    for step in run.values():
        window(step, batches[:warmup], device)
    per_round = []
    for r in range(rounds):
        order = CASES[r % len(CASES):] + CASES[:r % len(CASES)]
        per_round.append({c: window(run[c], batches, device) for c in order})
    return summarise(per_round)


def summarise(per_round: list) -> dict:
    def med(values: list) -> float:
        return statistics.median(values)
    out = {"ms_per_step": {c: med([r[c][0] for r in per_round]) for c in CASES},
           "peak_mib": {c: max(r[c][1] for r in per_round) / 2 ** 20 for c in CASES}}
    pairs = {"torch_amp/fp32": ("torch_amp", "fp32"),
             "fleetx_amp/torch_amp": ("fleetx_amp", "torch_amp"),
             "fleetx_amp_recompute/torch_amp_ckpt": ("fleetx_amp_recompute", "torch_amp_ckpt"),
             "torch_amp_ckpt/torch_amp": ("torch_amp_ckpt", "torch_amp")}
    out["time_ratios"] = {k: [r[a][0] / r[b][0] for r in per_round] for k, (a, b) in pairs.items()}
    out["time_ratio_medians"] = {k: med(v) for k, v in out["time_ratios"].items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="full")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per window")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_step.py: no CUDA device; --device cpu runs the same loops on the CPU")
    size = SIZES[args.size]
    res = measure(size, args.device, args.rounds, args.steps, args.warmup)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"{name}, torch {torch.__version__}, GPT {size}")
    for c in CASES:
        print(f"  {c:22s} {res['ms_per_step'][c]:8.2f} ms/step  peak {res['peak_mib'][c]:9.0f} MiB")
    for k, v in res["time_ratio_medians"].items():
        rounds = ", ".join(f"{x:.3f}" for x in res["time_ratios"][k])
        print(f"  {k:38s} median {v:.3f} (rounds {rounds})")
    print(json.dumps({"device": name, "torch": torch.__version__, "size": size, **res}))


if __name__ == "__main__":
    main()
