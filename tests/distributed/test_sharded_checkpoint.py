"""Training checkpoints of sharded jobs (sharding stages 1, 2 and 3; gloo, loopback).

One 2-process spawn runs every case at 2 processes. Each stage trains Adam, saves in the
middle, trains on; a fresh job of the same stage loads the checkpoint and trains on too: the
parameters equal the uninterrupted run (1e-6), and what was loaded equals what was saved
exactly (parameters, Adam moments, step counts, learning rate). The same spawn loads the
checkpoints under other strategies (stage 1 -> stage 3, stage 3 -> stage 1, stage 2 -> sharding
off), loads a checkpoint the parent saved from one plain process into stages 1 and 3, loads a
Local SGD checkpoint (the ranks' copies differ) into stages 1 and 3, and checks that stages 2
and 3 with gradient merge refuse a save between micro-steps (stage 3 resumes from one after
the update). The parent loads each 2-process sharded checkpoint into one plain process. Four
processes (slow): the 2-process checkpoints load into 4 under other stages or without
sharding, 4 save, and 2 load that back.

The optimizer state is compared by parameter name, gathered whole from whatever layout holds it
(ZeroRedundancyOptimizer's consolidated state dict, FSDP2's DTensor shards).
"""
from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spawn import max_diff, run  # noqa: E402

WORLD, B, LR = 2, 4, 0.01
SAVE_AT, MORE = 3, 3
STAGES = (1, 2, 3)
# (checkpoint written at 2 processes, stage of the loading job; 0 = sharding off)
CROSS = (("stage1", 3), ("stage3", 1), ("stage2", 0))


def make_model(seed: int = 1) -> nn.Module:
    torch.manual_seed(seed)
    # Odd widths: FSDP2 pads the shards of a dimension that does not divide by the ranks, and
    # ZeRO's partition differs between 2 and 4 processes.
    return nn.Sequential(nn.Linear(6, 9), nn.GELU(), nn.Linear(9, 7), nn.GELU(), nn.Linear(7, 3))


def batches(n: int):
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(4 * B, 6, generator=g), torch.randn(4 * B, 3, generator=g))
            for _ in range(n)]


def build(stage: int, seed: int = 1, localsgd: bool = False, sgd: bool = False,
          merge: int = 1):
    """A fresh fleet, model and Adam (momentum SGD with ``sgd``, which Local SGD needs);
    ``stage`` 0 leaves sharding off."""
    from fleetx import fleet
    s = fleet.DistributedStrategy()
    if stage:
        s.sharding = True
        s.sharding_configs = {"stage": stage}
    if localsgd:  # after step 1 each rank steps on its own gradients, averaging at step 4
        s.localsgd = True
        s.localsgd_configs = {"k_steps": 3, "begin_step": 1}
    if merge > 1:
        s.gradient_merge = True
        s.gradient_merge_configs = {"k_steps": merge}
    f = fleet.Fleet()
    f.init(is_collective=True, strategy=s)
    model = f.distributed_model(make_model(seed))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = f.distributed_optimizer(
            torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9) if sgd or localsgd
            else torch.optim.Adam(model.parameters(), lr=LR))
    return f, model, opt


def train(model, opt, data, rank: int, world: int) -> None:
    per = 4 * B // world
    sl = slice(rank * per, (rank + 1) * per)
    for x, y in data:
        opt.minimize(nn.functional.mse_loss(model(x[sl]), y[sl]))


def snapshot(model, opt) -> dict:
    """Full parameters and the optimizer state by parameter name (a collective)."""
    names = [n for n, _ in model.module.named_parameters()]
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    inner = opt.inner
    if hasattr(inner, "consolidate_state_dict") or not any(
            hasattr(p, "full_tensor") for p in model.module.parameters()):
        sd = opt.state_dict()  # plain, or ZeRO's consolidated onto every rank
        order = [i for g in sd["param_groups"] for i in g["params"]]
        assert order == list(range(len(names)))
        state = {names[i]: {k: v.clone() for k, v in s.items()} for i, s in sd["state"].items()}
        lr = sd["param_groups"][0]["lr"]
    else:  # FSDP2: the optimizer holds the DTensor shards; gather each whole
        state = {}
        for name, p in model.module.named_parameters():
            if p in inner.state:
                state[name] = {k: v.full_tensor() if hasattr(v, "full_tensor") else v.clone()
                               for k, v in inner.state[p].items()}
        lr = inner.param_groups[0]["lr"]
    return {"params": params, "optim": state, "lr": lr}


