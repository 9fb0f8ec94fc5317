"""word2vec (skip-gram, negative sampling) on clothing reviews, with the tables on parameter
servers in GEO mode.

    fleetrun --server_num 1 --worker_num 2 examples/word2vec/train.py      # GEO, k_steps 100
    python examples/word2vec/train.py                                      # one process

Every process runs this script. The two embedding tables (the center words' vectors and the
context words' vectors) are ``nn.Embedding(sparse=True)`` modules, which the parameter server
turns into sparse tables; the model has no dense parameter. In GEO mode each worker trains its
share of the reviews on local copies of the rows it touches and exchanges the changes with the
servers every ``--k-steps`` steps. Worker 0 prints the loss and samples/s of each epoch and,
at the end, the check of ``neighbours.py``: the nearest neighbours of 15 probe words against
hand-made lists of related words, compared with a random embedding of the same vocabulary.
``--target 3`` exits with an error unless the trained embedding hits at least 3 times as often.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import data  # noqa: E402  (the example's own modules, beside this file)
import neighbours  # noqa: E402

from fleetx import fleet  # noqa: E402


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--k-steps", type=int, default=100, help="GEO: local steps between exchanges")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1024, help="(center, context) pairs per step")
    ap.add_argument("--negatives", type=int, default=5)
    ap.add_argument("--window", type=int, default=5)
    ap.add_argument("--lr", type=float, default=0.2, help="Adagrad")
    ap.add_argument("--min-count", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--limit", type=int, default=0, help="use the first N reviews only (tests)")
    ap.add_argument("--target", type=float, default=0.0,
                    help="exit with an error unless trained hits >= target x random hits")
    return ap.parse_args()


class SkipGram(nn.Module):
    """Scores a center word against its context word and ``K`` negatives.

    ``forward(center [B], context_and_negatives [B, 1 + K])`` returns each pair's loss
    ``-log s(u.v) - sum_k log s(-u.n_k)`` (``s`` the sigmoid, ``u`` the center's vector);
    ``forward(words)`` alone returns the words' center vectors (the embedding evaluated).
    """

    def __init__(self, vocabulary: int, dim: int) -> None:
        super().__init__()
        self.center = nn.Embedding(vocabulary, dim, sparse=True)
        self.context = nn.Embedding(vocabulary, dim, sparse=True)
        nn.init.uniform_(self.center.weight, -0.5 / dim, 0.5 / dim)  # word2vec's initialisation
        nn.init.zeros_(self.context.weight)

    def forward(self, center: torch.Tensor, others: Optional[torch.Tensor] = None) -> torch.Tensor:
        u = self.center(center)                                      # [B, d]
        if others is None:
            return u
        scores = (self.context(others) @ u.unsqueeze(2)).squeeze(2)  # [B, 1 + K]
        return -(F.logsigmoid(scores[:, 0]) + F.logsigmoid(-scores[:, 1:]).sum(1))


def batches(corpus: data.Corpus, negatives: data.Negatives, args, epoch: int, rank: int):
    """One epoch of ``(center, context + negatives)`` tensors for this worker."""
    rng = np.random.default_rng([args.seed, epoch, rank])
    centers, contexts = data.pairs(corpus, rng, args.window)
    for lo in range(0, len(centers), args.batch):
        c, o = centers[lo:lo + args.batch], contexts[lo:lo + args.batch]
        others = np.concatenate([o[:, None], negatives.draw(rng, (len(c), args.negatives))], 1)
        yield torch.from_numpy(c), torch.from_numpy(others)


def embedding_of(model: nn.Module, vocabulary: int) -> np.ndarray:
    """Every word's center vector, as this worker's model holds it (evaluation lookups)."""
    model.eval()
    with torch.no_grad():
        vectors = model(torch.arange(vocabulary)).numpy()
    model.train()
    return vectors


def report(vectors: np.ndarray, corpus: data.Corpus) -> tuple[int, int]:
    """Print every probe's neighbours and the summary; returns ``(trained, random)`` hits."""
    trained, random, per_probe = neighbours.check(vectors, corpus.words)
    for probe, (near, hit) in per_probe.items():
        print(f"  {probe:12s} {hit} hit(s): {', '.join(near)}")
    print(f"nearest neighbours: {trained} hits over {len(per_probe)} probe words; a random "
          f"embedding (seed {neighbours.RANDOM_SEED}) {random}; ratio "
          f"{trained / max(random, 1):.1f} (trained / max(random, 1))", flush=True)
    return trained, random


def train(model, opt, corpus: data.Corpus, args, rank: int, workers: int) -> None:
    """``args.epochs`` passes over this worker's share of the reviews."""
    mine, negatives = corpus.shard(rank, workers), data.Negatives(corpus.counts)
    for epoch in range(args.epochs):
        t0, losses, pairs = time.perf_counter(), [], 0
        # the next batch's rows are fetched while this one trains (both tables)
        for center, others in fleet.prefetch(
                batches(mine, negatives, args, epoch, rank),
                lambda b: {model.module.center: b[0], model.module.context: b[1]}):
            loss = model(center, others).sum()
            opt.minimize(loss)
            losses.append(loss.item() / len(center))
            pairs += len(center)
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs}: loss {np.mean(losses):.4f}, "
                  f"{pairs / (time.perf_counter() - t0):.0f} pairs/s on worker 0", flush=True)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)  # the job's processes share the cores; small ops gain nothing
    torch.manual_seed(args.seed)  # every role builds the same initial tables
    fleet.init()
    corpus = data.build(data.reviews(args.limit), args.min_count)
    model = fleet.distributed_model(SkipGram(len(corpus), args.dim))
    strategy = fleet.DistributedStrategy()
    strategy.a_sync = True
    strategy.a_sync_configs = {"k_steps": args.k_steps}       # GEO
    opt = fleet.distributed_optimizer(torch.optim.Adagrad(model.parameters(), lr=args.lr),
                                      strategy)
    if fleet.is_server():
        fleet.init_server()
        fleet.run_server()
        return
    fleet.init_worker()
    rank, workers = fleet.worker_index(), max(fleet.worker_num(), 1)
    if rank == 0:
        print(f"{len(corpus)} words, {len(corpus.ids)} tokens; {workers} worker(s), GEO "
              f"k_steps {args.k_steps}" + (f", {fleet.server_num()} server(s)"
                                           if fleet.server_num() else ", no servers"), flush=True)
    began = time.perf_counter()
    train(model, opt, corpus, args, rank, workers)
    trained = random = 0
    if rank == 0:
        print(f"trained in {time.perf_counter() - began:.1f} s", flush=True)
        trained, random = report(embedding_of(model, len(corpus)), corpus)
    fleet.stop_worker()
    if args.target and rank == 0 and trained < args.target * max(random, 1):
        sys.exit(f"the trained embedding's {trained} hits are fewer than {args.target} x "
                 f"max({random}, 1)")

if __name__ == "__main__":
    main()
