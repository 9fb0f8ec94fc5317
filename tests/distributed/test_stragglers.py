"""The straggler exchange on 3 processes (spawn): rank 1 sleeps 40 ms more than the others
before each forward; with a window of 5 steps rank 0 names it in every window with a ratio of
at least 1.5, and names no other rank; the others log nothing."""
from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spawn import run_and_load  # noqa: E402

WINDOW, STEPS = 5, 15


def _worker(rank: int, world: int, out: str) -> None:
    import os
    os.environ["FLEETX_STRAGGLER_WINDOW"] = str(WINDOW)
    from fleetx import fleet
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("fleetx").addHandler(handler)
    fleet.init(is_collective=True)
    model = fleet.distributed_model(torch.nn.Linear(8, 2))
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.01))
    x = torch.randn(4, 8)
    for _ in range(STEPS):
        time.sleep(0.005 + (0.04 if rank == 1 else 0.0))
        opt.minimize(model(x).pow(2).mean())
    torch.save(lines, f"{out}/rank{rank}.pt")


def test_the_slow_rank_is_named_by_rank_0_in_every_window(tmp_path):
    import re
    ranks = run_and_load(_worker, 3, tmp_path, deadline=120)
    named = [re.search(r"rank (\d) is a straggler: busy ([0-9.e-]+) s per step, ([0-9.]+)x the "
                       r"median of the others \(.*; window steps (\d+)-(\d+)\)", line)
             for line in ranks[0]]
    assert all(named) and len(named) == STEPS // WINDOW, ranks[0]
    assert [(m[1], m[4], m[5]) for m in named] == [("1", "0", "5"), ("1", "5", "10"),
                                                   ("1", "10", "15")]
    assert all(float(m[3]) >= 1.5 and float(m[2]) >= 0.04 for m in named)
    assert ranks[1] == [] and ranks[2] == []
