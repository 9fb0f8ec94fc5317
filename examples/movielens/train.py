"""Stream MovieLens-100k through the parameter server in time slices, with admission, eviction,
the memory report and streaming saves.

    fleetrun --server_num 2 --worker_num 2 examples/movielens/train.py
    python examples/movielens/train.py --limit 20000 --passes 2      # one process, no servers

Every process runs this script. The training ratings, in time order, are cut into ``--passes``
slices; each is one pass (sync mode): workers train on their share of the slice, then every
worker calls ``fleet.shrink()``, which evicts id rows not updated for more than
``--unseen-passes`` passes and forgets ids that waited for admission without being seen again.
Worker 0 prints what each shrink removed and the memory report (rows, bytes per table and
server). The held-out ratings (the last 20% in time) are scored at the end; new users there
read zeros until they are admitted, as in production.

``--save DIR`` saves a base (mode 1) after the first pass and a delta (mode 2) after each later
one, to ``DIR/pass-<k>``; ``--resume DIR/pass-0,DIR/pass-1,...`` replays such a chain.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import data  # noqa: E402  (the example's own modules, beside this file)
from model import MovieLensCTR  # noqa: E402

from fleetx import fleet, metrics  # noqa: E402


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--passes", type=int, default=4,
                    help="time slices of the training data (0: evaluate a --resume only)")
    ap.add_argument("--count-filter", type=int, default=2)
    ap.add_argument("--unseen-passes", type=int, default=1)
    ap.add_argument("--batch", type=int, default=256, help="per worker")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--limit", type=int, default=0, help="use the first rows in time only")
    ap.add_argument("--target", type=float, default=0.0,
                    help="exit with an error if the held-out AUC is below this")
    ap.add_argument("--save", default=None, help="a folder for a base and deltas, one per pass")
    ap.add_argument("--resume", default=None, help="comma-separated saves: a base, then deltas")
    return ap.parse_args()


def tensors(split: data.Split, rows) -> tuple:
    return (torch.from_numpy(split.ids[rows]), torch.from_numpy(split.attrs[rows]),
            torch.from_numpy(split.genres[rows]))


def train_pass(model, opt, part: data.Split, batch: int) -> tuple:
    """One pass over this worker's share of a slice, in time order; returns (loss sum, n)."""
    model.train()
    loss_sum = 0.0
    steps = -(-len(part) // batch)
    for k in range(steps):  # every worker takes the same number of steps (sync rounds)
        rows = np.arange(k * batch, min((k + 1) * batch, len(part)))
        if not len(rows):
            rows = np.arange(max(0, len(part) - 1), len(part))
        loss = F.binary_cross_entropy_with_logits(model(*tensors(part, rows)),
                                                  torch.from_numpy(part.label[rows]))
        opt.minimize(loss)
        loss_sum += float(loss.detach()) * len(rows)
    return loss_sum, len(part)


@torch.no_grad()
def evaluate(model, split: data.Split) -> float:
    """The held-out AUC over every worker's share (``fleet.metrics`` merges the histograms)."""
    model.eval()
    auc = metrics.AUC()
    for lo in range(0, len(split), 4096):
        rows = np.arange(lo, min(lo + 4096, len(split)))
        auc.update(torch.sigmoid(model(*tensors(split, rows))), split.label[rows])
    return auc.global_auc()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    fleet.init()
    train, held_out = data.load(args.limit)
    torch.manual_seed(0)  # every role builds the same model
    model = fleet.distributed_model(MovieLensCTR(count_filter=args.count_filter,
                                                 unseen_passes=args.unseen_passes))
    strategy = fleet.DistributedStrategy()
    strategy.a_sync = False
    opt = fleet.distributed_optimizer(torch.optim.Adagrad(model.parameters(), lr=args.lr),
                                      strategy)
    if fleet.is_server() or fleet.server_num() == 0:
        fleet.init_server(args.resume.split(",") if args.resume else None)
    if fleet.is_server():
        fleet.run_server()
        return

    fleet.init_worker()
    rank, workers = fleet.worker_index(), fleet.worker_num()
    say = (lambda s: print(s, flush=True)) if rank == 0 else (lambda s: None)
    say(f"MovieLens-100k: {workers} worker(s), {fleet.server_num()} server(s); "
        f"{len(train)} training ratings in {args.passes} passes, {len(held_out)} held out")
    for p, part in enumerate(train.slices(args.passes) if args.passes else []):
        loss_sum, n = train_pass(model, opt, part.shard(rank, workers), args.batch)
        totals = metrics.sum(np.array([loss_sum, n]))
        shrunk = fleet.shrink()
        if rank == 0:
            ids = shrunk["ids"]
            say(f"pass {p + 1}/{args.passes}: loss {totals[0] / totals[1]:.4f}; shrink evicted "
                f"{ids['removed']} id rows, forgot {ids['forgotten']} pending ids; "
                f"{ids['rows']} id rows left")
            fleet.print_table_stat()
        if args.save:
            fleet.save_persistables(str(Path(args.save, f"pass-{p}")), mode=1 if p == 0 else 2)
    auc = evaluate(model, held_out.shard(rank, workers))
    say(f"held-out AUC {auc:.4f}")
    fleet.stop_worker()
    if auc < args.target:
        raise SystemExit(f"held-out AUC {auc:.4f} is below the target {args.target}")


if __name__ == "__main__":
    main()
