"""The transformer recipe's runtime habits (issue 21, item 3).

* A one-process run (``python script.py``, and ``fleetrun --nproc_per_node 1``'s environment)
  has a one-rank default process group after ``fleet.init(is_collective=True)``:
  ``DistributedSampler()``, ``dist.get_rank()`` and ``dist.all_reduce`` work as under
  torchrun's one process; a group the script made itself is kept, and the one fleetx made goes
  at shutdown.
* On 2 processes, one spawn: ``if rank == 0: fleet.save_checkpoint(...)`` (rank 1 goes on into
  the next step's all-reduce) is a ``CommError`` on rank 0 within a few seconds naming rank 1
  and the fix, and training goes on once rank 0 joins the step; a rank that calls
  ``load_checkpoint`` while the other saves is named on both; a rank merely late (it sleeps,
  still reporting) is waited for; a save on both ranks still saves; and the entry costs little
  (its mean time is returned, and bounded).
* One-rank evaluation, on Hugging Face GPT-2 under data parallel and sharding stages 2 and 3:
  every rank calls ``fleet.consolidated_model(model)``; rank 0 alone then runs the copy's
  forward (equal to an eval forward of the wrapped model on every rank, 1e-5) and greedy
  ``generate`` (equal to the wrapped model's ``generate`` on every rank), and training goes on
  in step afterwards. At stages 2 and 3 ``model.state_dict()`` on rank 0 alone (a gather) is
  named within seconds while rank 1 trains on, and both then train on in step.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spawn import run_and_load  # noqa: E402

from fleetx import DistributedStrategy  # noqa: E402
from fleetx.fleet import Fleet  # noqa: E402

LATE_S = 2.5      # longer than two report intervals: a late rank must not be taken as gone
NAMED_WITHIN_S = 5.0


@pytest.mark.parametrize("launched", [False, True], ids=["python", "fleetrun_nproc_1"])
def test_a_one_process_run_has_a_one_rank_process_group(one_process, monkeypatch, launched):
    if launched:  # what fleetrun --nproc_per_node 1 (torch elastic) sets
        for name, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                                LOCAL_WORLD_SIZE="1").items():
            monkeypatch.setenv(name, value)
    assert not dist.is_initialized()
    f = Fleet()
    f.init(is_collective=True)
    assert dist.is_initialized() and (dist.get_rank(), dist.get_world_size()) == (0, 1)
    t = torch.tensor([3.0])
    dist.all_reduce(t)
    assert t.item() == 3.0
    sampler = torch.utils.data.DistributedSampler(list(range(5)), shuffle=False)
    assert list(sampler) == [0, 1, 2, 3, 4]
    f.init(is_collective=True)  # a second init keeps the group
    assert dist.is_initialized()
    f._shutdown()
    assert not dist.is_initialized()


def test_a_group_the_script_made_is_kept(one_process, tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        mine = dist.group.WORLD
        f = Fleet()
        f.init(is_collective=True)
        f._shutdown()
        assert dist.is_initialized() and dist.group.WORLD is mine
    finally:
        dist.destroy_process_group()


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _step(model, opt, rank: int, step: int) -> None:
    g = torch.Generator().manual_seed(100 * step + rank)
    opt.minimize(nn.functional.mse_loss(model(torch.randn(4, 4, generator=g)),
                                        torch.randn(4, 2, generator=g)))


def _timed_error(call) -> tuple:
    from fleetx.comm.api import CommError
    start = time.monotonic()
    try:
        call()
    except CommError as err:
        return str(err), time.monotonic() - start
    return "", time.monotonic() - start


def _guard_cases(rank: int, world: int, out: str) -> None:
    from fleetx import fleet
    fleet.init(is_collective=True)
    model = fleet.distributed_model(_net())
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    ckpt, res = os.path.join(out, "ckpt"), {}
    # A late rank is waited for, and a save on every rank saves.
    _step(model, opt, rank, 0)
    if rank == 1:
        time.sleep(LATE_S)
    res["late"] = _timed_error(lambda: fleet.save_checkpoint(ckpt, extra={"step": 1}))
    res["loaded"] = fleet.load_checkpoint(ckpt)
    dist.barrier()
    start, n = time.monotonic(), 50
    for _ in range(n):
        fleet._fleet._enter("fleet.bench")
    res["entry_s"] = (time.monotonic() - start) / n
    # The DDP save guard: rank 1 goes on into the next step's all-reduce.
    if rank == 0:
        res["guarded"] = _timed_error(lambda: fleet.save_checkpoint(ckpt))
    _step(model, opt, rank, 1)  # rank 0 joins the step rank 1 waits in: training goes on
    # Different fleetx calls: each rank names the other (last: the ranks are out of step after).
    res["mixed"] = _timed_error(
        (lambda: fleet.save_checkpoint(ckpt)) if rank == 0 else (lambda: fleet.load_checkpoint(
            ckpt)))
    _step(model, opt, rank, 2)
    res["state"] = model.state_dict()
    torch.save(res, f"{out}/rank{rank}.pt")


@pytest.fixture(scope="module")
def guard_ranks(tmp_path_factory):
    return run_and_load(_guard_cases, 2, tmp_path_factory.mktemp("recipe_guard"), deadline=120)


def test_a_save_on_rank_0_alone_is_named_at_once(guard_ranks):
    text, took = guard_ranks[0]["guarded"]
    assert text.startswith("fleet.save_checkpoint() is a collective: rank 0 called it, rank(s) "
                           "1 did not (rank 1 went on into a collective of its own"), text
    assert "Call it on every rank (it writes from rank 0 alone" in text
    assert took < NAMED_WITHIN_S
    a, b = (r["state"] for r in guard_ranks)
    assert all(torch.equal(a[k], b[k]) for k in a)  # training went on in step


def test_ranks_in_different_fleetx_calls_name_each_other(guard_ranks):
    (text0, took0), (text1, took1) = (r["mixed"] for r in guard_ranks)
    assert "rank 1 called fleet.load_checkpoint() instead" in text0
    assert "rank 0 called fleet.save_checkpoint() instead" in text1
    assert max(took0, took1) < NAMED_WITHIN_S


def test_a_late_rank_is_waited_for_and_the_entry_costs_little(guard_ranks):
    for r in guard_ranks:
        assert r["late"][0] == "" and r["loaded"] == {"step": 1}
    assert guard_ranks[0]["late"][1] >= LATE_S - 0.5  # rank 0 waited for rank 1
    # one store write and a few reads per rank: well under a millisecond's order on loopback
    assert max(r["entry_s"] for r in guard_ranks) < 0.02, [r["entry_s"] for r in guard_ranks]


# -- one-rank evaluation: fleet.consolidated_model --------------------------------------------
def _hf_stage(fleet, stage):
    import warnings

    from hf_models import gpt2
    s = fleet.DistributedStrategy()
    if stage:
        s.sharding, s.sharding_configs = True, {"stage": stage}
    fleet.init(is_collective=True, strategy=s)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = fleet.distributed_model(gpt2())
        opt = fleet.distributed_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    return model, opt


def _eval_cases(rank: int, world: int, out: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from hf_models import batch

    from fleetx import fleet
    ids, prompt, res = batch(4), batch(1, length=4, seed=7), {}
    for stage in (0, 2, 3):
        model, opt = _hf_stage(fleet, stage)
        opt.minimize(model(ids[2 * rank:2 * rank + 2], labels=ids[2 * rank:2 * rank + 2]).loss)
        model.eval()
        with torch.no_grad():  # the reference: an eval forward and generate on every rank
            every = model(ids).logits
        tokens = model.generate(prompt, max_new_tokens=5, do_sample=False)
        model.train()
        plain = fleet.consolidated_model(model)  # every rank
        got = {"every": every, "every_tokens": tokens, "type": type(plain).__name__,
               "training": plain.training}
        if rank == 0:  # rank 0 alone: nothing here may wait for rank 1
            plain.eval()
            with torch.no_grad():
                got["plain"] = plain(ids).logits
            got["tokens"] = plain.generate(prompt, max_new_tokens=5, do_sample=False)
        del plain
        if rank == 0 and stage:  # the DDP habit: rank 1 goes on into the next training step
            got["alone_state_dict"] = _timed_error(lambda: model.state_dict())
        opt.minimize(model(ids[2 * rank:2 * rank + 2], labels=ids[2 * rank:2 * rank + 2]).loss)
        got["state"] = model.state_dict()  # training went on in step on both ranks
        res[stage] = got
    torch.save(res, f"{out}/rank{rank}.pt")


@pytest.fixture(scope="module")
def eval_ranks(tmp_path_factory):
    return run_and_load(_eval_cases, 2, tmp_path_factory.mktemp("recipe_eval"), deadline=300)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_consolidated_copy_evaluates_and_generates_on_one_rank(eval_ranks, stage):
    zero, one = eval_ranks[0][stage], eval_ranks[1][stage]
    assert zero["type"] == "GPT2LMHeadModel" and zero["training"] is True
    assert torch.allclose(zero["plain"], zero["every"], rtol=0, atol=1e-5)
    assert torch.equal(zero["every"], one["every"])
    assert zero["tokens"].shape == (1, 9)
    assert torch.equal(zero["tokens"], zero["every_tokens"])  # generate on every rank, wrapped
    assert all(torch.equal(zero["state"][k], one["state"][k]) for k in zero["state"])


def test_a_blame_raised_with_its_error_is_left_for_fleetrun(tmp_path):
    """An eval guard's CommError carries the ranks that did not come; the excepthook leaves
    them for fleetrun's ABORT line (not a diagnosis naming the rank that raised)."""
    from fleetx.comm.api import Blame, CommError, read_fault
    from fleetx.comm.blame import Watch
    watch = Watch(dist.HashStore(), 0, 60.0, str(tmp_path), 1.0)
    error = CommError("rank(s) 1 did not run one")
    error._fleetx_blame = Blame(0, os.getpid(), (1,), "rank(s) 1 did not come")
    try:
        raise RuntimeError("wrapped") from error
    except RuntimeError as exc:
        watch._previous_hook = lambda *_: None  # do not print the traceback
        watch._excepthook(type(exc), exc, exc.__traceback__)
    assert read_fault(str(tmp_path), 0, os.getpid()) == error._fleetx_blame


@pytest.mark.parametrize("stage", [2, 3])
def test_a_sharded_state_dict_on_rank_0_alone_is_named_at_once(eval_ranks, stage):
    text, took = eval_ranks[0][stage]["alone_state_dict"]
    assert text.startswith("model.state_dict() is a collective: rank 0 called it, rank(s) 1 did "
                           "not (rank 1 went on into a collective of its own"), text
    assert took < NAMED_WITHIN_S
