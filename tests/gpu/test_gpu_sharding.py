"""``strategy.sharding`` on CUDA:

* one process: there is nothing to shard (sharding degree 1), which the plan says with a
  warning for each stage, and Adam training through fleet equals plain CUDA training (1e-5);
* two ranks over NCCL: stage 1 (ZeroRedundancyOptimizer under DDP), stage 2 and stage 3 (FSDP2)
  each equal one CUDA process with plain Adam on the union of the ranks' batches (1e-5), and
  ``state_dict`` gives the full plain tensors on both ranks. NCCL refuses two ranks on one GPU,
  so this case needs two GPUs and skips with fewer.
"""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuda_jobs import batches, mlp, needs_cuda, needs_gpus, run_two_ranks, state_diff  # noqa: E402

pytestmark = needs_cuda
STEPS, ROWS, LR = 4, 8, 0.01


def plain_adam() -> dict:
    model = mlp().cuda()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    for x, y in batches(STEPS, ROWS):
        nn.functional.mse_loss(model(x.cuda()), y.cuda()).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.cpu() for k, v in model.state_dict().items()}


def _strategy(stage: int):
    from fleetx import DistributedStrategy
    s = DistributedStrategy()
    s.sharding = True
    s.sharding_configs = {"stage": stage}
    return s


def _train(fleet, rank: int, world: int) -> dict:
    device = fleet.local_device()
    model = fleet.distributed_model(mlp().to(device))
    opt = fleet.distributed_optimizer(torch.optim.Adam(model.parameters(), lr=LR))
    sl = slice(rank * ROWS // world, (rank + 1) * ROWS // world)
    for x, y in batches(STEPS, ROWS):
        opt.minimize(nn.functional.mse_loss(model(x[sl].to(device)), y[sl].to(device)))
    return {k: v.full_tensor().cpu() if hasattr(v, "full_tensor") else v.cpu()
            for k, v in model.state_dict().items()}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_one_process_has_nothing_to_shard_and_trains_like_plain_cuda(one_process, stage):
    from fleetx.fleet import Fleet
    fleet = Fleet()
    fleet.init(is_collective=True, strategy=_strategy(stage))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _train(fleet, 0, 1)
    assert "sharding" not in fleet.applied_strategies()
    assert any("sharding degree 1" in str(w.message) for w in caught)
    assert state_diff(got, plain_adam()) <= 1e-5


def _two_ranks(rank: int, world: int, out: str) -> None:
    from fleetx import fleet
    results = {}
    for stage in (1, 2, 3):
        fleet.init(is_collective=True, strategy=_strategy(stage))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            results[stage] = {"state": _train(fleet, rank, world),
                              "plan": fleet.applied_strategies()}
    torch.save(results, f"{out}/rank{rank}.pt")


@needs_gpus(2)
def test_two_ranks_over_nccl_each_stage_equals_one_process_on_the_union_batch(tmp_path):
    run_two_ranks(_two_ranks, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    want = plain_adam()
    assert state_diff(want, mlp().state_dict()) > 1e-3
    for stage in (1, 2, 3):
        for r in ranks:
            assert "sharding" in r[stage]["plan"], (stage, r[stage]["plan"])
            assert (("data_parallel" in r[stage]["plan"]) == (stage == 1)), r[stage]["plan"]
            assert state_diff(r[stage]["state"], want) <= 1e-5, stage
