"""Train a small Hugging Face Llama on the clothing-review text: sharding stage 3, recompute by
class, amp, then export it for ``from_pretrained``.

    fleetrun --nproc_per_node 2 examples/hf_llama/train.py                 # 200 updates
    fleetrun --nproc_per_node 2 examples/hf_llama/train.py --steps 20      # a short run

The model is ``transformers.LlamaForCausalLM`` built from a ``LlamaConfig`` (no weights and no
tokenizer are downloaded): byte-level, one token per UTF-8 byte (256 ids), so any text encodes
and decodes without a vocabulary file. The training loop is the one a Hugging Face user writes
(``out = model(input_ids=x, labels=x)``, ``out.loss``); fleetx adds the strategy:

* ``sharding`` stage 3: parameters, gradients and optimizer state split over the processes,
  each ``LlamaDecoderLayer`` one FSDP unit (found from the model's repeated blocks);
* ``recompute`` by class: ``{"checkpoints": ["LlamaDecoderLayer"]}``;
* ``amp``: bfloat16 autocast (on a CPU without bfloat16 instructions the linear layers stay
  float32, as in examples/gpt); gradients clipped to norm 1 (``clip_grad_norm_``).

Every ``--eval_every`` updates the held-out loss (bytes, nats) is printed beside the unigram model
of the training bytes, the baseline a language model must beat. At the end every rank calls
``fleet.export_model(--out)``: one ``model.safetensors`` and ``config.json`` that
``LlamaForCausalLM.from_pretrained(--out)`` loads; rank 0 loads it so and samples text.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(1, str(HERE.parent / "gpt"))
from progress import Progress  # noqa: E402  (examples/progress.py)

from fleetx import fleet  # noqa: E402

PROMPT = "This dress"
HELD_OUT = 0.05
BLOCK = "LlamaDecoderLayer"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="optimizer updates")
    parser.add_argument("--batch_size", type=int, default=16, help="windows per process")
    parser.add_argument("--block_size", type=int, default=64, help="bytes per window")
    parser.add_argument("--n_layer", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv_heads", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    parser.add_argument("--warmup", type=int, default=20, help="updates of linear warm-up")
    parser.add_argument("--eval_every", type=int, default=50, help="updates between evaluations")
    parser.add_argument("--eval_windows", type=int, default=64,
                        help="held-out windows per evaluation (split over the processes)")
    parser.add_argument("--amp_black_list", default="auto",
                        help="comma-separated amp_configs['custom_black_list']; auto: 'Linear' "
                             "on a CPU without fast bfloat16, else none")
    parser.add_argument("--out", default="llama_export", help="where fleet.export_model writes")
    parser.add_argument("--sample_tokens", type=int, default=200)
    parser.add_argument("--progress_every", type=float, default=5.0,
                        help="seconds between progress lines when stdout is not a terminal")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max_ratio", type=float, default=0.0,
                        help="exit non-zero unless the final held-out loss is below this "
                             "fraction of the unigram loss (0: no check)")
    return parser.parse_args()


def load_bytes(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reviews as UTF-8 bytes: (training ids, held-out ids), 5 % of the reviews held out
    (the same split rule as examples/gpt, on bytes instead of characters)."""
    import data  # examples/gpt/data.py: where the review table ships, and what reads it
    import numpy as np
    import pandas as pd

    reviews = pd.read_parquet(data.reviews_path(), columns=["Review Text"])["Review Text"]
    reviews = reviews.dropna().tolist()
    order = np.random.default_rng(seed).permutation(len(reviews))
    cut = int(len(reviews) * HELD_OUT)

    def ids(indices) -> torch.Tensor:
        text = "\n".join(reviews[i] for i in indices) + "\n"
        return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()
    return ids(order[cut:]), ids(order[:cut])


def unigram_loss(train: torch.Tensor, held_out: torch.Tensor) -> float:
    """Cross-entropy (nats per byte) of the held-out bytes under the training bytes'
    frequencies, add-one smoothed."""
    counts = torch.bincount(train, minlength=256).double() + 1
    return float(-(counts / counts.sum()).log()[held_out].mean())


