"""Evaluation with sharding stages 2 and 3 on 2 processes (what docs/strategies.md says about it).

A forward of a sharded model gathers its parameters, a collective, also in eval mode:

* run on every rank, an eval forward between training steps gives the outputs of the plain
  model holding the same parameters (1e-6) and does not change training (the parameters equal
  those of the same run without evaluation);
* to evaluate on one rank, every rank calls ``model.state_dict()`` (full tensors) and that rank
  evaluates a plain model loaded from it: the same outputs, and training goes on;
* an eval forward on one rank alone is refused at once (the other rank went on into a collective;
  ``FLEETX_TIMEOUT``, 5 s here, bounds the wait) with a ``CommError`` naming the rank that did
  not come (in its message and in the
  blame fleetrun's ABORT line reads) and ``fleet.consolidated_model``, on whichever rank is
  alone, instead of pairing with the other rank's training collectives.

Every spawn has a deadline, so a regression that hangs fails instead.
"""
from __future__ import annotations

import os
import re
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spawn import max_diff, run_and_load  # noqa: E402

WORLD, B, STEPS, LR = 2, 4, 2, 0.01
GUARD_TIMEOUT = 5


def make_model() -> nn.Module:
    torch.manual_seed(1)
    # A dropout: eval mode must reach the sharded layers for the outputs to match.
    return nn.Sequential(nn.Linear(6, 9), nn.Dropout(0.5), nn.GELU(), nn.Linear(9, 3))


def _sharded(stage: int):
    from fleetx import fleet
    s = fleet.DistributedStrategy()
    s.sharding, s.sharding_configs = True, {"stage": stage}
    fleet.init(is_collective=True, strategy=s)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = fleet.distributed_model(make_model())
        opt = fleet.distributed_optimizer(torch.optim.Adam(model.parameters(), lr=LR))
    return model, opt


def _train(model, opt, rank: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(STEPS):
        x, y = torch.randn(WORLD * B, 6, generator=g), torch.randn(WORLD * B, 3, generator=g)
        sl = slice(rank * B, (rank + 1) * B)
        opt.minimize(nn.functional.mse_loss(model(x[sl]), y[sl]))


def _plain_outputs(state: dict, x: torch.Tensor) -> torch.Tensor:
    plain = make_model()
    plain.load_state_dict(state)
    with torch.no_grad():
        return plain.eval()(x)


def _every_rank(rank: int, stage: int, evaluate: bool) -> dict:
    """Train, (evaluate on every rank,) train again: outputs and final parameters."""
    model, opt = _sharded(stage)
    x, out = torch.randn(5, 6, generator=torch.Generator().manual_seed(3)), {}
    _train(model, opt, rank, seed=4)
    # The evaluation draws random numbers (a model built, a train-mode forward): the training
    # after it must draw the same dropout masks as the run without it.
    with torch.random.fork_rng(), torch.no_grad():
        if evaluate:
            model.eval()
            out["eval"] = [model(x), model(x)]  # twice: a second eval forward works as well
            out["plain"] = _plain_outputs(model.state_dict(), x)
            out["train_mode_outputs_differ"] = bool(
                (model.train()(x) - out["eval"][0]).abs().max() > 1e-3)  # dropout on again
    _train(model, opt, rank, seed=5)
    out["state"] = model.state_dict()
    return out


def _one_rank_recipe(rank: int, stage: int) -> dict:
    """The documented way to evaluate on rank 0 alone: every rank gathers the full state."""
    model, opt = _sharded(stage)
    _train(model, opt, rank, seed=4)
    state = model.state_dict()  # every rank calls it
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(3))
    with torch.random.fork_rng():
        out = {"plain": _plain_outputs(state, x) if rank == 0 else None}
    _train(model, opt, rank, seed=5)  # training goes on: nothing left unmatched
    out["state"] = model.state_dict()
    return out


