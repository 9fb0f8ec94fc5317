"""Train a small CTR model with a converted ``nn.Embedding`` and an unbounded
``SparseEmbedding`` (on every role of a job, or alone), then export it with
``fleet.save_inference_model`` and write what the live model scores on a fixed batch
(``<out>/live.json``), for ``serve_export.py`` to compare with."""
import argparse
import json
from pathlib import Path

import torch
from torch import nn

from fleetx import fleet
from fleetx.nn import SparseEmbedding
from fleetx.ps.api import InitConfig

USERS = [2 ** 40 + k for k in range(12)]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(30, 4, sparse=True)
        self.user = SparseEmbedding(4, name="user", init=InitConfig("uniform", seed=1))
        self.mlp = nn.Sequential(nn.Linear(11, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, ids, users, x):
        return self.mlp(torch.cat([self.emb(ids), self.user(users), x], 1)).squeeze(1)


def batch(step: int, rank: int = 0, nranks: int = 1):
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 30, (16,), generator=g)
    users = torch.tensor(USERS)[torch.randint(0, len(USERS), (16,), generator=g)]
    x = torch.rand(16, 3, generator=g)
    y = (ids < 15).float()
    return ids[rank::nranks], users[rank::nranks], x[rank::nranks], y[rank::nranks]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    fleet.init()
    torch.manual_seed(0)
    model = fleet.distributed_model(Net())
    strategy = fleet.DistributedStrategy()
    strategy.a_sync = False
    opt = fleet.distributed_optimizer(torch.optim.Adagrad(model.parameters(), lr=0.1), strategy)
    if fleet.is_server():
        fleet.init_server()
        fleet.run_server()
        return
    fleet.init_worker()
    rank, nranks = fleet.worker_index(), fleet.worker_num()
    for step in range(1, 6):
        ids, users, x, y = batch(step, rank, nranks)
        opt.minimize(nn.functional.binary_cross_entropy_with_logits(model(ids, users, x), y))
    fleet.save_inference_model(str(Path(args.out, "export")))
    model.eval()
    with torch.no_grad():
        ids, users, x, _ = batch(100)
        scores = model(ids, users, x).tolist()
    if rank == 0:
        Path(args.out, "live.json").write_text(json.dumps(scores))
    fleet.stop_worker()


if __name__ == "__main__":
    main()