def _sharded_jobs(rank: int, world: int, out: str) -> None:
    data = batches(SAVE_AT + MORE)
    results = {}
    for stage in STAGES:
        f, model, opt = build(stage)
        train(model, opt, data[:SAVE_AT], rank, world)
        f.save_checkpoint(f"{out}/stage{stage}", extra={"stage": stage})
        at_save = snapshot(model, opt)
        train(model, opt, data[SAVE_AT:], rank, world)
        g, resumed, ropt = build(stage, seed=7)
        extra = g.load_checkpoint(f"{out}/stage{stage}")
        loaded = snapshot(resumed, ropt)
        train(resumed, ropt, data[SAVE_AT:], rank, world)
        results[f"stage{stage}"] = {
            "at_save": at_save, "loaded": loaded, "extra": extra, "plan": f.applied_strategies(),
            "end": snapshot(model, opt)["params"], "resumed_end": snapshot(resumed, ropt)["params"]}
    f, model, opt = build(0, localsgd=True)
    train(model, opt, data[:SAVE_AT], rank, world)  # 3 steps: the ranks' copies differ
    f.save_checkpoint(f"{out}/localsgd")
    results["localsgd"] = {"at_save": snapshot(model, opt)}
    for ckpt, stage in CROSS + (("one", 1), ("one", 3), ("localsgd", 1), ("localsgd", 3)):
        g, model, opt = build(stage, seed=9, sgd=ckpt == "localsgd")
        g.load_checkpoint(f"{out}/{ckpt}")
        results[f"{ckpt}->{stage}"] = {"loaded": snapshot(model, opt),
                                       "plan": g.applied_strategies()}
    results["merge"] = _merge_at_stages_2_3(data, rank, world, out)
    torch.save(results, f"{out}/rank{rank}.pt")


def _merge_at_stages_2_3(data, rank: int, world: int, out: str) -> dict:
    """Stages 2 and 3 with a 2-step gradient merge: a save between micro-steps is refused (FSDP2
    holds the accumulated gradients unsharded, outside what a checkpoint reads); a save after
    the update resumes like the uninterrupted run (stage 3)."""
    from fleetx.checkpoint import CheckpointError
    refused = {}
    for stage in (2, 3):
        f, model, opt = build(stage, merge=2)
        train(model, opt, data[:3], rank, world)
        try:
            f.save_checkpoint(f"{out}/merge")
            refused[stage] = ""
        except CheckpointError as e:
            refused[stage] = str(e)
    train(model, opt, data[3:4], rank, world)  # the update that ends stage 3's merge
    f.save_checkpoint(f"{out}/merge")
    train(model, opt, data[4:], rank, world)
    g, resumed, ropt = build(3, seed=7, merge=2)
    g.load_checkpoint(f"{out}/merge")
    train(resumed, ropt, data[4:], rank, world)
    return {"refused": refused, "end": snapshot(model, opt)["params"],
            "resumed_end": snapshot(resumed, ropt)["params"]}


