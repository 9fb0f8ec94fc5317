"""Train a small GPT on the clothing-review text with amp, recompute, sharding and gradient merge.

    fleetrun --nproc_per_node 2 examples/gpt/train.py

One strategy does it all: ``amp`` (bfloat16 autocast on CPU, float16 on GPU), ``recompute`` of
every transformer block (``blocks.0``, ``blocks.1``, ...), ``sharding`` stage 2 (optimizer state
and gradients split over the processes) and ``gradient_merge`` (``--k_steps`` micro-batches per
update). Each process draws its own random windows of the training text; rank 0 prints a
progress bar, and every ``--eval_every`` updates the loss on held-out reviews beside the loss of
a unigram model of the same text (the baseline a language model must beat). At the end every
rank gathers the full model (``model.state_dict()`` is a collective call under sharding) and
rank 0 samples text from a plain copy of it.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
import data  # noqa: E402  (the example's own loader, beside this file)
from model import GPT, GPTConfig, block_names, parameter_count  # noqa: E402
from progress import Progress  # noqa: E402  (examples/progress.py, shared by the examples)

from fleetx import fleet  # noqa: E402

PROMPT = "This dress"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="optimizer updates")
    parser.add_argument("--k_steps", type=int, default=2, help="micro-batches per update")
    parser.add_argument("--batch_size", type=int, default=16, help="per micro-batch and process")
    parser.add_argument("--block_size", type=int, default=64, help="tokens per window")
    parser.add_argument("--n_layer", type=int, default=4)
    parser.add_argument("--n_head", type=int, default=4)
    parser.add_argument("--n_embd", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    parser.add_argument("--warmup", type=int, default=20, help="updates of linear warm-up")
    parser.add_argument("--eval_every", type=int, default=50, help="updates between evaluations")
    parser.add_argument("--eval_windows", type=int, default=64,
                        help="held-out windows per evaluation (split over the processes)")
    parser.add_argument("--amp_black_list", default="auto",
                        help="comma-separated amp_configs['custom_black_list']; auto: 'Linear' "
                             "on a CPU without fast bfloat16 (see README), else none")
    parser.add_argument("--sample_tokens", type=int, default=400)
    parser.add_argument("--progress_every", type=float, default=5.0,
                        help="seconds between progress lines when stdout is not a terminal")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max_ratio", type=float, default=0.0,
                        help="exit non-zero unless the final held-out loss is below this "
                             "fraction of the unigram loss (0: no check)")
    return parser.parse_args()


def black_list(choice: str) -> list[str]:
    """The amp black list: emulated bfloat16 matrix products are ~40x slower than float32 on
    a CPU without bf16 instructions, so there the linear layers stay float32."""
    if choice != "auto":
        return [name for name in choice.split(",") if name]
    if torch.cuda.is_available():
        return []
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return [] if any(f in flags for f in ("amx_bf16", "avx512_bf16")) else ["Linear"]


def make_strategy(args: argparse.Namespace, blocks: list[str]) -> fleet.DistributedStrategy:
    s = fleet.DistributedStrategy()
    s.amp = True
    s.amp_configs = {"custom_black_list": black_list(args.amp_black_list)}
    s.recompute = True
    s.recompute_configs = {"checkpoints": blocks}
    s.sharding = True
    s.sharding_configs = {"stage": 2}
    s.gradient_merge = True
    s.gradient_merge_configs = {"k_steps": args.k_steps, "avg": True}
    return s


def learning_rate(update: int, args: argparse.Namespace) -> float:
    """Linear warm-up to ``--lr`` (large early steps of Adam upset a fresh transformer), then
    cosine decay to a tenth of it at the last update."""
    if update < args.warmup:
        return args.lr * (update + 1) / args.warmup
    progress = (update - args.warmup) / max(args.steps - args.warmup, 1)
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def held_out_loss(model: torch.nn.Module, ids: torch.Tensor, args: argparse.Namespace) -> float:
    """Mean loss over the same ``--eval_windows`` held-out windows at every evaluation; each
    rank computes its share and the sums are all-reduced (every rank runs the same number of
    forwards, which the sharded model's gathers need)."""
    rank, world = fleet.worker_index(), fleet.worker_num()
    x, y = data.batch(ids, args.eval_windows, args.block_size, torch.Generator().manual_seed(1))
    model.eval()
    total = F.cross_entropy(model(x[rank::world]).flatten(0, 1).float(),
                            y[rank::world].flatten(), reduction="sum").item()
    model.train()
    return fleet.util.all_reduce(total) / y.numel()


def sample(model: torch.nn.Module, cfg: GPTConfig, corpus: data.Corpus, tokens: int) -> str:
    """Text generated by a plain copy of the trained model (every rank must call this: the
    full state dict is gathered collectively; rank 0 generates)."""
    state = model.state_dict()
    if not fleet.is_first_worker():
        return ""
    plain = GPT(cfg)
    plain.load_state_dict({k: v.float().cpu() for k, v in state.items()})
    prompt = corpus.encode(PROMPT)[None, :]
    out = plain.eval().generate(prompt, tokens, generator=torch.Generator().manual_seed(0))
    return corpus.decode(out[0])


def main() -> None:
    args = parse_args()
    corpus = data.load(args.seed)
    cfg = GPTConfig(len(corpus.chars), args.block_size, args.n_layer, args.n_head, args.n_embd)
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    plain = GPT(cfg)
    fleet.init(is_collective=True, strategy=make_strategy(args, block_names(plain)))
    rank, world = fleet.worker_index(), fleet.worker_num()
    model = fleet.distributed_model(plain.to(fleet.local_device()))
    optimizer = fleet.distributed_optimizer(
        torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01))
    unigram = data.unigram_loss(corpus)
    if fleet.is_first_worker():
        fleet.explain()
        print(f"GPT: {parameter_count(plain) / 1e6:.2f} M parameters, character tokenizer "
              f"({len(corpus.chars)} ids), {len(corpus.train):,} training and "
              f"{len(corpus.held_out):,} held-out characters; {world} process(es), "
              f"{args.batch_size} x {args.block_size} tokens per micro-batch and process, "
              f"{args.k_steps} micro-batches per update", flush=True)

    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)  # each rank its own windows
    tokens_per_update = args.k_steps * args.batch_size * args.block_size * world
    progress = Progress(args.steps * tokens_per_update, fleet.is_first_worker(),
                        every=args.progress_every, unit="tokens")
    start, updates, loss, held = time.monotonic(), 0, float("nan"), float("nan")
    while updates < args.steps:
        optimizer.set_lr(learning_rate(updates, args))
        x, y = data.batch(corpus.train, args.batch_size, args.block_size, gen)
        logits = model(x.to(fleet.local_device()))
        step_loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        loss = step_loss.item()
        if optimizer.minimize(step_loss):
            updates += 1
            progress.update(updates * tokens_per_update, loss)
            if updates % args.eval_every == 0 or updates == args.steps:
                held = held_out_loss(model, corpus.held_out, args)
                progress.close()
                fleet.util.print_on_rank(
                    f"update {updates}/{args.steps}: train loss {loss:.3f}  held-out loss "
                    f"{held:.3f}  (unigram {unigram:.3f})  "
                    f"{updates * tokens_per_update / (time.monotonic() - start):,.0f} tokens/s",
                    0)
    text = sample(model, cfg, corpus, args.sample_tokens)
    fleet.util.print_on_rank(f"sample ({args.sample_tokens} characters after "
                             f"{PROMPT!r}, temperature 0.8):\n{text}", 0)
    if args.max_ratio and not held < args.max_ratio * unigram:  # nan (no evaluation) fails
        raise SystemExit(f"held-out loss {held:.3f} is above {args.max_ratio:g} x the unigram "
                         f"loss {unigram:.3f}")


if __name__ == "__main__":
    main()
