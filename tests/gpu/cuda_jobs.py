"""What the GPU tests share (no tests here): the marks, a small CUDA model, and the two-rank
NCCL job.

NCCL refuses two ranks of one communicator on the same GPU ("Duplicate GPU detected"), so a
test of two ranks over NCCL runs only where at least two GPUs are visible, one per rank
(``fleet.init`` gives rank r GPU ``LOCAL_RANK % device_count``); elsewhere it skips, naming how
many GPUs it found. On one GPU the same code paths run in one process (NCCL picked, the model
and every tensor on ``cuda:0``), without a collective to run.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from spawn import run  # noqa: E402  (tests/distributed/spawn.py)

#: Every GPU test carries both: the ``gpu`` marker (selected by ``-m gpu``) and the skip.
needs_cuda = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def needs_gpus(n: int) -> pytest.MarkDecorator:
    """The skip of a test of ``n`` ranks over NCCL, one GPU each, where fewer are visible (the
    module's ``needs_cuda`` marks it ``gpu``)."""
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return pytest.mark.skipif(found < n, reason=f"needs {n} CUDA GPUs (one per NCCL rank), "
                                                f"found {found}")


def mlp(seed: int = 0) -> nn.Sequential:
    """A small MLP (float32, on the CPU; the caller moves it)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 48), nn.ReLU(), nn.Linear(48, 48), nn.ReLU(),
                         nn.Linear(48, 4))


def batches(n: int, rows: int, seed: int = 1) -> list:
    """``n`` regression batches ``(x, y)`` of ``rows`` rows on the CPU."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, 12, generator=g), torch.randn(rows, 4, generator=g))
            for _ in range(n)]


def state_diff(a: dict, b: dict) -> float:
    """The largest absolute difference between two state dicts (compared on the CPU)."""
    assert a.keys() == b.keys()
    return max((a[k].detach().float().cpu() - b[k].detach().float().cpu()).abs().max().item()
               for k in a)


def run_two_ranks(fn: Callable, out: str, deadline: float = 120.0) -> None:
    """``fn(rank, 2, out)`` on two spawned processes over NCCL (mark the test
    ``needs_gpus(2)``); a rank still running after ``deadline`` seconds fails the test."""
    run(fn, 2, out, deadline=deadline)
