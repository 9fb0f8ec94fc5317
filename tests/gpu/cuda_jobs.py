"""What the GPU tests share (no tests here): the marks, a small CUDA model, and the two-rank
NCCL job that one GPU cannot always host.

NCCL refuses two ranks of one communicator on the same GPU ("Duplicate GPU detected"), so the
multi-rank cases run for real only where at least two GPUs are visible, or where NCCL accepts
the pair; on a one-GPU machine whose NCCL refuses they skip, quoting NCCL's reason.
"""
from __future__ import annotations

import re
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

# What NCCL (through torch) says when two ranks of one communicator share a GPU.
_REFUSAL = re.compile(r"duplicate gpu|ncclInvalidUsage|invalid usage", re.IGNORECASE)


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
    """``fn(rank, 2, out)`` on two spawned processes (NCCL: each one picks GPU
    ``LOCAL_RANK % device_count``). With one GPU, a refusal by NCCL skips the test."""
    try:
        run(fn, 2, out, deadline=deadline)
    except Exception as err:  # noqa: BLE001  (mp's ProcessRaisedException carries the text)
        text = str(err)
        if torch.cuda.device_count() < 2 and _REFUSAL.search(text):
            line = next((ln.strip() for ln in text.splitlines() if _REFUSAL.search(ln)), "")
            pytest.skip(f"needs 2 GPUs: NCCL refused two ranks on one GPU ({line[:200]})")
        raise
