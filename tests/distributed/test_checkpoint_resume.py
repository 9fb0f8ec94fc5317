"""Training checkpoints across processes (gloo, loopback).

One 2-process spawn trains three jobs, each saving a checkpoint in the middle and training on:
data parallel with amp + gradient merge and Adam (saved between two micro-steps of a merge), DGC
with momentum SGD (compressing, so each rank holds its own residuals), and Local SGD (its
counters). Each job is then resumed from its checkpoint in fresh fleets: the parameters equal
the uninterrupted run (1e-6). The parent loads the 2-process checkpoints into one plain process:
parameters, Adam moments, step counts and SGD momentum exactly rank 0's at the save, the loss
scale and micro-step counter rank 0's, and the per-rank gradients of the unfinished merge
dropped; it saves from one process, and a second 2-process spawn loads that under another
strategy (Local SGD). Four processes (slow): the 2-process checkpoints load into 4 (DGC's step
kept, its buffers rebuilt; Local SGD's counters rank 0's), 4 save, and 2 load that back.
"""
from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spawn import max_diff, run  # noqa: E402

WORLD, B = 2, 4
JOBS = ("amp_merge", "dgc", "localsgd")


def make_model(seed: int = 1) -> nn.Module:
    # 128*160 = 20480 weights: above DGC's 16384-element threshold, so they are compressed.
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(128, 160), nn.Tanh(), nn.Linear(160, 3))


def batches(n: int, world: int = 4):
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(world * B, 128, generator=g), torch.randn(world * B, 3, generator=g))
            for _ in range(n)]


def strategy(job: str):
    from fleetx import fleet
    s = fleet.DistributedStrategy()
    if job == "amp_merge":
        s.amp = True
        s.amp_configs = {"init_loss_scaling": 1024.0, "incr_every_n_steps": 2}
        s.gradient_merge = True
        s.gradient_merge_configs = {"k_steps": 2}
    elif job == "dgc":
        s.dgc = True
        s.dgc_configs = {"rampup_begin_step": 1, "rampup_step": 1, "sparsity": [0.9]}
    elif job == "localsgd":
        s.localsgd = True
        s.localsgd_configs = {"k_steps": 2, "begin_step": 1}
    return s


def build(job: str, seed: int = 1):
    """A fresh fleet, model and optimizer for ``job`` in this process's world."""
    from fleetx import fleet
    f = fleet.Fleet()
    s = strategy(job)
    f.init(is_collective=True, strategy=s)
    model = f.distributed_model(make_model(seed))
    params = model.parameters()
    opt = (torch.optim.Adam(params, lr=0.01) if job == "amp_merge"
           else torch.optim.SGD(params, lr=0.05, momentum=0.9))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return f, model, f.distributed_optimizer(opt)


def train(model, opt, data, rank: int, world: int) -> None:
    per = 4 * B // world
    for x, y in data:
        sl = slice(rank * per, (rank + 1) * per)
        opt.minimize(nn.functional.mse_loss(model(x[sl]), y[sl]))


def snapshot(model, opt) -> dict:
    sd = opt.state_dict()
    return {"params": {k: v.detach().clone() for k, v in model.state_dict().items()},
            # deep copies: a state dict holds the live tensors, which training goes on changing
            "optim": copy.deepcopy(opt.inner.state_dict()),
            "fleetx": copy.deepcopy(sd.get("fleetx", {})),
            "grads": {n: p.grad.clone() for n, p in model.named_parameters()
                      if p.grad is not None}}


SAVE_AT, MORE = 5, 3


