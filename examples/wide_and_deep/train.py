"""Train wide&deep on the Adult census data with the parameter server, in any of its modes.

    fleetrun --server_num 2 --worker_num 2 examples/wide_and_deep/train.py --mode async
    fleetrun --server_num 2 --worker_num 2 examples/wide_and_deep/train.py --mode sync
    fleetrun --server_num 2 --worker_num 2 examples/wide_and_deep/train.py --mode geo

Every process runs this script: servers serve the two embedding tables and the MLP's weights;
workers train on their shard of the training split. Worker 0 prints samples/s and the loss every
few seconds and, after each epoch, the AUC on the held-out split: every worker scores its share
and ``fleetx.metrics.auc`` sums their histograms, so the figure covers the whole split.

``--save DIR`` saves the model after training; ``--resume DIR`` starts from such a folder, in any
mode and with any number of servers, or in one process without any (``--epochs 0``: evaluate
it only).

``--infer`` scores the held-out split in inference mode (``fleet.utils.DistributedInfer``,
docs/ps_inference.md): after training, the workers turn to inference in the same job (the tables
stop changing: what they score is what ``--save`` writes); with ``--epochs 0 --resume DIR`` the
job is inference-only, its servers serving the save read-only. Both print ``inference AUC``.

    fleetrun --server_num 2 --worker_num 2 train.py --infer --save model
    fleetrun --server_num 2 --worker_num 2 train.py --infer --epochs 0 --resume model

``--heter`` wraps the MLP in ``fleetx.nn.HeterSection`` (docs/heter.md): launched with heter
workers, the trainers look the embeddings up and a heter worker runs the MLP, on its GPU when it
has one (``heter_worker_device_guard="gpu"``; else on its CPU, as its log says):

    fleetrun --server_num 1 --worker_num 2 --heter_worker_num 1 train.py --heter --mode async
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import data  # noqa: E402  (the example's own modules, beside this file)
from model import WideAndDeep  # noqa: E402

from fleetx import fleet, metrics  # noqa: E402
from fleetx.nn import HeterSection  # noqa: E402


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=("sync", "async", "geo"), default="async")
    ap.add_argument("--k-steps", type=int, default=20, help="GEO: local steps between exchanges")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--batch", type=int, default=128, help="per worker")
    ap.add_argument("--lr", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=0, help="model initialisation and data split")
    ap.add_argument("--limit", type=int, default=0, help="train on this many rows only (tests)")
    ap.add_argument("--target", type=float, default=0.0,
                    help="exit with an error if the final held-out AUC is below this")
    ap.add_argument("--save", default=None, help="save the model here after training")
    ap.add_argument("--resume", default=None, help="start from a folder --save wrote")
    ap.add_argument("--heter", action="store_true",
                    help="the MLP is a HeterSection: heter workers run it (--heter_worker_num)")
    ap.add_argument("--infer", action="store_true",
                    help="score in inference mode: after training, or (--epochs 0) from --resume")
    args = ap.parse_args()
    if args.infer and args.epochs == 0 and not args.resume:
        ap.error("--infer --epochs 0 is an inference-only job: give the save with --resume DIR")
    return args


def strategy_for(mode: str, k_steps: int, heter: bool = False) -> fleet.DistributedStrategy:
    strategy = fleet.DistributedStrategy()
    strategy.a_sync = mode != "sync"
    if mode == "geo":
        strategy.a_sync_configs = {"k_steps": k_steps}
    if heter:  # a heter worker without a GPU runs the MLP on its CPU, and says so
        strategy.a_sync_configs = {"heter_worker_device_guard": "gpu"}
    return strategy


def tensors(split: data.Split, rows) -> tuple:
    return (torch.from_numpy(split.wide[rows]), torch.from_numpy(split.deep[rows]),
            torch.from_numpy(split.dense[rows]))


def train_epoch(model, opt, split: data.Split, batch: int, seed: int, say) -> tuple:
    """One pass over this worker's shard in a seeded order; returns (loss sum, samples)."""
    model.train()
    order = np.random.default_rng(seed).permutation(len(split))
    loss_sum, seen, t0, last = 0.0, 0, time.perf_counter(), time.perf_counter()
    for lo in range(0, len(order), batch):
        rows = order[lo:lo + batch]
        loss = F.binary_cross_entropy_with_logits(model(*tensors(split, rows)),
                                                  torch.from_numpy(split.label[rows]))
        opt.minimize(loss)
        loss_sum, seen = loss_sum + float(loss.detach()) * len(rows), seen + len(rows)
        if time.perf_counter() - last >= 3.0:
            last = time.perf_counter()
            say(f"  {seen}/{len(split)} samples, {seen / (last - t0):.0f} samples/s, "
                f"loss {loss_sum / seen:.4f}")
    return loss_sum, seen


