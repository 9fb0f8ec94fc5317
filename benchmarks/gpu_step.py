"""The GPT example's training step under fleetx against the same loop in raw PyTorch, on one GPU.

Six trainers of the same GPT (``examples/gpt/model.py``, same initial weights, same batches,
AdamW), one process, in three pairs of the same loop written both ways:

* ``fp32`` (raw torch: ``backward(); step(); zero_grad()``, float32 without TF32, torch's
  default) and ``fleetx_fp32`` (``fleet.distributed_model`` / ``distributed_optimizer`` with no
  strategy and ``opt.minimize(loss)``);
* ``torch_amp`` (``torch.autocast("cuda", float16)`` around the forward and a
  ``torch.amp.GradScaler`` around backward and step) and ``fleetx_amp`` (``strategy.amp``);
* ``torch_amp_ckpt`` (``torch_amp`` with every block under
  ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``) and
  ``fleetx_amp_recompute`` (``strategy.amp`` and ``strategy.recompute`` naming every block).

Each round runs a window of ``--steps`` steps of every trainer (after warm-up steps), the order
rotating every round, timed with ``torch.cuda.synchronize``; the peak of allocated CUDA memory is
read per window (every trainer's weights and optimizer state are resident, so the figures
differ by what each trainer's step adds). Per trainer the script reports the median over rounds
of ms/step, with the tokens/s and model-FLOPs utilisation of that median step, and per pair the
median of the per-round time ratios (fleetx / torch: what fleetx's layer costs over the loop it
wraps).

Model FLOPs per token follow nanoGPT's ``estimate_mfu`` (PaLM, Chowdhury et al. 2022,
appendix B): ``6 N + 12 L T C`` for ``N`` parameters (the position embedding left out, the tied
token embedding counted once: it is the output head's matrix), ``L`` layers, ``T`` tokens of
context and width ``C`` (the attention's score and value products). Recomputation is not
counted (model FLOPs, not hardware FLOPs), so a recomputing trainer's utilisation is what its
step time leaves of the plain model's work. The utilisation of every trainer is against the
device's dense float16/bfloat16 tensor-core peak (:data:`PEAK_FLOPS`, or ``--peak-flops``), so
the float32 rows show what float16 buys; on an unknown device or the CPU it is left out unless
``--peak-flops`` is given.

    python benchmarks/gpu_step.py --rounds 7 --steps 30 --json /tmp/gpu_step.json
    python benchmarks/gpu_step.py --rounds 2 --steps 1 --size tiny --device cpu  # seconds
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "gpt"))
from model import GPT, GPTConfig, block_names, lm_loss, parameter_count  # noqa: E402

from fleetx import DistributedStrategy  # noqa: E402
from fleetx.fleet import Fleet  # noqa: E402

SIZES = {"full": dict(n_layer=12, n_embd=768, n_head=12, block_size=512, batch=16),
         "tiny": dict(n_layer=2, n_embd=64, n_head=2, block_size=32, batch=4)}
VOCAB = 128
CASES = ("fp32", "fleetx_fp32", "torch_amp", "fleetx_amp", "torch_amp_ckpt",
         "fleetx_amp_recompute")
PAIRS = {"fleetx_fp32/fp32": ("fleetx_fp32", "fp32"),
         "fleetx_amp/torch_amp": ("fleetx_amp", "torch_amp"),
         "fleetx_amp_recompute/torch_amp_ckpt": ("fleetx_amp_recompute", "torch_amp_ckpt"),
         "torch_amp/fp32": ("torch_amp", "fp32"),
         "torch_amp_ckpt/torch_amp": ("torch_amp_ckpt", "torch_amp")}
#: Dense (no sparsity) float16 / bfloat16 tensor-core peak FLOP/s by device name, from NVIDIA's
#: data sheets; the first entry whose key the name contains wins (so the variants come first).
PEAK_FLOPS = (("H200 NVL", 835.5e12), ("H200", 989.5e12), ("H100 NVL", 835.5e12),
              ("H100 PCIe", 756e12), ("H100", 989.5e12), ("A100", 312e12))


def peak_flops(device_name: str, override: Optional[float] = None) -> tuple[Optional[float], str]:
    """The peak FLOP/s the utilisation is measured against, and where it came from.

    Example:
        >>> peak_flops("NVIDIA H200")
        (989500000000000.0, 'table: H200')
        >>> peak_flops("cpu")
        (None, 'unknown device cpu: pass --peak-flops')
    """
    if override:
        return float(override), "--peak-flops"
    for key, value in PEAK_FLOPS:
        if key.lower() in device_name.lower():
            return value, f"table: {key}"
    return None, f"unknown device {device_name}: pass --peak-flops"


def flops_per_token(model: GPT) -> int:
    """Model FLOPs of one token's forward and backward, ``6 N + 12 L T C`` (see the module)."""
    cfg = model.cfg
    n = parameter_count(model) - model.pos_emb.weight.numel()
    return 6 * n + 12 * cfg.n_layer * cfg.block_size * cfg.n_embd


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


