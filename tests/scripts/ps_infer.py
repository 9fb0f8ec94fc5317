"""Distributed inference through the fleet API (tests/distributed/test_ps_fleet_infer.py).

Every role runs this script. Without ``--infer-from`` it trains ``InferNet`` for ``--steps``
steps in ``--mode``, turns to inference (``DistributedInfer.init_distributed_infer_env()``),
saves, and scores; with ``--infer-from DIR`` it is an inference-only job started from that
save (``--bare``: the script builds no optimizer; ``DistributedInfer`` lays the tables out).
Workers score their shard of the held-out batches (slicing by rank) and merge the AUC
with ``fleet.metrics``; each writes ``<out>/worker<rank>.npz``: the global AUC, its own
predictions, the servers' row counts before and after scoring (held-out ids include ids never
trained, which must not become rows), and what the servers and the optimizer said to writes.
"""
import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

from fleetx import fleet, metrics
from fleetx.nn import SparseEmbedding

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--mode", default="sync", choices=("sync", "async", "geo"))
ap.add_argument("--steps", type=int, default=6)
ap.add_argument("--save", default=None)
ap.add_argument("--infer-from", default=None)
ap.add_argument("--bare", action="store_true", help="no distributed_model/optimizer call")
args = ap.parse_args()

VOCAB, DIM, BATCH = 30, 4, 32


class InferNet(nn.Module):
    """A bounded table (from nn.Embedding), an unbounded one (hashed ids), an MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM, sparse=True)
        self.hashed = SparseEmbedding(DIM, name="hashed")
        self.mlp = nn.Sequential(nn.Linear(2 * DIM + 2, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, ids, hashed, x):
        feats = torch.cat([self.emb(ids), self.hashed(hashed), x], 1)
        return self.mlp(feats).squeeze(1)


def data(step: int, held_out: bool = False):
    """A batch: ids, hashed ids (held-out batches add ids never trained), features, labels."""
    g = torch.Generator().manual_seed((5000 if held_out else 0) + step)
    ids = torch.randint(0, VOCAB, (BATCH,), generator=g)
    hashed = torch.randint(0, 50, (BATCH,), generator=g) * 7919 + (10 ** 9 if held_out else 0)
    x = torch.rand(BATCH, 2, generator=g)
    y = ((ids < VOCAB // 2).float() + x[:, 0] > 0.8).float()
    return ids, hashed, x, y


fleet.init()
torch.manual_seed(0)
if args.bare:
    model = InferNet()  # DistributedInfer wraps it and builds a stand-in optimizer
else:
    model = fleet.distributed_model(InferNet())
    strategy = fleet.DistributedStrategy()
    strategy.a_sync = args.mode != "sync"
    if args.mode == "geo":
        strategy.a_sync_configs = {"k_steps": 4}
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.2), strategy)
infer = fleet.utils.DistributedInfer(model)

if args.infer_from:
    infer.init_distributed_infer_env(dirname=args.infer_from)  # servers serve here, read-only
    if fleet.is_server():
        sys.exit(0)
else:
    if fleet.is_server():
        fleet.init_server()
        fleet.run_server()
        sys.exit(0)
    fleet.init_worker()
    rank, nranks = fleet.worker_index(), fleet.worker_num()
    for step in range(args.steps):
        ids, hashed, x, y = (t[rank::nranks] for t in data(step))
        opt.minimize(nn.functional.binary_cross_entropy_with_logits(model(ids, hashed, x), y))
    infer.init_distributed_infer_env()  # sends what it holds; every worker meets here
    if args.save:
        fleet.save_persistables(args.save)

rank, nranks = fleet.worker_index(), fleet.worker_num()
session = fleet._fleet._ctx.runtime._session
client = session.client


def rows() -> list:
    return [s["rows"] for s in client.stats().wait()]


before = rows()
scorer = infer.get_dist_infer_program()
auc, preds = metrics.AUC(), []
with torch.no_grad():
    for step in range(rank, 8, nranks):  # this worker's shard of the held-out batches
        ids, hashed, x, y = data(step, held_out=True)
        p = torch.sigmoid(scorer(ids, hashed, x))
        auc.update(p, y)
        preds.append(p.numpy())
scorer.train()  # a training-mode forward reads too: no row is created either
scorer(*data(0, held_out=True)[:3])
after = rows()
refusals = {}
try:
    fleet.step()
except Exception as e:  # noqa: BLE001 - the message is what the test reads
    refusals["step"] = f"{type(e).__name__}: {e}"
probe = {"hashed": (np.array([123456789], np.int64), np.ones((1, DIM), np.float32))}
for what, call in (("push", lambda: client.push(probe).wait()),
                   ("pull_create", lambda: client.pull({"hashed": probe["hashed"][0]},
                                                       create=True).wait()),
                   ("init", lambda: client.init(probe, force=True).wait())):
    try:
        call()
    except Exception as e:  # noqa: BLE001
        refusals[what] = f"{type(e).__name__}: {e}"
global_auc = auc.global_auc()
fleet.stop_worker()
np.savez(Path(args.out) / f"worker{rank}.npz", auc=global_auc, preds=np.concatenate(preds),
         rows_before=json.dumps(before), rows_after=json.dumps(after),
         refusals=json.dumps(refusals))
print(f"worker {rank}: AUC {global_auc:.6f}", flush=True)
