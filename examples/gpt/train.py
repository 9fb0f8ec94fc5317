"""Train a small GPT on the clothing-review text with amp, recompute, sharding and gradient merge.

    fleetrun --nproc_per_node 2 examples/gpt/train.py
    fleetrun --nproc_per_node 2 examples/gpt/train.py --mp 2    # tensor-parallel blocks
    fleetrun --nproc_per_node 2 examples/gpt/train.py --pp 2    # a pipeline of 2 stages

One strategy does it all: ``amp`` (bfloat16 autocast on CPU, float16 on GPU), ``recompute`` of
every transformer block (``blocks.0``, ``blocks.1``, ...), ``sharding`` stage 2 (optimizer state
and gradients split over the processes) and ``gradient_merge`` (``--k_steps`` micro-batches per
update). Each process draws its own random windows of the training text; rank 0 prints a
progress bar, and every ``--eval_every`` updates the loss on held-out reviews beside the loss of
a unigram model of the same text (the baseline a language model must beat). At the end every
rank gathers the full model (``model.state_dict()`` is a collective call under sharding) and
rank 0 samples text from a plain copy of it.

``--mp N`` splits the blocks over N processes (``GPTConfig(tensor_parallel=True)``) with
recompute and gradient merge; sharding is off (fleetx refuses it with tensor parallelism).
Every rank of a model-parallel group reads the same windows and runs every forward, the
sampling too. ``--pp N`` runs the model as a ``PipelineLayer`` of N stages
(:func:`model.pipeline_layers`, head tied to the embedding across stages) trained with
``train_batch``: ``--k_steps`` micro-batches per update are the pipeline's
``accumulate_steps``, each ``--batch_size`` windows, and each run of consecutive layers is
recomputed in backward (``recompute_interval=1``); the held-out loss comes from ``eval_batch``
and rank 0 samples from the unsplit model made of the stages' state dicts. Both run in float32:
amp's black list names ``torch.nn`` classes, which the parallel layers are not, and emulated
bfloat16 matrix products are slow on most CPUs (see README).
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
import data  # noqa: E402  (the example's own loader, beside this file)
from model import (GPT, GPTConfig, block_names, lm_loss, parameter_count,  # noqa: E402
                   pipeline_layers, unpipelined_state)
from progress import Progress  # noqa: E402  (examples/progress.py, shared by the examples)

from fleetx import fleet  # noqa: E402
from fleetx.fleet import meta_parallel as mpu  # noqa: E402

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
    parser.add_argument("--mp", type=int, default=1,
                        help="tensor-parallel degree (blocks split over this many processes)")
    parser.add_argument("--pp", type=int, default=1,
                        help="pipeline stages (the model as a PipelineLayer, train_batch)")
    parser.add_argument("--max_ratio", type=float, default=0.0,
                        help="exit non-zero unless the final held-out loss is below this "
                             "fraction of the unigram loss (0: no check)")
    args = parser.parse_args()
    if args.mp > 1 and args.pp > 1:
        parser.error("--mp and --pp together: this example splits the model one way at a time")
    return args


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
    if args.mp > 1 or args.pp > 1:
        return model_parallel_strategy(s, args, blocks)
    s.amp = True
    s.amp_configs = {"custom_black_list": black_list(args.amp_black_list)}
    s.recompute = True
    s.recompute_configs = {"checkpoints": blocks}
    s.sharding = True
    s.sharding_configs = {"stage": 2}
    s.gradient_merge = True
    s.gradient_merge_configs = {"k_steps": args.k_steps, "avg": True}
    return s


def model_parallel_strategy(s: fleet.DistributedStrategy, args: argparse.Namespace,
                            blocks: list[str]) -> fleet.DistributedStrategy:
    """``--mp``: the blocks split, recompute and gradient merge; ``--pp``: the pipeline's
    micro-batches (gradient merge is refused there: ``accumulate_steps`` is the merge)."""
    s.hybrid_configs = {"mp_degree": args.mp, "pp_degree": args.pp}
    if args.pp > 1:
        s.pipeline_configs = {"micro_batch_size": args.batch_size,
                              "accumulate_steps": args.k_steps}
        return s
    s.tensor_parallel_configs = {"tensor_init_seed": args.seed}
    s.recompute = True
    s.recompute_configs = {"checkpoints": blocks}
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


def data_position(args: argparse.Namespace) -> tuple[int, int]:
    """(index, count) of this rank's data replica: every process reads its own windows, but
    the processes of one model-parallel group or pipeline read the same ones."""
    if args.mp * args.pp == 1:
        return fleet.worker_index(), fleet.worker_num()
    hcg = fleet.get_hybrid_communicate_group()
    return hcg.get_data_parallel_rank(), hcg.get_data_parallel_world_size()


@torch.no_grad()
def held_out_loss(model: torch.nn.Module, ids: torch.Tensor, args: argparse.Namespace) -> float:
    """Mean loss over the same ``--eval_windows`` held-out windows at every evaluation; each
    data replica computes its share and the sums are all-reduced (every rank runs the same
    number of forwards, which the sharded model's gathers need). The ranks of a model-parallel
    group or pipeline all hold their replica's sum, hence the division by mp x pp."""
    rank, replicas = data_position(args)
    x, y = data.batch(ids, args.eval_windows, args.block_size, torch.Generator().manual_seed(1))
    x, y = x[rank::replicas], y[rank::replicas]
    if args.pp > 1:  # eval_batch takes mini-batches of micro_batch_size x accumulate_steps
        size = args.batch_size * args.k_steps
        if len(x) % size:
            raise SystemExit(f"--eval_windows {args.eval_windows} must be a multiple of "
                             f"{replicas} x --batch_size x --k_steps = {replicas * size}")
        total = sum(model.eval_batch([x[i:i + size], y[i:i + size]]).item() * y[:size].numel()
                    for i in range(0, len(x), size))
    else:
        model.eval()
        total = lm_loss(model(x), y).item() * y.numel()
        model.train()
    return fleet.util.all_reduce(total) / (args.mp * args.pp) / (y.numel() * replicas)


def sample(model: torch.nn.Module, cfg: GPTConfig, corpus: data.Corpus, tokens: int) -> str:
    """Text generated by a plain copy of the trained model (every rank must call this: the
    full state dict is gathered collectively; rank 0 generates). With ``--mp`` every rank
    generates with its shards (the forward's all-reduces need them all; their logits, hence
    the tokens drawn from the same generator, are equal); with ``--pp`` the stages' state dicts
    (global keys) are gathered on rank 0 into the unsplit model."""
    prompt = corpus.encode(PROMPT)[None, :]
    if cfg.tensor_parallel:
        plain = model.module if hasattr(model, "module") else model
    else:
        state = model.state_dict()
        if hasattr(model, "train_batch"):  # a pipeline stage: merge the stages' parameters
            stages = [None] * fleet.worker_num() if fleet.is_first_worker() else None
            dist.gather_object(state, stages, dst=0)
            state = unpipelined_state({k: v for s in stages or [] for k, v in s.items()},
                                      cfg.n_layer) if stages else {}
        if not fleet.is_first_worker():
            return ""
        plain = GPT(cfg)
        plain.load_state_dict({k: v.float().cpu() for k, v in state.items()})
    out = plain.eval().generate(prompt, tokens, generator=torch.Generator().manual_seed(0))
    return corpus.decode(out[0])


def build(args: argparse.Namespace, cfg: GPTConfig) -> tuple[torch.nn.Module, GPTConfig]:
    """``fleet.init`` and the distributed model: the plain GPT, its blocks split (``--mp``),
    or this process's pipeline stage (``--pp``); also the config of the unsplit model that
    :func:`sample` loads."""
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    if args.mp > 1 or args.pp > 1:
        fleet.init(is_collective=True,
                   strategy=make_strategy(args, [f"blocks.{i}" for i in range(cfg.n_layer)]))
        if args.mp > 1:
            cfg = GPTConfig(**{**vars(cfg), "tensor_parallel": True})
            return fleet.distributed_model(GPT(cfg).to(fleet.local_device())), cfg
        stage = mpu.PipelineLayer(pipeline_layers(cfg), loss_fn=lm_loss, recompute_interval=1,
                                  seg_method="layer:PipeBlock")  # the blocks split evenly
        return fleet.distributed_model(stage.to(fleet.local_device())), cfg
    plain = GPT(cfg)
    fleet.init(is_collective=True, strategy=make_strategy(args, block_names(plain)))
    return fleet.distributed_model(plain.to(fleet.local_device())), cfg


def train_update(model: torch.nn.Module, optimizer, corpus: data.Corpus,
                 gen: torch.Generator, args: argparse.Namespace) -> float:
    """One optimizer update: ``--k_steps`` micro-batches, through ``minimize`` (which returns
    True on the update) or one ``train_batch``; the last micro-batch's loss (``--pp``: the
    update's mean)."""
    if args.pp > 1:
        x, y = data.batch(corpus.train, args.batch_size * args.k_steps, args.block_size, gen)
        return model.train_batch([x.to(fleet.local_device()), y.to(fleet.local_device())],
                                 optimizer).item()
    while True:
        x, y = data.batch(corpus.train, args.batch_size, args.block_size, gen)
        loss = lm_loss(model(x.to(fleet.local_device())), y.to(fleet.local_device()))
        if optimizer.minimize(loss):
            return loss.item()


def main() -> None:
    args = parse_args()
    corpus = data.load(args.seed)
    cfg = GPTConfig(len(corpus.chars), args.block_size, args.n_layer, args.n_head, args.n_embd)
    count = parameter_count(GPT(cfg))
    model, cfg = build(args, cfg)
    optimizer = fleet.distributed_optimizer(
        torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01))
    unigram = data.unigram_loss(corpus)
    replica, replicas = data_position(args)
    if fleet.is_first_worker():
        fleet.explain()
        split = ("" if args.mp * args.pp == 1 else f" split over {args.mp * args.pp} "
                 f"processes ({'blocks over mp' if args.mp > 1 else 'pipeline stages'})")
        reader = "process" if args.mp * args.pp == 1 else f"data replica ({replicas})"
        print(f"GPT: {count / 1e6:.2f} M parameters{split}, character tokenizer "
              f"({len(corpus.chars)} ids), {len(corpus.train):,} training and "
              f"{len(corpus.held_out):,} held-out characters; {fleet.worker_num()} "
              f"process(es), {args.batch_size} x {args.block_size} tokens per micro-batch and "
              f"{reader}, {args.k_steps} micro-batches per update", flush=True)

    # each data replica its own windows (the ranks of one model-parallel group the same ones)
    gen = torch.Generator().manual_seed(args.seed * 1000 + replica)
    tokens_per_update = args.k_steps * args.batch_size * args.block_size * replicas
    progress = Progress(args.steps * tokens_per_update, fleet.is_first_worker(),
                        every=args.progress_every, unit="tokens")
    start, updates, loss, held = time.monotonic(), 0, float("nan"), float("nan")
    while updates < args.steps:
        optimizer.set_lr(learning_rate(updates, args))
        loss = train_update(model, optimizer, corpus, gen, args)
        updates += 1
        progress.update(updates * tokens_per_update, loss)
        if updates % args.eval_every == 0 or updates == args.steps:
            held = held_out_loss(model, corpus.held_out, args)
            progress.close()
            fleet.util.print_on_rank(
                f"update {updates}/{args.steps}: train loss {loss:.3f}  held-out loss "
                f"{held:.3f}  (unigram {unigram:.3f})  "
                f"{updates * tokens_per_update / (time.monotonic() - start):,.0f} tokens/s", 0)
    text = sample(model, cfg, corpus, args.sample_tokens)
    fleet.util.print_on_rank(f"sample ({args.sample_tokens} characters after "
                             f"{PROMPT!r}, temperature 0.8):\n{text}", 0)
    if args.max_ratio and not held < args.max_ratio * unigram:  # nan (no evaluation) fails
        raise SystemExit(f"held-out loss {held:.3f} is above {args.max_ratio:g} x the unigram "
                         f"loss {unigram:.3f}")


if __name__ == "__main__":
    main()