def _one_process_save(out: Path) -> dict:
    """One plain process trains and saves to ``out/one``; its state at the save."""
    with pytest.MonkeyPatch.context() as mp:
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            mp.delenv(name, raising=False)
        f, model, opt = build(0, seed=5)
        train(model, opt, batches(2), 0, 1)
        f.save_checkpoint(str(out / "one"))
        return snapshot(model, opt)


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded_ckpt")
    one = _one_process_save(out)
    run(_sharded_jobs, WORLD, str(out))
    return out, one, [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


def assert_same_state(got: dict, want: dict) -> None:
    """Parameters, optimizer state (Adam's moments and step counts, SGD's momenta) exactly
    equal, and the learning rate."""
    assert max_diff(got["params"], want["params"]) == 0
    assert got["optim"].keys() == want["optim"].keys() and want["optim"]
    for name, state in want["optim"].items():
        assert state.keys() == got["optim"][name].keys()
        for key, value in state.items():
            assert torch.equal(got["optim"][name][key], value), (name, key)
    assert got["lr"] == want["lr"]


@pytest.mark.parametrize("stage", STAGES)
def test_resuming_a_sharded_job_equals_uninterrupted_training(two, stage):
    _, _, ranks = two
    for r in ranks:
        res = r[f"stage{stage}"]
        assert "sharding" in res["plan"] and res["extra"] == {"stage": stage}
        assert all(int(s["step"]) == SAVE_AT for s in res["at_save"]["optim"].values())
        assert_same_state(res["loaded"], res["at_save"])
        assert max_diff(res["resumed_end"], res["end"]) <= 1e-6
        assert max_diff(res["end"], res["at_save"]["params"]) > 1e-4  # it trained on


def test_stages_2_and_3_with_gradient_merge_save_only_at_an_update(two):
    out, _, ranks = two
    for r in ranks:
        for stage in (2, 3):
            assert r["merge"]["refused"][stage].startswith(
                "cannot save while sharding stage 2 or 3 (FSDP2) holds gradients accumulated "
                "without synchronisation (6 parameters, first '0.weight')"), stage
        assert max_diff(r["merge"]["resumed_end"], r["merge"]["end"]) <= 1e-6
    assert len(list((out / "merge").glob("save-*"))) == 1  # the refused save wrote nothing


@pytest.mark.parametrize("ckpt,stage", CROSS)
def test_sharded_checkpoints_load_under_another_stage_or_without_sharding(two, ckpt, stage):
    _, _, ranks = two
    for r in ranks:
        got = r[f"{ckpt}->{stage}"]
        assert ("sharding" in got["plan"]) == bool(stage)
        assert_same_state(got["loaded"], ranks[0][ckpt]["at_save"])


@pytest.mark.parametrize("stage", [1, 3])
def test_a_one_process_checkpoint_loads_into_two_sharded_processes(two, stage):
    _, one, ranks = two
    for r in ranks:
        assert_same_state(r[f"one->{stage}"]["loaded"], one)


@pytest.mark.parametrize("stage", [1, 3])
def test_diverging_replicas_load_into_a_sharded_job_as_rank_0s_copy(two, stage):
    """Local SGD between averages: the ranks' parameters and moments differ, each rank saves
    its own copy, and a sharded job at the same world size takes rank 0's on every rank."""
    out, _, ranks = two
    copies = [r["localsgd"]["at_save"] for r in ranks]
    assert max_diff(copies[0]["params"], copies[1]["params"]) > 1e-4
    assert _replica_of(out / "localsgd") is not None
    for r in ranks:
        assert_same_state(r[f"localsgd->{stage}"]["loaded"], copies[0])


def _replica_of(ckpt: Path):
    (folder,) = ckpt.glob("save-*")
    return json.loads((folder / "strategy-rank0.json").read_text())["replica"]


@pytest.mark.parametrize("stage", STAGES)
def test_sharded_checkpoints_hold_no_per_rank_copies(two, stage):
    """A ZeRO partition's keys are disjoint and FSDP2's are shards: nothing is replicated."""
    out, _, _ = two
    assert _replica_of(out / f"stage{stage}") is None


@pytest.mark.usefixtures("one_process")
@pytest.mark.parametrize("stage", STAGES)
def test_sharded_checkpoints_load_into_one_plain_process(two, stage):
    out, _, ranks = two
    f, model, opt = build(0, seed=9)
    assert f.load_checkpoint(str(out / f"stage{stage}")) == {"stage": stage}
    assert "sharding" not in f.applied_strategies()
    assert_same_state(snapshot(model, opt), ranks[0][f"stage{stage}"]["at_save"])


# (checkpoint, stage of the 4-process job that loads it and saves it again, stage of the
# 2-process job that loads that back)
FOUR = (("stage1", 3, 1), ("stage3", 2, 0), ("stage2", 1, 3), ("stage3", 0, 2))


def _four_load_and_save(rank: int, world: int, out: str) -> None:
    results = {}
    for i, (ckpt, stage, _) in enumerate(FOUR):
        f, model, opt = build(stage, seed=13)
        f.load_checkpoint(f"{out}/{ckpt}")
        results[i] = {"loaded": snapshot(model, opt), "plan": f.applied_strategies()}
        f.save_checkpoint(f"{out}/by4_{i}")
    torch.save(results, f"{out}/four{rank}.pt")


def _two_load_back(rank: int, world: int, out: str) -> None:
    results = {}
    for i, (_, _, stage) in enumerate(FOUR):
        f, model, opt = build(stage, seed=17)
        f.load_checkpoint(f"{out}/by4_{i}")
        results[i] = snapshot(model, opt)
    torch.save(results, f"{out}/back{rank}.pt")


@pytest.mark.slow
def test_sharded_checkpoints_load_into_four_processes_and_back(two):
    out, _, ranks = two
    run(_four_load_and_save, 4, str(out))
    for r in range(4):
        four = torch.load(out / f"four{r}.pt")
        for i, (ckpt, stage, _) in enumerate(FOUR):
            assert ("sharding" in four[i]["plan"]) == bool(stage)
            assert_same_state(four[i]["loaded"], ranks[0][ckpt]["at_save"])
    run(_two_load_back, WORLD, str(out))
    for r in range(WORLD):
        back = torch.load(out / f"back{r}.pt")
        for i, (ckpt, _, _) in enumerate(FOUR):
            assert_same_state(back[i], ranks[0][ckpt]["at_save"])