@torch.no_grad()
def evaluate(model, split: data.Split) -> metrics.AUC:
    """This worker's AUC histograms on its share of the held-out split (forward only)."""
    model.eval()
    auc = metrics.AUC()
    for lo in range(0, len(split), 4096):
        rows = np.arange(lo, min(lo + 4096, len(split)))
        auc.update(torch.sigmoid(model(*tensors(split, rows))), split.label[rows])
    return auc


def join(args, infer) -> bool:
    """Take this process's part in the job; False on a server, once it has served."""
    if args.infer and args.epochs == 0:
        # an inference-only job: servers serve the save read-only here until the workers stop
        infer.init_distributed_infer_env(dirname=args.resume)
        return not fleet.is_server()
    if fleet.is_server() or fleet.server_num() == 0:
        # Servers load the tables they hold; one process without servers (plain python) holds
        # them all itself, so it loads them too.
        fleet.init_server(args.resume)
    if fleet.is_server():
        fleet.run_server()
        return False
    fleet.init_worker()
    return True


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    fleet.init()
    train, held_out, vocabulary = data.load(args.seed)
    torch.manual_seed(args.seed)  # every role builds the same model
    net = WideAndDeep(vocabulary)
    if args.heter:
        net.mlp = HeterSection(net.mlp)
    model = fleet.distributed_model(net)
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=args.lr),
                                      strategy_for(args.mode, args.k_steps, args.heter))
    infer = fleet.utils.DistributedInfer(model)
    if not join(args, infer):
        return  # a server: it served until every worker stopped
    rank, workers = fleet.worker_index(), fleet.worker_num()
    say = (lambda s: print(s, flush=True)) if rank == 0 else (lambda s: None)
    if args.resume and fleet.server_num():
        say(f"loaded from {Path(args.resume).resolve()} (by the {fleet.server_num()} "
            f"server(s))")
    if args.limit:
        train = train.head(args.limit)
    mine, my_test = train.shard(rank, workers), held_out.shard(rank, workers)
    say(f"wide&deep, {args.mode} mode: {workers} workers, {fleet.server_num()} servers; "
        f"{len(train)} training rows, {len(held_out)} held out")
    auc = evaluate(model, my_test).global_auc() if args.epochs == 0 and not args.infer else 0.5
    if args.epochs == 0 and not args.infer:
        say(f"held-out AUC {auc:.4f}")
    for epoch in range(args.epochs):
        t0 = time.perf_counter()
        loss_sum, seen = train_epoch(model, opt, mine, args.batch, args.seed * 1000 + epoch * 10
                                     + rank, say)
        seconds = time.perf_counter() - t0
        totals = metrics.sum(np.array([loss_sum, seen, seen / seconds]))  # loss, samples, rate
        auc = evaluate(model, my_test).global_auc()
        say(f"epoch {epoch + 1}/{args.epochs}: loss {totals[0] / totals[1]:.4f}, "
            f"{totals[2]:.0f} samples/s, held-out AUC {auc:.4f}")
    if args.infer and args.epochs:
        infer.init_distributed_infer_env()  # send what is queued, meet the others: tables freeze
    if args.save:
        fleet.save_persistables(args.save)  # worker 0 asks every server: "saved to <path>"
    if args.infer:  # every worker scores its shard; the AUC histograms are summed
        auc = evaluate(infer.get_dist_infer_program(), my_test).global_auc()
        say(f"inference AUC {auc!r} ({len(held_out)} held-out rows, {workers} workers)")
    fleet.stop_worker()
    if auc < args.target:
        raise SystemExit(f"held-out AUC {auc:.4f} is below the target {args.target}")


if __name__ == "__main__":
    main()
