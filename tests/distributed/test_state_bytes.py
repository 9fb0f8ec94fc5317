"""``fleet.state_bytes()`` on 2 processes against the figures the plan expects
(``fleet.explain().footprint``), for plain data parallel and sharding stages 1, 2 and 3, Adam.

Measured after a backward and a step (gradients and optimizer state present). Widths divide by
the number of ranks, so FSDP2's shards (stages 2 and 3) are even and each rank must hold exactly
the expected bytes. ZeRO (stage 1) gives each parameter's whole state to one rank, so ranks
differ: their mean must equal the expectation and no rank may hold more than the expectation
plus the state of the largest parameter. At stage 2 the parameters are also measured between
forward and backward, where FSDP2 holds them gathered beside the shards.

One spawn runs every case; the parent compares.
"""
from __future__ import annotations

import io
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spawn import run_and_load  # noqa: E402

WORLD = 2
WIDTHS = (32, 64, 64, 8)  # every dimension 0 divides by WORLD
CASES = ("data_parallel", "stage1", "stage2", "stage3")


def mlp() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for a, b in zip(WIDTHS[:-1], WIDTHS[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def _case(rank: int, name: str) -> dict:
    from fleetx import fleet
    s = fleet.DistributedStrategy()
    if name != "data_parallel":
        s.sharding = True
        s.sharding_configs = {"stage": int(name[-1])}
    fleet.init(is_collective=True, strategy=s)
    model = fleet.distributed_model(mlp())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = fleet.distributed_optimizer(torch.optim.Adam(model.parameters(), lr=1e-3))
    x = torch.randn(4, WIDTHS[0], generator=torch.Generator().manual_seed(rank))
    opt.minimize(model(x).square().mean())  # every parameter has optimizer state
    loss = model(x).square().mean()
    in_step = fleet.state_bytes()["parameters"]
    opt.backward(loss)
    opt.step()
    fp = fleet.explain(file=io.StringIO()).footprint
    return {"measured": fleet.state_bytes(), "in_step": in_step,
            "expected": {"parameters": fp.parameters, "gradients": fp.gradients,
                         "optimizer": fp.optimizer, "in_step": fp.parameters_in_step},
            "plan": fleet.applied_strategies()}


def _train(rank: int, world: int, out: str) -> None:
    torch.save({name: _case(rank, name) for name in CASES}, f"{out}/rank{rank}.pt")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_and_load(_train, WORLD, tmp_path_factory.mktemp("state_bytes"))


def full_bytes() -> tuple[int, int]:
    """(parameter bytes, Adam state bytes) of a full copy."""
    params = sum(p.numel() * 4 for p in mlp().parameters())
    return params, 2 * params + 4 * len(list(mlp().parameters()))


def test_plans_are_the_ones_measured(results):
    for r in results:
        assert "sharding" not in r["data_parallel"]["plan"]
        for stage in ("stage1", "stage2", "stage3"):
            assert "sharding" in r[stage]["plan"]


def test_data_parallel_holds_a_full_copy(results):
    params, adam = full_bytes()
    for r in results:
        case = r["data_parallel"]
        assert case["measured"] == {"parameters": params, "gradients": params, "optimizer": adam}
        assert case["measured"] == {k: case["expected"][k] for k in case["measured"]}


@pytest.mark.parametrize("stage", ["stage2", "stage3"])
def test_fsdp_stages_hold_exactly_their_share(results, stage):
    params, adam = full_bytes()
    n_params = len(list(mlp().parameters()))
    for r in results:
        case = r[stage]
        assert case["measured"] == {k: case["expected"][k] for k in case["measured"]}
        # every rank a shard of every parameter, and of its Adam moments; a step tensor each
        assert case["measured"] == {"parameters": params // WORLD, "gradients": params // WORLD,
                                    "optimizer": 2 * params // WORLD + 4 * n_params}


def test_stage2_keeps_the_gathered_parameters_until_backward(results):
    params, _ = full_bytes()
    for r in results:
        assert r["stage2"]["in_step"] == r["stage2"]["expected"]["in_step"] \
            == params + params // WORLD
        assert r["stage3"]["in_step"] < params  # stage 3 frees each unit after its forward


def test_stage1_partitions_the_optimizer_state(results):
    params, adam = full_bytes()
    largest = 2 * max(p.numel() * 4 for p in mlp().parameters()) + 4
    optimizer = [r["stage1"]["measured"]["optimizer"] for r in results]
    assert sum(optimizer) == adam  # each parameter's state on exactly one rank
    expected = results[0]["stage1"]["expected"]
    assert abs(sum(optimizer) / WORLD - expected["optimizer"]) <= 4  # the mean; step rounding
    for r in results:
        case = r["stage1"]
        assert case["measured"]["optimizer"] <= expected["optimizer"] + largest
        assert (case["measured"]["parameters"], case["measured"]["gradients"]) == (
            params, params) == (expected["parameters"], expected["gradients"])