def _train_save_resume(rank: int, world: int, out: str) -> None:
    data = batches(SAVE_AT + MORE)
    results = {}
    for job in JOBS:
        f, model, opt = build(job)
        train(model, opt, data[:SAVE_AT], rank, world)
        f.save_checkpoint(f"{out}/{job}", extra={"step": SAVE_AT, "job": job})
        at_save = snapshot(model, opt)
        train(model, opt, data[SAVE_AT:], rank, world)
        g, resumed, ropt = build(job, seed=7)
        extra = g.load_checkpoint(f"{out}/{job}")
        loaded = snapshot(resumed, ropt)
        train(resumed, ropt, data[SAVE_AT:], rank, world)
        results[job] = {"at_save": at_save, "loaded": loaded, "extra": extra,
                        "end": snapshot(model, opt)["params"],
                        "resumed_end": snapshot(resumed, ropt)["params"],
                        "plan": f.applied_strategies()}
    torch.save(results, f"{out}/rank{rank}.pt")


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt2")
    run(_train_save_resume, WORLD, str(out))
    return out, [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


def test_resuming_at_the_same_world_size_equals_uninterrupted_training(two):
    _, ranks = two
    for r in ranks:
        for job in JOBS:
            res = r[job]
            assert job.split("_")[0] in res["plan"], res["plan"]
            assert res["extra"] == {"step": SAVE_AT, "job": job}
            assert max_diff(res["loaded"]["params"], res["at_save"]["params"]) == 0
            # data parallel's traffic counters appear with its engine, at the first forward
            assert res["loaded"]["fleetx"].keys() == res["at_save"]["fleetx"].keys() - {
                "data_parallel"}
            assert max_diff(res["resumed_end"], res["end"]) <= 1e-6, job
            assert max_diff(res["end"], res["at_save"]["params"]) > 1e-4  # it trained on
    # each rank got its own per-rank state back: DGC residuals and merge gradients differ
    dgc = [r["dgc"]["loaded"]["fleetx"]["dgc"]["v"]["0.weight"] for r in ranks]
    assert not torch.equal(dgc[0], dgc[1])
    for i, r in enumerate(ranks):
        assert torch.equal(dgc[i], r["dgc"]["at_save"]["fleetx"]["dgc"]["v"]["0.weight"])
        grads = r["amp_merge"]
        assert grads["at_save"]["grads"] and max_diff(grads["loaded"]["grads"],
                                                      grads["at_save"]["grads"]) == 0


def _load_into_this_process(path, job: str):
    from fleetx import fleet
    f = fleet.Fleet()
    s = strategy("amp_merge") if job == "amp_merge" else fleet.DistributedStrategy()
    f.init(is_collective=True, strategy=s)
    model = f.distributed_model(make_model(seed=9))
    opt = (torch.optim.Adam(model.parameters(), lr=0.5) if job == "amp_merge"
           else torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = f.distributed_optimizer(opt)
    return f, model, opt, f.load_checkpoint(str(path))


def _assert_optimizer_equal(got: dict, want: dict) -> None:
    assert got["param_groups"][0]["lr"] == want["param_groups"][0]["lr"]
    assert got["state"].keys() == want["state"].keys() and got["state"]
    for i, state in want["state"].items():
        for key, value in state.items():
            assert torch.equal(got["state"][i][key], value), (i, key)


@pytest.mark.usefixtures("one_process")
def test_two_process_checkpoints_load_into_one_plain_process(two):
    out, ranks = two
    for job in JOBS:
        _, model, opt, extra = _load_into_this_process(out / job, job)
        want = ranks[0][job]["at_save"]
        assert extra["job"] == job
        assert max_diff(model.state_dict(), want["params"]) == 0
        _assert_optimizer_equal(opt.inner.state_dict(), want["optim"])
        if job == "amp_merge":  # rank 0's loss scale and counter; per-rank gradients dropped
            assert opt.state_dict()["fleetx"]["amp"] == want["fleetx"]["amp"]
            assert opt.state_dict()["fleetx"]["gradient_merge"] == {"micro_step": SAVE_AT}
            assert all(p.grad is None for p in model.parameters())


def _load_one_process_save(rank: int, world: int, out: str) -> None:
    f, model, opt = build("localsgd", seed=11)
    extra = f.load_checkpoint(f"{out}/from_one")
    torch.save({"params": model.state_dict(), "optim": opt.inner.state_dict(), "extra": extra,
                "plan": f.applied_strategies()}, f"{out}/back{rank}.pt")


@pytest.mark.usefixtures("one_process")
def test_a_one_process_save_loads_into_two_under_another_strategy(two):
    out, _ = two
    f, model, opt, _ = _load_into_this_process(out / "dgc", "dgc")
    f.save_checkpoint(str(out / "from_one"), extra={"from": 1})
    want = {"params": model.state_dict(), "optim": opt.inner.state_dict()}
    run(_load_one_process_save, WORLD, str(out))
    for r in range(WORLD):
        got = torch.load(out / f"back{r}.pt")
        assert "localsgd" in got["plan"] and got["extra"] == {"from": 1}
        assert max_diff(got["params"], want["params"]) == 0
        _assert_optimizer_equal(got["optim"], want["optim"])


def _four_load_and_save(rank: int, world: int, out: str) -> None:
    results = {}
    for job in ("dgc", "localsgd"):
        f, model, opt = build(job, seed=13)
        f.load_checkpoint(f"{out}/{job}")
        results[job] = snapshot(model, opt)
        f.save_checkpoint(f"{out}/{job}_by4")
    torch.save(results, f"{out}/four{rank}.pt")


def _two_load_back(rank: int, world: int, out: str) -> None:
    f, model, opt = build("dgc", seed=17)
    f.load_checkpoint(f"{out}/dgc_by4")
    torch.save(snapshot(model, opt), f"{out}/back_from4_{rank}.pt")


@pytest.mark.slow
def test_two_process_checkpoints_load_into_four_and_back(two):
    out, ranks = two
    run(_four_load_and_save, 4, str(out))
    four = [torch.load(out / f"four{r}.pt") for r in range(4)]
    for job in ("dgc", "localsgd"):
        want = ranks[0][job]["at_save"]
        for r in four:
            assert max_diff(r[job]["params"], want["params"]) == 0
            _assert_optimizer_equal(r[job]["optim"], want["optim"])
    for r in four:
        assert r["dgc"]["fleetx"]["dgc"]["step"] == want_dgc_step(ranks)
        assert r["dgc"]["fleetx"]["dgc"]["u"] == {}  # per-rank buffers rebuilt when next used
        assert r["localsgd"]["fleetx"]["localsgd"] == ranks[0]["localsgd"]["at_save"]["fleetx"][
            "localsgd"]
    run(_two_load_back, WORLD, str(out))
    for r in range(WORLD):
        back = torch.load(out / f"back_from4_{r}.pt")
        assert max_diff(back["params"], ranks[0]["dgc"]["at_save"]["params"]) == 0
        _assert_optimizer_equal(back["optim"], ranks[0]["dgc"]["at_save"]["optim"])


def want_dgc_step(ranks) -> int:
    return ranks[0]["dgc"]["at_save"]["fleetx"]["dgc"]["step"]
