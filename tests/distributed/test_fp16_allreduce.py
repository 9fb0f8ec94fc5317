"""fp16_allreduce on 2 gloo processes: half the bytes, float16's precision, same on every rank.

Both runs (plain data parallel and fp16_allreduce) train the same model on the same data in the
same processes. The gradient average differs from float32's by float16 rounding (relative 2^-11
per element); over six steps of lr 0.05 that moves the parameters by about 3e-5 (measured), so
the test allows 2e-4, while a wrong average (not divided, or summed twice) moves them by ~1e-1.

With ``dgc`` as well, float16 carries the dense remainder (parameters under 16384 elements) while
DGC's (index, value) pairs stay 32-bit: the bytes drop by exactly 2 per dense element per step.

With ``amp``, gradients travel loss-scaled: a scale too large for float16 overflows to inf in
the all-reduce, amp skips those steps and lowers the scale until the gradients fit.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spawn import run_and_load, train_on_slices  # noqa: E402

WORLD, BATCH, STEPS = 2, 8, 6


def make_model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 3))


def dgc_model() -> nn.Module:
    torch.manual_seed(1)  # 20480 compressed weights; 160 + 480 + 3 dense elements
    return nn.Sequential(nn.Linear(128, 160), nn.Tanh(), nn.Linear(160, 3))


DGC_DENSE = 160 + 480 + 3


def batches():
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(WORLD * BATCH, 10, generator=g), torch.randn(WORLD * BATCH, 3, generator=g))
            for _ in range(STEPS)]


def _train(rank: int, world: int, out: str) -> None:
    from fleetx import fleet
    fleet.init(is_collective=True)
    results = {}
    for name in ("plain", "fp16", "dgc", "dgc_fp16", "amp_fp16"):
        strategy = fleet.DistributedStrategy()
        strategy.fp16_allreduce = name.endswith("fp16")
        if name == "amp_fp16":
            strategy.amp = True
            strategy.amp_configs = {"init_loss_scaling": 2.0 ** 18, "decr_every_n_nan_or_inf": 1,
                                    "decr_ratio": 0.5}
        if name.startswith("dgc"):
            strategy.dgc, strategy.dgc_configs = True, {"sparsity": [0.99]}
        dgc = name.startswith("dgc")
        run_ = train_on_slices(fleet, strategy, dgc_model() if dgc else make_model(), batches(),
                               rank, BATCH, prepare=(lambda x: x.repeat(1, 13)[:, :128]) if dgc
                               else None)
        results[name], results[f"{name}_plan"] = run_["state"], run_["plan"]
        results[f"{name}_traffic"] = run_["traffic"]
        if name == "amp_fp16":
            results["loss_scale"] = run_["optimizer"].get_loss_scaling()
    torch.save(results, f"{out}/rank{rank}.pt")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_and_load(_train, WORLD, tmp_path_factory.mktemp("fp16"))


def test_plan(ranks):
    assert ranks[0]["fp16_plan"] == ("data_parallel", "fp16_allreduce")
    assert ranks[0]["plain_traffic"] is None  # plain data parallel keeps DDP's own all-reduce


def test_within_half_precision_of_float32(ranks):
    for result in ranks:
        diff = max((result["fp16"][k] - v).abs().max().item() for k, v in result["plain"].items())
        assert 0 < diff < 2e-4, diff  # rounded, but only by float16's precision


def test_counted_bytes_are_half_of_float32(ranks):
    numel = sum(p.numel() for p in make_model().parameters())
    for result in ranks:
        t = result["fp16_traffic"]
        assert t["rounds"] == STEPS
        assert t["payload_bytes"] == STEPS * numel * 2  # float32 would be numel * 4


def test_every_rank_holds_the_same_parameters(ranks):
    for key, value in ranks[0]["fp16"].items():
        assert torch.equal(ranks[1]["fp16"][key], value)


def test_with_dgc_only_the_dense_remainder_is_cast(ranks):
    assert ranks[0]["dgc_fp16_plan"] == ("data_parallel", "dgc", "fp16_allreduce")
    for result in ranks:
        saved = result["dgc_traffic"]["payload_bytes"] - result["dgc_fp16_traffic"]["payload_bytes"]
        assert saved == STEPS * DGC_DENSE * 2
    for key, value in ranks[0]["dgc_fp16"].items():
        assert torch.equal(ranks[1]["dgc_fp16"][key], value)


def test_with_amp_overflowing_steps_lower_the_scale(ranks):
    for result in ranks:
        assert result["amp_fp16_plan"] == ("data_parallel", "amp", "fp16_allreduce")
        # 2^18 times gradients near 1 overflow float16 (max 65504): halved until they fit
        assert 2.0 ** 10 <= result["loss_scale"] < 2.0 ** 18
        assert all(torch.isfinite(v).all() for v in result["amp_fp16"].values())
        assert max_diff(result["amp_fp16"], make_model().state_dict()) > 0  # later steps taken


def max_diff(a: dict, b: dict) -> float:
    return max((a[k] - v).abs().max().item() for k, v in b.items())
