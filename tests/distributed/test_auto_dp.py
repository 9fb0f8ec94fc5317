"""strategy.auto on 2 processes: every rank measures every candidate, and all run rank 0's choice.

* a small model with only ``strategy.auto = True`` and the machine's free memory as budget: plain
  data parallel (amp on a CPU, recompute and sharding only add work to a model that fits);
* a budget (FLEETX_AUTO_MEMORY_MB) that the plain plan's Adam state exceeds (amp and recompute
  set off by the user, so only sharding can save memory): a sharding stage wins on both ranks,
  with the same figures (memory the largest over ranks, timings rank 0's) and the ranks'
  parameters equal.

One spawn runs both cases; the parent checks.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spawn import max_diff, run_and_load  # noqa: E402

WORLD, B, WIDTH, STEPS, MIB = 2, 16, 32, 3, 1024 * 1024


def small_model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def deep_model() -> nn.Module:
    torch.manual_seed(2)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(),
                                         nn.Linear(4 * WIDTH, WIDTH)) for _ in range(4)])


def _search(make, width: int, fixed_off: bool) -> dict:
    import io
    import warnings

    from fleetx import fleet
    s = fleet.DistributedStrategy()
    s.auto = True
    if fixed_off:
        s.amp, s.recompute = False, False
    fleet.init(is_collective=True, strategy=s)
    model = fleet.distributed_model(make())
    opt = fleet.distributed_optimizer(torch.optim.Adam(model.parameters(), lr=1e-2))
    g = torch.Generator().manual_seed(3 + fleet.worker_index())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(STEPS):
            opt.minimize(model(torch.randn(B, width, generator=g)).pow(2).mean())
    out = io.StringIO()
    fleet.explain(file=out)
    report = fleet._fleet._search
    return {"names": report.names, "winner": report.winner_name, "budget": report.budget_bytes,
            "peaks": [m.peak_bytes for m in report.measurements],
            "seconds": [m.seconds for m in report.measurements],
            "plan": fleet.applied_strategies(), "text": out.getvalue(),
            "state": {k: v.clone() for k, v in model.state_dict().items()}}


def _train(rank: int, world: int, out: str) -> None:
    from fleetx import env
    results = {"small": _search(small_model, 8, fixed_off=False)}
    env.environ["FLEETX_AUTO_MEMORY_MB"] = "100000"
    loose = _search(deep_model, WIDTH, fixed_off=True)
    plain, smallest = loose["peaks"][0], min(loose["peaks"][1:])
    env.environ["FLEETX_AUTO_MEMORY_MB"] = f"{(plain + smallest) / 2 / MIB:.6f}"
    results["loose"], results["tight"] = loose, _search(deep_model, WIDTH, fixed_off=True)
    torch.save(results, f"{out}/rank{rank}.pt")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_and_load(_train, WORLD, tmp_path_factory.mktemp("auto"))


def test_a_small_model_gets_plain_data_parallel(ranks):
    for r in ranks:
        small = r["small"]
        assert small["winner"] == "data parallel", small["text"]
        assert small["plan"] == ("data_parallel",)
        assert "fleetx auto: chose 'data parallel'" in small["text"]
        assert "amp" in small["names"]
    assert ranks[0]["small"]["seconds"] == ranks[1]["small"]["seconds"]  # rank 0's timings
    assert max_diff(ranks[0]["small"]["state"], ranks[1]["small"]["state"]) == 0


def test_a_model_whose_adam_state_exceeds_the_budget_gets_sharding(ranks):
    loose = ranks[0]["loose"]
    assert loose["names"] == ("data parallel", "sharding stage 1", "sharding stage 2",
                              "sharding stage 3")
    assert max(loose["peaks"][1:]) < loose["peaks"][0]  # every stage holds less per rank
    for r in ranks:
        tight = r["tight"]
        assert tight["winner"].startswith("sharding stage"), tight["text"]
        assert tight["winner"] == ranks[0]["tight"]["winner"]
        assert "sharding" in tight["plan"] and "auto" not in tight["plan"]
        assert tight["peaks"] == ranks[0]["tight"]["peaks"]  # the largest over the ranks
        won = tight["names"].index(tight["winner"])
        assert tight["peaks"][won] <= tight["budget"] < tight["peaks"][0]
        assert "FLEETX_AUTO_MEMORY_MB" in tight["text"] and "no" in tight["text"]
    assert max_diff(ranks[0]["tight"]["state"], ranks[1]["tight"]["state"]) == 0
