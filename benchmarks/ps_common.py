"""The CTR workload of the parameter-server benchmarks: data, model, training loop, aggregation.

Workload (the project's baseline 4b, after PaddleRec's wide_deep):

* data: Criteo-format lines (``examples/wide_and_deep/gen_criteo.py``); 13 integer features
  become ``log1p(x) / 10`` (missing: 0); each of the 26 categorical tokens becomes
  ``crc32("<slot>:<token>") mod 1,000,001``, an id of one shared table;
* model: the 26 rows of dim 16 and the 13 dense features, concatenated, through
  fc 400-400-400 (ReLU) to one logit; plus a wide part fc(dense -> 1); sigmoid; log loss;
* SGD lr 0.05, batch 512 per worker; Xavier-uniform weights and zero biases (Paddle's ``fc``
  defaults), table rows uniform in [-0.01, 0.01].

Timing follows the baseline: data are parsed into arrays before training (``load_s``, not
timed with the epochs); an epoch's time runs from its first step to its last; the job's
samples/s for an epoch is all workers' samples over the slowest worker's epoch time, and the
figure reported is the median over epochs 2.. (epoch 1 creates the table rows).
"""
from __future__ import annotations

import glob
import os
import statistics
import time
import zlib
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import numpy as np
import torch
from torch import nn

from fleetx.metrics import AUC

HASH_ROWS = 1_000_001
SLOTS, DENSE, EMB_DIM = 26, 13, 16
HIDDEN = (400, 400, 400)
LR, BATCH = 0.05, 512


@dataclass
class CTRData:
    """Parsed lines: ``ids`` int64 [n, 26], ``dense`` float32 [n, 13], ``label`` float32 [n]."""

    ids: np.ndarray
    dense: np.ndarray
    label: np.ndarray

    def __len__(self) -> int:
        return len(self.label)

    def batches(self, size: int):
        """``(ids, dense, label)`` tensors of consecutive rows (the last batch may be short)."""
        for lo in range(0, len(self), size):
            yield (torch.from_numpy(self.ids[lo:lo + size]),
                   torch.from_numpy(self.dense[lo:lo + size]),
                   torch.from_numpy(self.label[lo:lo + size]))


def data_files(folder: str) -> list[str]:
    """The ``part-*`` files of ``folder``, sorted (every worker sees the same list)."""
    files = sorted(glob.glob(os.path.join(folder, "part-*")))
    if not files:
        raise FileNotFoundError(f"no part-* files in {folder}; generate them with: python "
                                f"examples/wide_and_deep/gen_criteo.py --out {folder}")
    return files


def _slot_ids(slot: int, tokens: list) -> np.ndarray:
    """Hash one slot's tokens: each distinct token once (np.unique), then map back."""
    uniq, inverse = np.unique(np.asarray(tokens), return_inverse=True)
    hashed = np.fromiter((zlib.crc32(b"%d:%s" % (slot, t.encode())) % HASH_ROWS for t in uniq),
                         dtype=np.int64, count=len(uniq))
    return hashed[inverse]


def read_criteo(files: list[str]) -> CTRData:
    """Parse Criteo-format files (``label \\t I1..I13 \\t C1..C26``), skipping malformed lines."""
    rows = []
    for path in files:
        with open(path) as f:
            rows.extend(r for r in (line.rstrip("\n").split("\t") for line in f) if len(r) == 40)
    if not rows:
        return CTRData(np.zeros((0, SLOTS), np.int64), np.zeros((0, DENSE), np.float32),
                       np.zeros(0, np.float32))
    columns = list(zip(*rows))
    label = np.asarray(columns[0], dtype=np.float32)
    counts = np.array([[int(x) if x else 0 for x in columns[1 + k]] for k in range(DENSE)],
                      dtype=np.float64).T
    dense = (np.log1p(counts) / 10).astype(np.float32)
    ids = np.stack([_slot_ids(j, columns[14 + j]) for j in range(SLOTS)], axis=1)
    return CTRData(np.ascontiguousarray(ids), np.ascontiguousarray(dense), label)


