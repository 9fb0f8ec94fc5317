"""Recompute in one process: bytes saved for backward and step time with and without it, and
fleetx's ``strategy.recompute`` against ``torch.utils.checkpoint`` used directly.

Three trainers of the same model (same initial weights, same batches, SGD with momentum):

* ``plain``: no recompute; ``loss.backward(); opt.step(); opt.zero_grad()``;
* ``torch``: every block wrapped in a module whose forward is
  ``torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)`` (what a user would write
  without fleetx), the same plain loop;
* ``fleetx``: ``strategy.recompute`` with every block named in ``recompute_configs``,
  ``fleet.distributed_model`` / ``distributed_optimizer`` and ``opt.minimize(loss)``.

Models: a deep residual MLP (every block ``Linear(w, 4w) -> GELU -> Linear(4w, w)`` named) and
the small GPT of ``examples/gpt/model.py`` (every ``blocks.i`` named).

Bytes saved for backward are counted over one forward with
``torch.autograd.graph.saved_tensors_hooks``: each storage once, parameters left out (the
activations). They are exact counts, not timings. Step time: windows of ``steps`` training steps
run in turn for the three trainers, the order rotating every round so that none always follows
another; each round gives the ratios torch/plain (the price of recomputation) and fleetx/torch
(what fleetx's layer costs over the engine it wraps); the script prints their medians and
interquartile ranges. One thread, one process.

    python benchmarks/recompute.py --rounds 15
    python benchmarks/recompute.py --size tiny --rounds 3 --smoke     # seconds; numbers meaningless

Prints a human summary and one JSON line per model.
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
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from ratios import quartiles

from fleetx.strategy.measured import SavedForBackward

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "gpt"))
from model import GPT, GPTConfig  # noqa: E402  (the example's model, reused as is)

# size -> model -> dimensions; "full" is what docs/benchmarks.md reports
SIZES = {
    "full": {"mlp": dict(depth=16, width=256, batch=256, steps=5),
             "gpt": dict(n_layer=4, n_embd=256, block_size=128, batch=16, steps=3)},
    "tiny": {"mlp": dict(depth=4, width=32, batch=16, steps=2),
             "gpt": dict(n_layer=2, n_embd=32, block_size=16, batch=4, steps=2)},
}
VOCAB = 99  # the example's character vocabulary


class Block(nn.Module):
    """A residual MLP block."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(
            4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(x)))


class Checkpointed(nn.Module):
    """``torch.utils.checkpoint`` used directly: the baseline fleetx's recompute wraps."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.inner, x, use_reentrant=False, preserve_rng_state=True)


def build(kind: str, dims: dict) -> tuple[nn.Module, list[str], Callable, tuple]:
    """A fresh model (seed 0), its block names, its loss function and one batch."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if kind == "mlp":
        model = nn.Sequential(*[Block(dims["width"]) for _ in range(dims["depth"])],
                              nn.Linear(dims["width"], 1))
        names = [str(i) for i in range(dims["depth"])]
        batch = (torch.randn(dims["batch"], dims["width"], generator=g),
                 torch.randn(dims["batch"], 1, generator=g))
        return model, names, F.mse_loss, batch
    cfg = GPTConfig(VOCAB, dims["block_size"], dims["n_layer"], 4, dims["n_embd"])
    ids = torch.randint(VOCAB, (dims["batch"], dims["block_size"] + 1), generator=g)
    return (GPT(cfg), [f"blocks.{i}" for i in range(cfg.n_layer)],
            lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()),
            (ids[:, :-1], ids[:, 1:]))


def wrap_blocks(model: nn.Module, names: list[str]) -> nn.Module:
    """``model`` with each named block replaced by :class:`Checkpointed` around it."""
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Checkpointed(getattr(parent, child)))
    return model


def saved_bytes(model: nn.Module, loss_fn: Callable, batch: tuple) -> int:
    """Bytes of the distinct storages one forward saves for backward, parameters left out."""
    with SavedForBackward(model.parameters()) as saved:
        loss = loss_fn(model(batch[0]), batch[1])
    loss.backward()
    model.zero_grad(set_to_none=True)
    return saved.bytes