def windows(ids: torch.Tensor, size: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """``size`` random windows of ``length`` bytes (the model shifts its labels itself)."""
    starts = torch.randint(len(ids) - length, (size,), generator=gen).tolist()
    return torch.stack([ids[s:s + length] for s in starts])


def black_list(choice: str) -> list[str]:
    """Emulated bfloat16 matrix products are ~40x slower than float32 on a CPU without bf16
    instructions, so there the linear layers stay float32."""
    if choice != "auto":
        return [name for name in choice.split(",") if name]
    if torch.cuda.is_available():
        return []
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return [] if any(f in flags for f in ("amx_bf16", "avx512_bf16")) else ["Linear"]


def make_strategy(args: argparse.Namespace) -> fleet.DistributedStrategy:
    s = fleet.DistributedStrategy()
    s.sharding = True
    s.sharding_configs = {"stage": 3}
    s.recompute = True
    s.recompute_configs = {"checkpoints": [BLOCK]}
    s.amp = True
    s.amp_configs = {"custom_black_list": black_list(args.amp_black_list)}
    return s


def build_model(args: argparse.Namespace):
    """A byte-level ``LlamaForCausalLM`` from a config (seeded alike on every rank; fleetx
    would broadcast rank 0's weights anyway)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=256, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                      num_hidden_layers=args.n_layer, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, max_position_embeddings=args.block_size,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None,
                      tie_word_embeddings=True)
    torch.manual_seed(args.seed)
    return LlamaForCausalLM(cfg)


def learning_rate(update: int, args: argparse.Namespace) -> float:
    """Linear warm-up, then cosine decay to a tenth of ``--lr``."""
    if update < args.warmup:
        return args.lr * (update + 1) / args.warmup
    progress = (update - args.warmup) / max(args.steps - args.warmup, 1)
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def adamw(model: torch.nn.Module, lr: float) -> torch.optim.AdamW:
    """AdamW with two parameter groups, as nanoGPT's ``configure_optimizers``: weight decay on
    the matrices, none on norms and biases."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95))


@torch.no_grad()
def held_out_loss(model: torch.nn.Module, ids: torch.Tensor, args: argparse.Namespace) -> float:
    """Mean loss over the same held-out windows at every evaluation; each rank computes its
    share (every rank runs the same forwards, which the sharded model's gathers need) and the
    sums are all-reduced."""
    rank, world = fleet.worker_index(), fleet.worker_num()
    x = windows(ids, args.eval_windows, args.block_size, torch.Generator().manual_seed(1))
    x = x[rank::world].to(fleet.local_device())
    model.eval()
    # labels shifted inside: block_size - 1 predicted bytes per window
    total = model(input_ids=x, labels=x).loss.item() * x.shape[0]
    model.train()
    return fleet.util.all_reduce(total) / args.eval_windows


def sample(path: str, tokens: int) -> str:
    """Text sampled by the exported model, loaded the Hugging Face way."""
    from transformers import LlamaForCausalLM

    plain = LlamaForCausalLM.from_pretrained(path).eval()
    prompt = torch.tensor([list(PROMPT.encode("utf-8"))])
    torch.manual_seed(0)
    out = plain.generate(prompt, max_new_tokens=tokens, do_sample=True, temperature=0.8,
                         top_k=50, pad_token_id=0)
    return bytes(out[0].tolist()).decode("utf-8", errors="replace")


def main() -> None:
    args = parse_args()
    train, held = load_bytes(args.seed)
    fleet.init(is_collective=True, strategy=make_strategy(args))
    plain = build_model(args)
    count = sum(p.numel() for p in plain.parameters())
    model = fleet.distributed_model(plain.to(fleet.local_device()))
    optimizer = fleet.distributed_optimizer(adamw(model, args.lr))
    unigram = unigram_loss(train, held)
    if fleet.is_first_worker():
        fleet.explain()
        print(f"Llama: {count / 1e6:.2f} M parameters, byte tokens (256 ids), {len(train):,} "
              f"training and {len(held):,} held-out bytes; {fleet.worker_num()} process(es), "
              f"{args.batch_size} x {args.block_size} bytes per update and process", flush=True)
    gen = torch.Generator().manual_seed(args.seed * 1000 + fleet.worker_index())
    per_update = args.batch_size * args.block_size * fleet.worker_num()
    progress = Progress(args.steps * per_update, fleet.is_first_worker(),
                        every=args.progress_every, unit="tokens")
    start, loss, held_loss = time.monotonic(), float("nan"), float("nan")
    for update in range(1, args.steps + 1):
        optimizer.set_lr(learning_rate(update - 1, args))
        x = windows(train, args.batch_size, args.block_size, gen).to(fleet.local_device())
        out = model(input_ids=x, labels=x)
        optimizer.backward(out.loss)
        optimizer.clip_grad_norm_(1.0)  # by the unscaled norm under amp, as every LLM recipe
        optimizer.step()
        optimizer.zero_grad()
        loss = out.loss.item()
        progress.update(update * per_update, loss)
        if update % args.eval_every == 0 or update == args.steps:
            held_loss = held_out_loss(model, held, args)
            progress.close()
            fleet.util.print_on_rank(
                f"update {update}/{args.steps}: train loss {loss:.3f}  held-out loss "
                f"{held_loss:.3f}  (unigram {unigram:.3f})  "
                f"{update * per_update / (time.monotonic() - start):,.0f} tokens/s", 0)
    fleet.export_model(args.out)  # every rank: the shards are gathered, rank 0 writes
    if fleet.is_first_worker():
        print(f"exported to {args.out} (model.safetensors, config.json)", flush=True)
        print(f"sample ({args.sample_tokens} bytes after {PROMPT!r}, temperature 0.8):\n"
              f"{sample(args.out, args.sample_tokens)}", flush=True)
    if args.max_ratio and not held_loss < args.max_ratio * unigram:
        raise SystemExit(f"held-out loss {held_loss:.3f} is above {args.max_ratio:g} x the "
                         f"unigram loss {unigram:.3f}")


if __name__ == "__main__":
    main()
