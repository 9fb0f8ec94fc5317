"""Recompute under data parallel on 2 processes: the model wrapped for recompute, then for DDP,
trains to the same parameters as data parallel alone (3 momentum-SGD steps on a residual MLP
with dropout, the same seeds, so the same masks), to 1e-6; the plan applies recompute before
data parallel (names are resolved on the plain model, not under DDP's ``module.``).

One spawn runs both cases; the parent compares.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spawn import max_diff, run_and_load, train_on_slices  # noqa: E402

WORLD, B, WIDTH, STEPS = 2, 8, 16, 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Dropout(0.3),
                                 nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.net(x)


def make_model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(Block(), Block(), Block(), nn.Linear(WIDTH, 3))


def batches():
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(WORLD * B, WIDTH, generator=g), torch.randn(WORLD * B, 3, generator=g))
            for _ in range(STEPS)]


def _case(rank: int, recompute: bool) -> dict:
    from fleetx import fleet
    s = fleet.DistributedStrategy()
    if recompute:
        s.recompute = True
        s.recompute_configs = {"checkpoints": ["0", "1", "2"]}
    fleet.init(is_collective=True, strategy=s)
    model = make_model()
    torch.manual_seed(100 + rank)  # each rank its own dropout masks, the same in both cases
    result = train_on_slices(fleet, s, model, batches(), rank, B)
    return {"state": result["state"], "plan": result["plan"]}


def _train(rank: int, world: int, out: str) -> None:
    results = {"plain": _case(rank, False), "recompute": _case(rank, True)}
    torch.save(results, f"{out}/rank{rank}.pt")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_and_load(_train, WORLD, tmp_path_factory.mktemp("recompute"))


def test_data_parallel_with_recompute_equals_data_parallel_alone(ranks):
    for r in ranks:
        assert tuple(r["recompute"]["plan"])[:2] == ("recompute", "data_parallel")
        assert "recompute" not in r["plain"]["plan"]
        assert max_diff(r["recompute"]["state"], r["plain"]["state"]) <= 1e-6
        # the steps moved the parameters (equality of untouched models would prove nothing)
        assert max_diff(r["plain"]["state"], make_model().state_dict()) > 1e-3
    assert max_diff(ranks[0]["recompute"]["state"], ranks[1]["recompute"]["state"]) == 0
