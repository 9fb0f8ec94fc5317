"""Collective data parallel on CUDA (NCCL):

* one process (fleet built in the test, and a real ``fleetrun --gpus 0`` job): fleet picks the
  GPU (``local_device`` is ``cuda:0``), plans no DDP for a world of one, and momentum SGD on a
  small MLP through ``distributed_model`` / ``distributed_optimizer`` equals plain CUDA training
  (1e-5);
* two ranks over NCCL (DDP): the parameters after several steps equal one CUDA process trained on
  the union of the ranks' batches (1e-5). NCCL refuses two ranks on one GPU, so this case
  needs two GPUs and skips with fewer.
"""
from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuda_jobs import batches, mlp, needs_cuda, needs_gpus, run_two_ranks, state_diff  # noqa: E402

pytestmark = needs_cuda
HERE = Path(__file__).resolve().parent
STEPS, ROWS = 6, 16


def plain_cuda(rows_of=lambda x: x) -> dict:
    """One plain CUDA process: momentum SGD (lr 0.05, 0.9) on the MSE of every batch."""
    model = mlp().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for x, y in batches(STEPS, ROWS):
        nn.functional.mse_loss(model(rows_of(x).cuda()), rows_of(y).cuda()).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.cpu() for k, v in model.state_dict().items()}


def test_one_process_trains_like_plain_cuda(one_process):
    from fleetx.fleet import Fleet
    fleet = Fleet()
    fleet.init(is_collective=True)
    assert fleet.local_device() == torch.device("cuda", 0)
    model = fleet.distributed_model(mlp().cuda())
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    for x, y in batches(STEPS, ROWS):
        opt.minimize(nn.functional.mse_loss(model(x.cuda()), y.cuda()))
    assert "data_parallel" not in fleet.applied_strategies()  # a world of one: no DDP
    got = model.state_dict()
    assert all(v.is_cuda for v in got.values())
    want = plain_cuda()
    assert state_diff(want, mlp().state_dict()) > 1e-3  # the steps moved the parameters
    assert state_diff(got, want) <= 1e-5


def test_fleetrun_gpus_0_trains_like_plain_cuda(tmp_path):
    out = tmp_path / "result.pt"
    cmd = [sys.executable, "-m", "fleetx.launch", "--gpus", "0",
           str(HERE / "fleetrun_cuda_train.py"), str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = torch.load(out)
    assert (result["device"], result["worker_num"], result["visible"]) == ("cuda:0", 1, 1)
    assert "data_parallel" not in result["plan"]
    assert state_diff(result["state"], plain_cuda()) <= 1e-5


def _two_ranks(rank: int, world: int, out: str) -> None:
    import torch.distributed as dist

    from fleetx import fleet
    fleet.init(is_collective=True)
    device = fleet.local_device()
    model = fleet.distributed_model(mlp().to(device))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = fleet.distributed_optimizer(
            torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    sl = slice(rank * ROWS // 2, (rank + 1) * ROWS // 2)
    for x, y in batches(STEPS, ROWS):
        opt.minimize(nn.functional.mse_loss(model(x[sl].to(device)), y[sl].to(device)))
    torch.save({"state": {k: v.cpu() for k, v in model.state_dict().items()},
                "backend": dist.get_backend(), "plan": fleet.applied_strategies(),
                "device": str(device)}, f"{out}/rank{rank}.pt")


@needs_gpus(2)
def test_two_ranks_over_nccl_equal_one_process_on_the_union_batch(tmp_path):
    run_two_ranks(_two_ranks, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    want = plain_cuda()  # each rank's half, averaged by DDP, is the whole batch's gradient
    for r in ranks:
        assert r["backend"] == "nccl" and r["plan"][0] == "data_parallel"
        assert state_diff(r["state"], want) <= 1e-5
    assert state_diff(ranks[0]["state"], ranks[1]["state"]) == 0.0
