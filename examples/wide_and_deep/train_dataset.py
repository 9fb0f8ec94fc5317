"""Wide&deep on the Adult data fed by an InMemoryDataset and a data generator, as in Paddle's
``wide_and_deep_dataset`` example.

    fleetrun --server_num 2 --worker_num 2 examples/wide_and_deep/train_dataset.py --mode sync
    python examples/wide_and_deep/train_dataset.py                  # one process, no servers

The raw Adult rows are text files (``adult_files.py`` writes them into ``--data`` when they are
missing). Each worker takes its share of the files (``fleet.util.get_file_shard``) and loads it
into an ``InMemoryDataset``: ``--threads`` readers pipe every file through the data generator
``reader.py`` (``pipe_command="python reader.py features.json"``), which turns rows into slot
text. ``global_shuffle(fleet)`` then exchanges samples between the workers, so that each trains
on a uniform sample of all files; each epoch shuffles locally and iterates batches of tensors:
``batch["wide"]``, ``batch["deep"]``, ``batch["dense"]``, ``batch["label"]``. The model and the
training settings are ``train.py``'s; so is the held-out AUC, computed on the held-out files.

After a global shuffle workers hold slightly different numbers of samples; every worker runs
the same number of steps per epoch (the smallest count), which sync mode needs.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import adult_files  # noqa: E402  (the example's own modules, beside this file)
from model import WideAndDeep  # noqa: E402
from train import strategy_for  # noqa: E402

from fleetx import fleet, metrics  # noqa: E402
from fleetx.data import Slot  # noqa: E402

SLOTS = [Slot("dense", "float32", dense_width=6), Slot("wide", "int64", dense_width=12),
         Slot("deep", "int64", dense_width=8), Slot("label", "int64", dense_width=1)]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default="/tmp/fleetx_adult", help="the raw files' folder")
    ap.add_argument("--files", type=int, default=8, help="files per split, when writing them")
    ap.add_argument("--threads", type=int, default=2, help="readers per worker (thread_num)")
    ap.add_argument("--mode", choices=("sync", "async", "geo"), default="async")
    ap.add_argument("--k-steps", type=int, default=20, help="GEO: local steps between exchanges")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--batch", type=int, default=128, help="per worker")
    ap.add_argument("--lr", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=0, help="model, split and shuffles")
    ap.add_argument("--limit", type=int, default=0, help="training rows to write (tests)")
    ap.add_argument("--target", type=float, default=0.0,
                    help="exit with an error if the final held-out AUC is below this")
    return ap.parse_args()


def dataset_of(files: list, args: argparse.Namespace, batch: int):
    """An InMemoryDataset over this worker's share of ``files``, read through reader.py."""
    dataset = fleet.DatasetFactory().create_dataset("InMemoryDataset")
    features = Path(args.data) / "features.json"
    dataset.init(batch_size=batch, thread_num=args.threads, use_var=SLOTS,
                 pipe_command=f"{sys.executable} {HERE / 'reader.py'} {features}")
    dataset.set_filelist(fleet.util.get_file_shard(files))
    return dataset


def forward(model, batch: dict) -> torch.Tensor:
    return model(batch["wide"], batch["deep"], batch["dense"])


def train_epoch(model, opt, dataset, steps: int) -> tuple:
    """``steps`` batches of ``dataset``; returns (loss sum, samples)."""
    model.train()
    loss_sum, seen = 0.0, 0
    for _, batch in zip(range(steps), dataset):
        label = batch["label"].squeeze(1).float()
        loss = F.binary_cross_entropy_with_logits(forward(model, batch), label)
        opt.minimize(loss)
        loss_sum, seen = loss_sum + float(loss.detach()) * len(label), seen + len(label)
    return loss_sum, seen


@torch.no_grad()
def evaluate(model, dataset) -> metrics.AUC:
    """This worker's AUC histograms on its held-out files (forward only)."""
    model.eval()
    auc = metrics.AUC()
    for batch in dataset:
        auc.update(torch.sigmoid(forward(model, batch)), batch["label"].squeeze(1).numpy())
    return auc


def load(args: argparse.Namespace, say) -> tuple:
    """Both datasets, loaded; the training one globally shuffled. Returns them and the seconds
    the loading took."""
    root = Path(args.data)
    train = dataset_of(sorted(str(p) for p in (root / "train").glob("part-*")), args, args.batch)
    held_out = dataset_of(sorted(str(p) for p in (root / "test").glob("part-*")), args, 4096)
    t0 = time.perf_counter()
    train.load_into_memory()
    held_out.load_into_memory()
    train.global_shuffle(fleet, seed=args.seed)
    seconds = time.perf_counter() - t0
    say(f"loaded {train.get_memory_data_size(fleet)} training and "
        f"{held_out.get_memory_data_size(fleet)} held-out samples in {seconds:.1f} s")
    return train, held_out, seconds


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    fleet.init()
    features = adult_files.ensure(args.data, args.files, args.seed, args.limit)
    torch.manual_seed(args.seed)  # every role builds the same model
    vocabulary = sum(len(v) for v in features["vocabulary"].values())
    model = fleet.distributed_model(WideAndDeep(vocabulary))
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=args.lr),
                                      strategy_for(args.mode, args.k_steps))
    if fleet.is_server() or fleet.server_num() == 0:
        fleet.init_server()
    if fleet.is_server():
        fleet.run_server()
        return
    fleet.init_worker()
    rank, workers = fleet.worker_index(), fleet.worker_num()
    say = (lambda s: print(s, flush=True)) if rank == 0 else (lambda s: None)
    train, held_out, load_s = load(args, say)
    say(f"wide&deep from a dataset, {args.mode} mode: {workers} workers, "
        f"{fleet.server_num()} servers")
    # the same number of steps on every worker (sync rounds need it): the smallest share's
    steps = int(fleet.util.all_reduce(-(-len(train) // args.batch), "min"))
    auc, train_s = 0.5, 0.0
    for epoch in range(args.epochs):
        train.local_shuffle(seed=args.seed * 1000 + epoch * 10 + rank)
        t0 = time.perf_counter()
        loss_sum, seen = train_epoch(model, opt, train, steps)
        seconds = time.perf_counter() - t0
        train_s += seconds
        totals = metrics.sum(np.array([loss_sum, seen, seen / seconds]))
        auc = evaluate(model, held_out).global_auc()
        say(f"epoch {epoch + 1}/{args.epochs}: loss {totals[0] / totals[1]:.4f}, "
            f"{totals[2]:.0f} samples/s, held-out AUC {auc:.4f}")
    say(f"time: load {load_s:.2f} s, train {train_s:.2f} s")
    fleet.stop_worker()
    if auc < args.target:
        raise SystemExit(f"held-out AUC {auc:.4f} is below the target {args.target}")


if __name__ == "__main__":
    main()
