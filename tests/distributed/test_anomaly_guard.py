"""The anomaly guard on 2 processes, with real bad batches (one spawn runs every case):

* a NaN batch on one rank and a loss-spike batch on the other are skipped on both ranks: the
  parameters equal (bit for bit) a run that never saw those batches; the count and the log
  lines (step, rank, batch) are right;
* three bad batches in a row roll back to the in-memory snapshot, and to the last checkpoint of
  ``fleet.auto_checkpoint``; training goes on and ends where a run without the rolled-back
  batches ends;
* with amp and gradient merge a NaN micro-batch skips its whole update (counted once; the loss
  scale does not move), and an inf gradient is amp's skip, not counted by the guard.
"""
from __future__ import annotations

import logging
import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spawn import run_and_load  # noqa: E402

WORLD, B, N = 2, 4, 12


def batches():
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(WORLD * B, 6, generator=g), torch.randn(WORLD * B, 2, generator=g))
            for _ in range(N)]


def nan_on(x, y, rank):
    x = x.clone()
    x[rank * B, 0] = math.nan
    return x, y


def spike_on(x, y, rank):
    y = y.clone()
    y[rank * B:(rank + 1) * B] *= 1e3
    return x, y


def _fleet(guard, configs=None, **switches):
    from fleetx import fleet
    s = fleet.DistributedStrategy()
    s.anomaly_guard = guard
    if configs:
        s.anomaly_guard_configs = configs
    for key, value in switches.items():
        setattr(s, key, value)
    fleet.init(is_collective=True, strategy=s)
    return fleet


def _train(fleet, rank, data, k=1, ckpt=None, inf_at=()):
    torch.manual_seed(1)
    model = fleet.distributed_model(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2)))
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    if ckpt is not None:
        fleet.auto_checkpoint(ckpt, every_steps=4)
    scales = []
    for i, (x, y) in enumerate(data):
        sl = slice(rank * B, (rank + 1) * B)
        xs, ys = x[sl].chunk(k), y[sl].chunk(k)
        for micro in range(k):
            opt.backward(nn.functional.mse_loss(model(xs[micro]), ys[micro]))
            if micro == k - 1 and i in inf_at and rank == 0:  # an overflow amp must catch
                model.module[0].weight.grad[0, 0] = math.inf
            opt.step()
            opt.zero_grad()
        if hasattr(opt, "get_loss_scaling"):
            scales.append(float(opt.get_loss_scaling()))
    anomalies = opt.anomalies() if fleet._fleet._strategy.anomaly_guard else None
    return {"state": {k: v.clone() for k, v in model.state_dict().items()},
            "anomalies": anomalies, "scales": scales, "steps": fleet._fleet._steps_taken}


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _worker(rank: int, world: int, out: str) -> None:
    lines = _Lines()
    logging.getLogger("fleetx").addHandler(lines)
    data = batches()
    res = {}
    # 1. a NaN batch (rank 1) and a spike (rank 0) are skipped
    bad = list(data)
    bad[3] = nan_on(*bad[3], rank=1)
    bad[6] = spike_on(*bad[6], rank=0)
    res["skip"] = _train(_fleet(True), rank, bad)
    res["skip_ref"] = _train(_fleet(False), rank,
                             [d for i, d in enumerate(data) if i not in (3, 6)])
    res["skip_lines"], lines.lines = lines.lines, []
    # 2. three in a row roll back (memory, then disk) to the state after 4 updates
    bad = list(data)
    for i, r in ((6, 0), (7, 1), (8, 0)):
        bad[i] = nan_on(*bad[i], rank=r)
    roll = {"max_consecutive": 3, "snapshot_every": 4}
    res["memory"] = _train(_fleet(True, roll), rank, bad)
    res["memory_lines"], lines.lines = lines.lines, []
    res["disk"] = _train(_fleet(True, dict(roll, rollback="disk")), rank, bad,
                         ckpt=f"{out}/ckpt")
    res["disk_lines"], lines.lines = lines.lines, []
    res["roll_ref"] = _train(_fleet(False), rank, data[:4] + data[9:])
    # 3. amp + gradient merge: a NaN micro-batch (update 2) skips the update; an inf gradient
    # (update 5) is amp's
    amp = {"amp": True, "amp_configs": {"init_loss_scaling": 64.0, "decr_every_n_nan_or_inf": 1,
                                        "decr_ratio": 0.5},
           "gradient_merge": True, "gradient_merge_configs": {"k_steps": 2}}
    bad = list(data)
    x, y = bad[2]
    x = x.clone()
    x[1 * B + B // 2 + 1, 0] = math.nan  # rank 1's 2nd micro-batch
    bad[2] = (x, y)
    res["amp"] = _train(_fleet(True, **amp), rank, bad, k=2, inf_at=(5,))
    res["amp_ref"] = _train(_fleet(False, **amp), rank, data[:2] + data[3:], k=2, inf_at=(4,))
    res["amp_lines"] = lines.lines
    torch.save(res, f"{out}/rank{rank}.pt")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_and_load(_worker, WORLD, tmp_path_factory.mktemp("guard"), deadline=240)


def _equal(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


def test_nan_and_spike_batches_are_skipped_on_every_rank(ranks):
    for r in ranks:
        assert _equal(r["skip"]["state"], r["skip_ref"]["state"])
        assert r["skip"]["anomalies"] == {"skipped": 2, "rollbacks": 0, "consecutive": 0}
        assert r["skip"]["steps"] == N - 2
        lines = r["skip_lines"]
        assert len(lines) == 2, lines
        assert "skipped step 3 (rank 1, batch 3): the loss is NaN or inf" in lines[0]
        assert "skipped step 6 (rank 0): the loss" in lines[1] and "x the median" in lines[1]
        assert "2 step(s) skipped so far, 1 in a row (rollback after 3)" in lines[1]
    assert _equal(ranks[0]["skip"]["state"], ranks[1]["skip"]["state"])


@pytest.mark.parametrize("where", ["memory", "disk"])
def test_a_run_of_bad_batches_rolls_back_and_training_goes_on(ranks, where):
    for r in ranks:
        assert _equal(r[where]["state"], r["roll_ref"]["state"]), where
        assert r[where]["anomalies"] == {"skipped": 3, "rollbacks": 1, "consecutive": 0}
        lines = r[f"{where}_lines"]
        assert len(lines) == 4, lines
        assert "skipped step 8 (rank 0, batch 8)" in lines[2] and "rolling back" in lines[2]
        to = ("the in-memory snapshot taken after 4 accepted step(s)" if where == "memory"
              else "the checkpoint of step 4")
        assert f"3 step(s) skipped in a row; rolled back to {to}" in lines[3], lines[3]
    # the disk rollback loaded the checkpoint's step count: 4, then 3 more updates
    assert ranks[0]["disk"]["steps"] == 7


def test_amp_and_gradient_merge_skip_whole_updates_without_double_counting(ranks):
    for r in ranks:
        amp, ref = r["amp"], r["amp_ref"]
        assert _equal(amp["state"], ref["state"])
        assert amp["anomalies"]["skipped"] == 1  # the NaN micro-batch; amp's overflow is not
        assert "skipped step 2 (rank 1, batch 5)" in r["amp_lines"][0], r["amp_lines"]
        # amp never saw the skipped update (its scale did not move there) and shrank once
        # for the inf gradient
        assert amp["scales"][2] == amp["scales"][1] == 64.0
        assert amp["scales"][5] == 32.0