def _alone(rank: int, stage: int, lonely: int) -> tuple:
    """Rank ``lonely`` runs an eval forward alone; the other waits at a barrier (on the job's
    process group). The error text and the blamed ranks (or ""), and the seconds it took."""
    import torch.distributed as dist

    from fleetx.comm.api import CommError
    os.environ["FLEETX_TIMEOUT"] = str(GUARD_TIMEOUT)  # read by fleet.init into the world
    model, opt = _sharded(stage)
    _train(model, opt, rank, seed=4)
    error, start = "", time.monotonic()
    if rank == lonely:
        model.eval()
        try:
            with torch.no_grad():
                model(torch.ones(1, 6))
        except CommError as err:
            error = (str(err), err._fleetx_blame.ranks)  # the ranks fleetrun's ABORT names
    took = time.monotonic() - start
    dist.barrier()
    return error, took


def _cases(rank: int, world: int, out: str) -> None:
    results = {}
    for stage in (2, 3):
        results[stage, "every_rank"] = _every_rank(rank, stage, evaluate=True)
        results[stage, "no_eval"] = _every_rank(rank, stage, evaluate=False)
        results[stage, "recipe"] = _one_rank_recipe(rank, stage)
    # last: the guard's timeout stays in the environment of this process
    results[3, "rank0_alone"] = _alone(rank, 3, lonely=0)
    results[2, "rank1_alone"] = _alone(rank, 2, lonely=1)
    torch.save(results, f"{out}/rank{rank}.pt")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_and_load(_cases, WORLD, tmp_path_factory.mktemp("sharding_eval"), deadline=600)


@pytest.mark.parametrize("stage", [2, 3])
def test_eval_forward_on_every_rank_equals_the_plain_model(ranks, stage):
    for r in ranks:
        got = r[stage, "every_rank"]
        for outputs in got["eval"]:
            assert max_diff({"y": outputs}, {"y": got["plain"]}) <= 1e-6
        assert got["train_mode_outputs_differ"]
    assert max_diff({"y": ranks[0][stage, "every_rank"]["eval"][0]},
                    {"y": ranks[1][stage, "every_rank"]["eval"][0]}) == 0


@pytest.mark.parametrize("stage", [2, 3])
def test_eval_between_steps_does_not_change_training(ranks, stage):
    for r in ranks:
        assert max_diff(r[stage, "every_rank"]["state"], r[stage, "no_eval"]["state"]) == 0
        assert max_diff(r[stage, "no_eval"]["state"], make_model().state_dict()) > 1e-3


@pytest.mark.parametrize("stage", [2, 3])
def test_one_rank_evaluates_a_plain_model_from_the_full_state_dict(ranks, stage):
    recipe = ranks[0][stage, "recipe"]
    assert max_diff({"y": recipe["plain"]}, {"y": ranks[0][stage, "every_rank"]["plain"]}) == 0
    for r in ranks:  # and both ranks trained on to the same parameters as before
        assert max_diff(r[stage, "recipe"]["state"], r[stage, "no_eval"]["state"]) == 0


def test_an_eval_forward_on_one_rank_alone_is_an_error_naming_the_missing_rank(ranks):
    want = ("sharding stage {stage}: a forward in eval mode gathers the sharded parameters, a "
            "collective every rank must run, and rank(s) {missing} did not run one (rank "
            "{missing} went on into a collective of its own: call #{{}} on the default process "
            "group, which this rank has not entered; FLEETX_TIMEOUT bounds the wait); evaluate "
            "on every rank, or on one rank with a plain copy that every rank makes: plain = "
            "fleet.consolidated_model(model); if rank == 0: evaluate(plain)")
    for rank, stage, key in ((0, 3, "rank0_alone"), (1, 2, "rank1_alone")):
        (text, blamed), took = ranks[rank][stage, key]
        call = re.search(r"call #(\d+) on", text)
        assert call and text == want.format(stage=stage, missing=1 - rank).format(call.group(1))
        assert blamed == (1 - rank,)
        assert took < GUARD_TIMEOUT  # named at once, not after the timeout
    assert ranks[1][3, "rank0_alone"][0] == "" and ranks[0][2, "rank1_alone"][0] == ""