def fleetx_trainer(size: dict, device: str, amp: bool, recompute: bool
                   ) -> Callable[[tuple], None]:
    model = gpt(size, device)
    s = DistributedStrategy()
    s.amp = amp
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
            "fleetx_fp32": fleetx_trainer(size, device, amp=False, recompute=False),
            "torch_amp": torch_trainer(size, device, amp=True, ckpt=False),
            "fleetx_amp": fleetx_trainer(size, device, amp=True, recompute=False),
            "torch_amp_ckpt": torch_trainer(size, device, amp=True, ckpt=True),
            "fleetx_amp_recompute": fleetx_trainer(size, device, amp=True, recompute=True)}


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


def measure(size: dict, device: str, rounds: int, steps: int, warmup: int,
            max_seconds: float = 0.0) -> list[dict]:
    """Per round, ``{case: (ms/step, peak bytes)}``. With ``max_seconds``, no round starts that
    would end past that many seconds of timing (judged by the round before; at least one)."""
    g = torch.Generator().manual_seed(1)
    shape = (size["batch"], size["block_size"])
    batches = [(torch.randint(0, VOCAB, shape, generator=g).to(device),
                torch.randint(0, VOCAB, shape, generator=g).to(device)) for _ in range(steps)]
    run = trainers(size, device)
    for step in run.values():
        window(step, batches[:warmup], device)
    per_round: list[dict] = []
    start = last = time.perf_counter()
    for r in range(rounds):
        order = CASES[r % len(CASES):] + CASES[:r % len(CASES)]
        per_round.append({c: window(run[c], batches, device) for c in order})
        now = time.perf_counter()
        if max_seconds and now - start + (now - last) > max_seconds:
            break
        last = now
    return per_round


def summarise(per_round: list, tokens_per_step: int, flops_token: int,
              peak: Optional[float]) -> dict:
    """Medians over rounds per trainer, and the per-round ratios of each pair."""
    def med(values: list) -> float:
        return statistics.median(values)
    ms = {c: med([r[c][0] for r in per_round]) for c in CASES}
    tps = {c: tokens_per_step * 1000 / v for c, v in ms.items()}  # of the median step
    out = {"rounds_done": len(per_round), "ms_per_step": ms, "tokens_per_s": tps,
           "mfu": {c: (v * flops_token / peak if peak else None) for c, v in tps.items()},
           "peak_mib": {c: max(r[c][1] for r in per_round) / 2 ** 20 for c in CASES}}
    out["time_ratios"] = {k: [r[a][0] / r[b][0] for r in per_round] for k, (a, b) in PAIRS.items()}
    out["time_ratio_medians"] = {k: med(v) for k, v in out["time_ratios"].items()}
    return out


def report(res: dict) -> str:
    """The human-readable table (the JSON follows it on the last line)."""
    lines = [f"{res['device']}, torch {res['torch']}, GPT {res['size']}: {res['n_params']:,} "
             f"parameters, {res['flops_per_token']:,} model FLOPs/token, "
             f"{res['tokens_per_step']:,} tokens/step; peak {res['peak_flops']} "
             f"({res['peak_source']}); {res['rounds_done']} rounds"]
    for c in CASES:
        mfu = res["mfu"][c]
        lines.append(f"  {c:22s} {res['ms_per_step'][c]:9.2f} ms/step "
                     f"{res['tokens_per_s'][c]:12,.0f} tokens/s  MFU "
                     f"{'-' if mfu is None else f'{mfu:6.1%}'}  peak "
                     f"{res['peak_mib'][c]:9.0f} MiB")
    for k, v in res["time_ratio_medians"].items():
        rounds = ", ".join(f"{x:.3f}" for x in res["time_ratios"][k])
        lines.append(f"  {k:38s} median {v:.3f} (rounds {rounds})")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="full")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=30, help="timed steps per window")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--peak-flops", type=float, default=None,
                    help="peak FLOP/s for the utilisation (default: by device name)")
    ap.add_argument("--max-seconds", type=float, default=0.0,
                    help="start no round that would end past this many seconds of timing")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_step.py: no CUDA device; --device cpu runs the same loops on the CPU")
    size = SIZES[args.size]
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    peak, source = peak_flops(name, args.peak_flops)
    model = gpt(size, "cpu")
    tokens = size["batch"] * size["block_size"]
    per_round = measure(size, args.device, args.rounds, args.steps, args.warmup,
                        args.max_seconds)
    res = {"device": name, "torch": torch.__version__, "cuda": torch.version.cuda,
           "size": size, "n_params": parameter_count(model),
           "flops_per_token": flops_per_token(model), "tokens_per_step": tokens,
           "peak_flops": peak, "peak_source": source,
           **summarise(per_round, tokens, flops_per_token(model), peak)}
    print(report(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
