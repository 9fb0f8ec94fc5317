"""Helpers for parameter-server tests: a tiny CTR model in numpy, its data, and process control.

Processes started here import numpy and fleetx.ps only (no torch), so each starts in a fraction
of a second. The model: ``SLOTS`` sparse slots looked up in one table ``emb`` (dim ``DIM``),
concatenated with ``NDENSE`` dense features, then a logistic unit with weights and bias in the
dense table ``dense``; loss = mean binary cross-entropy over the local batch.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("ps_worker.py")
SLOTS, DIM, NDENSE = 3, 4, 2
NUMEL = SLOTS * DIM + NDENSE + 1
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import free_ports  # noqa: E402,F401  (tests/helpers.py; the PS tests take it from here)

VOCAB = np.array([-5, 0, 1, 7, 42, 10 ** 12, 2 ** 62, -(2 ** 40), 99, 1234567], np.int64)


def batch(step: int, size: int = 16):
    """The union batch of a step: ids (size, SLOTS) drawn from VOCAB with repeats, dense
    features (size, NDENSE), labels (size,)."""
    rng = np.random.default_rng(1000 + step)
    ids = VOCAB[rng.integers(0, len(VOCAB), (size, SLOTS))]
    x = rng.standard_normal((size, NDENSE)).astype(np.float32)
    y = (rng.random(size) < 0.4).astype(np.float32)
    return ids, x, y


def initial_dense() -> np.ndarray:
    return (np.random.default_rng(7).standard_normal(NUMEL) * 0.3).astype(np.float32)


def forward_backward(rows: np.ndarray, x: np.ndarray, y: np.ndarray, w: np.ndarray):
    """rows: (B, SLOTS, DIM) looked-up embeddings. Returns loss, d rows, d w."""
    b = len(y)
    feats = np.concatenate([rows.reshape(b, -1), x], axis=1)
    z = feats @ w[:-1] + w[-1]
    p = 1.0 / (1.0 + np.exp(-z))
    loss = float(np.mean(-(y * np.log(p) + (1 - y) * np.log(1 - p))))
    dz = ((p - y) / b).astype(np.float32)
    dw = np.concatenate([feats.T @ dz, [dz.sum()]]).astype(np.float32)
    drows = (dz[:, None] * w[None, :SLOTS * DIM]).reshape(b, SLOTS, DIM).astype(np.float32)
    return loss, drows, dw


def write_cluster(path: Path, config: dict, tables_json: str) -> Path:
    path.write_text(json.dumps({"config": config, "tables": json.loads(tables_json)}))
    return path


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return env


def start_server(cluster: Path, index: int, load: str | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "fleetx.ps", "serve", "--cluster", str(cluster),
           "--index", str(index)] + (["--load", load] if load else [])
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=_env(), cwd=ROOT)
    line = p.stdout.readline()
    if not line.startswith("listening"):
        p.kill()
        raise RuntimeError(f"server {index} did not start: {line}{p.stderr.read()}")
    return p


def start_worker(cluster: Path, rank: int, out: Path, *args: str) -> subprocess.Popen:
    cmd = [sys.executable, str(WORKER), "--cluster", str(cluster), "--rank", str(rank),
           "--out", str(out), *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(), cwd=ROOT)


def finish(procs, timeout: float = 60.0) -> list[tuple[int, str]]:
    """Wait for every process; returns (returncode, stderr) each, killing stragglers."""
    deadline, out = time.monotonic() + timeout, []
    for p in procs:
        try:
            _, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
            err = "TIMEOUT\n" + err
        out.append((p.returncode, err))
    return out