def trainers(kind: str, dims: dict) -> dict[str, tuple[Callable[[], None], int]]:
    """name -> (one training step, bytes saved for backward) for plain, torch and fleetx."""
    from fleetx import DistributedStrategy
    from fleetx.fleet import Fleet

    out = {}
    for name in ("plain", "torch"):
        model, names, loss_fn, batch = build(kind, dims)
        if name == "torch":
            wrap_blocks(model, names)
        nbytes = saved_bytes(model, loss_fn, batch)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

        def step(model=model, opt=opt, loss_fn=loss_fn, batch=batch) -> None:
            loss_fn(model(batch[0]), batch[1]).backward()
            opt.step()
            opt.zero_grad()
        out[name] = (step, nbytes)

    model, names, loss_fn, batch = build(kind, dims)
    strategy = DistributedStrategy()
    strategy.recompute = True
    strategy.recompute_configs = {"checkpoints": names}
    fleet = Fleet()
    fleet.init(is_collective=True, strategy=strategy)
    wrapped = fleet.distributed_model(model)
    opt = fleet.distributed_optimizer(torch.optim.SGD(wrapped.parameters(), lr=1e-3,
                                                      momentum=0.9))
    nbytes = saved_bytes(wrapped, loss_fn, batch)
    out["fleetx"] = (lambda: opt.minimize(loss_fn(wrapped(batch[0]), batch[1])), nbytes)
    return out


def window(step: Callable[[], None], steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return time.perf_counter() - start


def measure(kind: str, dims: dict, rounds: int) -> dict:
    """Bytes and alternating step-time windows of the three trainers of one model."""
    steps = trainers(kind, dims)
    order = list(steps)
    for name in order:  # warm-up: allocator, autograd caches, lazy imports
        window(steps[name][0], dims["steps"])
    times: dict[str, list[float]] = {name: [] for name in order}
    for r in range(rounds):
        for name in order[r % 3:] + order[:r % 3]:
            times[name].append(window(steps[name][0], dims["steps"]) / dims["steps"])
    cost = [t / p for t, p in zip(times["torch"], times["plain"])]
    layer = [f / t for f, t in zip(times["fleetx"], times["torch"])]
    return {"bench": "recompute", "model": kind, "dims": dims, "rounds": rounds,
            "saved_bytes": {name: steps[name][1] for name in order},
            "step_s_median": {name: statistics.median(times[name]) for name in order},
            "torch_over_plain": quartiles(cost), "fleetx_over_torch": quartiles(layer)}


def report(r: dict) -> str:
    b, t = r["saved_bytes"], r["step_s_median"]
    q1, med, q3 = r["fleetx_over_torch"]
    c1, cmed, c3 = r["torch_over_plain"]
    return (f"{r['model']} {r['dims']}: saved for backward plain {b['plain']:,} B, "
            f"torch.utils.checkpoint {b['torch']:,} B ({b['torch'] / b['plain']:.1%}), fleetx "
            f"{b['fleetx']:,} B ({b['fleetx'] / b['plain']:.1%})\n"
            f"  step time (median of {r['rounds']}): plain {t['plain'] * 1e3:.1f} ms, torch "
            f"{t['torch'] * 1e3:.1f} ms, fleetx {t['fleetx'] * 1e3:.1f} ms; recompute costs "
            f"{100 * (cmed - 1):+.1f} % (IQR {100 * (c1 - 1):+.1f}..{100 * (c3 - 1):+.1f}); "
            f"fleetx/torch {med:.4f} (IQR {q1:.4f}-{q3:.4f}) -> layer cost "
            f"{100 * (med - 1):+.2f} %")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--models", default="mlp,gpt", help="comma-separated: mlp, gpt")
    parser.add_argument("--rounds", type=int, default=15, help="rounds of 3 windows (>= 10)")
    parser.add_argument("--smoke", action="store_true", help="allow fewer than 10 rounds")
    args = parser.parse_args()
    if args.rounds < 10 and not args.smoke:
        parser.error("--rounds must be >= 10 for a reportable figure (add --smoke for a quick "
                     "run)")
    torch.set_num_threads(1)  # only as a script: importing this module changes nothing
    for kind in args.models.split(","):
        if kind not in SIZES[args.size]:
            parser.error(f"unknown model {kind!r}; choose from {', '.join(SIZES[args.size])}")
        result = measure(kind, SIZES[args.size][kind], args.rounds)
        print(report(result), flush=True)
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
