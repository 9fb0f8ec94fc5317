"""nccl_comm_num > 1 on 2 gloo processes: buckets spread over several groups, same sums.

With one bucket per parameter, ``nccl_comm_num = 3`` sends the buckets round-robin over three
process groups as asynchronous all-reduces. The parameters equal those of one group (1e-6; the
same tensors are summed by the same algorithm) and every channel carries buckets. DGC's
all-gathers follow the channels too, with the same result as on one group.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spawn import max_diff, run_and_load, train_on_slices  # noqa: E402

WORLD, BATCH, STEPS = 2, 8, 5
DGC = {"rampup_begin_step": 1, "sparsity": [0.9]}
RUNS = {
    "one": {},
    "three": {"nccl_comm_num": 3},
    "dgc": {"dgc": True, "dgc_configs": DGC},
    "dgc_three": {"dgc": True, "dgc_configs": DGC, "nccl_comm_num": 3},
}


def make_model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(128, 160), nn.Tanh(), nn.Linear(160, 3))


def batches():
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(WORLD * BATCH, 128, generator=g),
             torch.randn(WORLD * BATCH, 3, generator=g)) for _ in range(STEPS)]


def _train(rank: int, world: int, out: str) -> None:
    from fleetx import fleet
    fleet.init(is_collective=True)
    results = {}
    for name, flags in RUNS.items():
        strategy = fleet.DistributedStrategy()
        strategy.fuse_all_reduce_ops = False  # one bucket per parameter
        for key, value in flags.items():
            setattr(strategy, key, value)
        run_ = train_on_slices(fleet, strategy, make_model(), batches(), rank, BATCH)
        results[name], results[f"{name}_plan"] = run_["state"], run_["plan"]
        results[f"{name}_traffic"] = run_["traffic"]
    torch.save(results, f"{out}/rank{rank}.pt")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_and_load(_train, WORLD, tmp_path_factory.mktemp("comm_num"))


def test_plan(ranks):
    assert ranks[0]["three_plan"] == ("data_parallel", "nccl_comm_num")
    assert ranks[0]["dgc_three_plan"] == ("data_parallel", "dgc", "nccl_comm_num")


@pytest.mark.parametrize("many,one", [("three", "one"), ("dgc_three", "dgc")])
def test_equal_to_one_group(ranks, many, one):
    for result in ranks:
        assert max_diff(result[many], result[one]) <= 1e-6
    assert max_diff(ranks[0]["dgc"], ranks[0]["one"]) > 1e-4  # DGC did compress


@pytest.mark.parametrize("name", ["three", "dgc_three"])
def test_every_channel_carries_buckets(ranks, name):
    per_channel = ranks[0][f"{name}_traffic"]["per_channel"]
    assert sorted(per_channel) == [0, 1, 2]
    assert min(per_channel.values()) > 0