class CTRModel(nn.Module):
    """Wide & deep CTR model over one shared embedding table; ``forward`` returns logits.

    Args:
        embedding: maps ids [B, 26] to rows [B, 26, 16] (``nn.Embedding(sparse=True)`` or
            ``fleetx.nn.SparseEmbedding``).
    """

    def __init__(self, embedding: nn.Module) -> None:
        super().__init__()
        self.embedding = embedding
        layers, width = [], SLOTS * EMB_DIM + DENSE
        for h in HIDDEN:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        self.deep = nn.Sequential(*layers, nn.Linear(width, 1))
        self.wide = nn.Linear(DENSE, 1)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, ids: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        rows = self.embedding(ids).flatten(1)
        return (self.deep(torch.cat([rows, dense], dim=1)) + self.wide(dense)).squeeze(1)


def local_embedding() -> nn.Embedding:
    """The plain-PyTorch table: all 1,000,001 rows in this process, sparse gradients."""
    emb = nn.Embedding(HASH_ROWS, EMB_DIM, sparse=True)
    nn.init.uniform_(emb.weight, -0.01, 0.01)
    return emb


@dataclass
class EpochLog:
    """One worker's epochs: seconds, samples, and the AUC histograms of its predictions."""

    seconds: list = field(default_factory=list)
    samples: list = field(default_factory=list)
    losses: list = field(default_factory=list)
    stats: list = field(default_factory=list)        # per epoch: (stat_pos, stat_neg)


def train_epochs(model: nn.Module, step: Callable[[torch.Tensor], None], data: CTRData,
                 epochs: int, batch: int,
                 progress: Optional[Callable[[str], None]] = None,
                 on_epoch: Optional[Callable[[int], None]] = None,
                 loader: Callable[[Iterable], Iterable] = lambda batches: batches) -> EpochLog:
    """Run ``epochs`` passes over ``data``; ``step(loss)`` updates the model;
    ``on_epoch(epoch)`` runs after each epoch, outside its timed span (counters read there);
    ``loader`` wraps each epoch's batches (``fleet.prefetch``).

    Predictions are scored before their batch's update (progressive validation), so each
    epoch's AUC is an honest estimate even without a held-out set.
    """
    log = EpochLog()
    loss_fn = nn.BCEWithLogitsLoss()
    last_print = time.perf_counter()
    for epoch in range(epochs):
        auc = AUC()
        losses, t0 = [], time.perf_counter()
        for ids, dense, label in loader(data.batches(batch)):
            logits = model(ids, dense)
            loss = loss_fn(logits, label)
            step(loss)
            auc.update(torch.sigmoid(logits.detach()), label)
            losses.append(float(loss.detach()))
            now = time.perf_counter()
            if progress and now - last_print >= 5.0:
                done = auc.count
                progress(f"epoch {epoch + 1}: {done} samples, {done / (now - t0):.0f} samples/s, "
                         f"loss {np.mean(losses[-20:]):.4f}")
                last_print = now
        log.seconds.append(time.perf_counter() - t0)
        log.samples.append(len(data))
        log.losses.append(float(np.mean(losses)) if losses else float("nan"))
        log.stats.append((auc.stat_pos.copy(), auc.stat_neg.copy()))
        if on_epoch:
            on_epoch(epoch)
    return log


def aggregate(rows: list[dict]) -> dict:
    """Job figures from the workers' records (each with ``samples`` and ``epoch_s``)."""
    samples = sum(r["samples"] for r in rows)
    epochs = min(len(r["epoch_s"]) for r in rows)
    per_epoch = [samples / max(r["epoch_s"][e] for r in rows) for e in range(epochs)]
    return {"samples_per_epoch": samples,
            "load_s_max": round(max(r["load_s"] for r in rows), 2),
            "epoch_samples_per_s": [round(x) for x in per_epoch],
            "warm_samples_per_s": round(statistics.median(per_epoch[1:] or per_epoch))}
