"""``strategy.auto`` on one CUDA GPU (one process):

* with nothing else set, the search measures its four candidates (plain, recompute, amp in
  float16, amp + recompute) on the GPU, takes its budget from the free CUDA memory
  (``torch.cuda.mem_get_info``) and trains with the plan it chose;
* with ``amp`` off and a budget (``FLEETX_AUTO_MEMORY_MB``) between the plain plan's measured
  peak and recompute's, recompute wins, and training equals a run with recompute set by hand
  (1e-6): the search runs on copies and restores the CUDA generator, so the dropout masks of
  the real steps are those of a run without a search.
"""
from __future__ import annotations

import io
import math
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuda_jobs import needs_cuda, state_diff  # noqa: E402

pytestmark = needs_cuda
DEVICE = torch.device("cuda")
WIDTH, DEPTH, BATCH, STEPS = 64, 6, 128, 3
MIB = 1024 * 1024
APPLIED = {"plain": set(), "recompute": {"recompute"}, "amp": {"amp"},
           "amp + recompute": {"amp", "recompute"}}


def _model() -> nn.Module:
    """Blocks with dropout in one container (the candidates recompute its children)."""
    torch.manual_seed(3)
    blocks = [nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Dropout(0.2),
                            nn.Linear(4 * WIDTH, WIDTH)) for _ in range(DEPTH)]
    return nn.Sequential(nn.Sequential(*blocks), nn.Linear(WIDTH, 1)).to(DEVICE)


def _train(strategy) -> tuple:
    from fleetx.fleet import Fleet
    fleet = Fleet()
    fleet.init(is_collective=True, strategy=strategy)
    model = fleet.distributed_model(_model())
    opt = fleet.distributed_optimizer(torch.optim.Adam(model.parameters(), lr=1e-2))
    g = torch.Generator().manual_seed(4)
    torch.manual_seed(5)  # the CUDA generator too: the dropout masks
    for _ in range(STEPS):
        x, y = torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, 1, generator=g)
        opt.minimize(nn.functional.mse_loss(model(x.to(DEVICE)), y.to(DEVICE)))
    text = io.StringIO()
    fleet.explain(file=text)
    return fleet, model.state_dict(), text.getvalue()


def _auto(amp=None):
    from fleetx import DistributedStrategy
    s = DistributedStrategy()
    s.auto = True
    if amp is not None:
        s.amp = amp
    return s


def test_the_search_measures_on_the_gpu_within_the_free_cuda_memory(one_process):
    fleet, state, text = _train(_auto())
    report = fleet._search
    assert report.names == tuple(APPLIED)
    assert report.budget_source == "free CUDA memory + the model's state"
    assert 0 < report.budget_bytes <= torch.cuda.get_device_properties(0).total_memory
    for m in report.measurements:
        assert not m.error and math.isfinite(m.seconds) and m.seconds > 0 and m.state_bytes > 0
    assert set(fleet.applied_strategies()) == APPLIED[report.winner_name]
    assert "free CUDA memory" in text
    assert all(v.device.type == DEVICE.type for v in state.values())
    assert state_diff(state, _model().state_dict()) > 1e-3  # the real steps trained


def test_a_budget_the_plain_plan_exceeds_gets_recompute_equal_to_recompute_by_hand(
        one_process, monkeypatch):
    from fleetx import DistributedStrategy
    from fleetx.strategy.auto import BUDGET_VARIABLE
    monkeypatch.setenv(BUDGET_VARIABLE, "100000")
    fleet, _, _ = _train(_auto(amp=False))
    plain, recompute = fleet._search.measurements
    assert fleet._search.names == ("plain", "recompute")
    assert recompute.saved_bytes < plain.saved_bytes
    between = (plain.peak_bytes + recompute.peak_bytes) / 2 / MIB
    monkeypatch.setenv(BUDGET_VARIABLE, f"{between:.6f}")
    fleet, state, _ = _train(_auto(amp=False))
    assert fleet._search.winner_name == "recompute"
    assert fleet.applied_strategies() == ("recompute",)
    by_hand = DistributedStrategy()
    by_hand.recompute = True
    by_hand.recompute_configs = {"checkpoints": [f"0.{i}" for i in range(DEPTH)]}
    _, expected, _ = _train(by_hand)
    assert state_diff(state, expected) <= 1e-6
