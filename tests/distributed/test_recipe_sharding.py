"""The transformer recipe (nanoGPT's ``train.py`` loop) at every sharding stage, on 2 processes.

A ``GPT2LMHeadModel`` in float64 whose MLP is 33 wide (``c_proj.weight`` has 33 rows: uneven
shards on 2 ranks) is trained as nanoGPT trains: each rank seeds ``1337 + rank`` before building
the model, and the optimizer is ``torch.optim.AdamW`` with nanoGPT's two parameter groups (weight
decay on the 2-D weights only), built before or after ``fleet.distributed_model``. At stages 1,
2 and 3:

* the iteration-0 loss on each rank's slice is that of rank 0's initialisation (the model of
  seed 1337 in one process), as under data parallel, and after the steps the parameters equal
  one process with AdamW on the union batch (float64, a formula: 1e-9);
* ``opt.state_dict()`` is the whole state in the plain optimizer's format (full plain tensors,
  indices in group order), on every rank; saved by rank 0 after 2 steps and loaded on every rank
  into a fresh model and optimizer, training goes on to the uninterrupted run's parameters
  (1e-12), and the saved dict loads into a plain AdamW; saved at stage 1, it resumes at stage
  3. A state tensor of another shape is refused naming the parameter; a state loaded before
  the model is sharded (nanoGPT's order) is refused naming the order that works.

One spawn runs every case; the parent computes the one-process references and compares. The
4-process case (stage 3 over a ``(replicate, shard)`` mesh, ``hybrid_dp``) and stage 3 on a
``LlamaForCausalLM`` (rotary buffers, grouped-query attention) are slow.
"""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hf_models  # noqa: E402  (tests/hf_models.py)
from spawn import max_diff, run_and_load  # noqa: E402

WORLD, B, STEPS, SAVED_AT, SEED = 2, 2, 4, 2, 1337
STAGES = (1, 2, 3)


def make(rank: int = 0, arch: str = "gpt2") -> torch.nn.Module:
    """nanoGPT's seeding: each rank builds its model from its own seed."""
    if arch == "llama":
        return hf_models.llama(seed=SEED + rank).to(torch.float64)
    return hf_models.gpt2(n_inner=33, seed=SEED + rank).to(torch.float64)


def configure_optimizers(model: torch.nn.Module) -> torch.optim.AdamW:
    """nanoGPT's ``configure_optimizers``: weight decay on the weights of 2 or more dimensions
    (matrices, embeddings), none on biases and norms."""
    params = dict(model.named_parameters())
    groups = [{"params": [p for p in params.values() if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params.values() if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95))


def data(world: int = WORLD) -> list:
    return [hf_models.batch(world * B, seed=10 + i) for i in range(STEPS)]


def reference(world: int = WORLD, arch: str = "gpt2") -> dict:
    """One process from rank 0's initialisation, AdamW on the union batch: the loss of each
    rank's slice at iteration 0, and the parameters after every step."""
    model = make(0, arch)
    opt = configure_optimizers(model)
    batches = data(world)
    with torch.no_grad():
        x = batches[0]
        first = [model(input_ids=x[r * B:(r + 1) * B], labels=x[r * B:(r + 1) * B]).loss.item()
                 for r in range(world)]
    for x in batches:
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    return {"first": first, "state": model.state_dict()}


def _wrap(stage: int, seed: int, optimizer_first: bool, arch: str = "gpt2", **sharding):
    from fleetx import fleet
    s = fleet.DistributedStrategy()
    s.sharding = True
    s.sharding_configs = dict(stage=stage, **sharding)
    fleet.init(is_collective=True, strategy=s)
    plain = make(seed, arch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if optimizer_first:
            opt = fleet.distributed_optimizer(configure_optimizers(plain))
            model = fleet.distributed_model(plain)
        else:
            model = fleet.distributed_model(plain)
            opt = fleet.distributed_optimizer(configure_optimizers(model))
    return model, opt


def _steps(model, opt, rank: int, batches: list) -> list:
    losses = []
    for x in batches:
        mine = x[rank * B:(rank + 1) * B]
        loss = model(input_ids=mine, labels=mine).loss
        losses.append(loss.item())
        opt.minimize(loss)
    return losses


def _train(stage: int, rank: int, world: int, optimizer_first: bool, **options) -> dict:
    model, opt = _wrap(stage, rank, optimizer_first, **options)
    losses = _steps(model, opt, rank, data(world))
    return {"first": losses[0], "state": model.state_dict()}


def _resume(stage: int, rank: int, world: int, out: str, **options) -> dict:
    """Train ``SAVED_AT`` steps, save on rank 0, and go on from the file (:func:`_load_at`)."""
    import torch.distributed as dist
    model, opt = _wrap(stage, rank, False, **options)
    _steps(model, opt, rank, data(world)[:SAVED_AT])
    saved = {"model": model.state_dict(), "optimizer": opt.state_dict()}  # every rank
    path = f"{out}/stage{stage}_world{world}.pt"
    if rank == 0:
        torch.save(saved, path)
    dist.barrier()
    return dict(_load_at(stage, path, rank, world, **options), saved=saved["optimizer"])


def _wrong_shape_error(opt, sd: dict) -> str:
    """The error of loading a state whose first moment of parameter 0 lost a row."""
    state = dict(sd["state"])
    state[0] = dict(state[0], exp_avg=state[0]["exp_avg"][1:])
    try:
        opt.load_state_dict(dict(sd, state=state))
    except ValueError as err:
        return str(err)
    return ""


def _cases(rank: int, world: int, out: str) -> None:
    results = {}
    for stage in STAGES:
        for first in (False, True):
            results[f"stage{stage}_first{first}"] = _train(stage, rank, world, first)
        results[f"stage{stage}_resume"] = _resume(stage, rank, world, out)
    results["stage1_to_3"] = _load_at(3, f"{out}/stage1_world{world}.pt", rank, world)["state"]
    results["loaded_before_model"] = _loaded_before_model(f"{out}/stage1_world{world}.pt", rank)
    torch.save(results, f"{out}/rank{rank}.pt")


def _loaded_before_model(path: str, rank: int) -> str:
    """nanoGPT's order (the state loaded before the model is wrapped) at stage 3: the error."""
    from fleetx import fleet
    from fleetx.strategy.api import StrategyError
    s = fleet.DistributedStrategy()
    s.sharding = True
    s.sharding_configs = {"stage": 3}
    fleet.init(is_collective=True, strategy=s)
    plain = make(rank)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = fleet.distributed_optimizer(configure_optimizers(plain))
        opt.load_state_dict(torch.load(path, weights_only=True)["optimizer"])
        try:
            fleet.distributed_model(plain)
        except StrategyError as err:
            return str(err)
    return ""


def _load_at(stage: int, path: str, rank: int, world: int, **options) -> dict:
    """Resume at ``stage`` from ``path`` on every rank, in a fresh model and optimizer (built
    from this rank's other seed), and train the remaining steps; first, at stages 2 and 3, try
    a state of another shape (the error)."""
    loaded = torch.load(path, weights_only=True)  # plain tensors only
    model, opt = _wrap(stage, rank + world, False, **options)
    model.load_state_dict(loaded["model"])
    refused = _wrong_shape_error(opt, loaded["optimizer"]) if stage > 1 else ""
    opt.load_state_dict(loaded["optimizer"])
    _steps(model, opt, rank, data(world)[SAVED_AT:])
    return {"state": model.state_dict(), "refused": refused}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_and_load(_cases, WORLD, tmp_path_factory.mktemp("recipe"))


@pytest.fixture(scope="module")
def want():
    return reference()


@pytest.mark.parametrize("optimizer_first", [False, True])
@pytest.mark.parametrize("stage", STAGES)
def test_adamw_from_rank0_init_equals_one_process_on_the_union_batch(ranks, want, stage,
                                                                    optimizer_first):
    # the ranks' own seeds give other weights: rank 0's were sent to every rank
    assert max_diff(make(1).state_dict(), make(0).state_dict()) > 1e-2
    assert max_diff(want["state"], make(0).state_dict()) > 1e-3  # the steps moved the weights
    for rank, r in enumerate(ranks):
        got = r[f"stage{stage}_first{optimizer_first}"]
        assert got["first"] == pytest.approx(want["first"][rank], abs=1e-12)
        assert max_diff(got["state"], want["state"]) <= 1e-9


@pytest.mark.parametrize("stage", STAGES)
def test_full_optimizer_state_saved_on_rank0_resumes_exactly(ranks, stage):
    plain = make(0)
    opt = configure_optimizers(plain)
    shapes = [p.shape for group in opt.param_groups for p in group["params"]]  # index order
    n_params = len(shapes)
    assert any(s[0] == 33 for s in shapes)  # a tensor of 33 rows: uneven shards on 2 ranks
    for r in ranks:
        sd = r[f"stage{stage}_resume"]["saved"]
        assert sorted(sd["state"]) == list(range(n_params))
        for index, entry in sd["state"].items():
            for key in ("exp_avg", "exp_avg_sq"):
                assert type(entry[key]) is torch.Tensor and entry[key].shape == shapes[index]
            assert int(entry["step"]) == SAVED_AT
        uninterrupted = r[f"stage{stage}_firstFalse"]["state"]
        assert max_diff(r[f"stage{stage}_resume"]["state"], uninterrupted) <= 1e-12
    # the same state on both ranks, and in the plain optimizer's format
    a, b = (r[f"stage{stage}_resume"]["saved"]["state"] for r in ranks)
    assert all(torch.equal(a[i]["exp_avg_sq"], b[i]["exp_avg_sq"]) for i in a)
    opt.load_state_dict(ranks[1][f"stage{stage}_resume"]["saved"])
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]


def test_a_state_saved_at_stage1_resumes_at_stage3(ranks, want):
    for r in ranks:
        assert max_diff(r["stage1_to_3"], r["stage3_firstFalse"]["state"]) <= 1e-9
        assert max_diff(r["stage1_to_3"], want["state"]) <= 1e-9


@pytest.mark.parametrize("stage", [2, 3])
def test_a_state_of_another_shape_is_refused_naming_the_parameter(ranks, stage):
    for r in ranks:
        assert r[f"stage{stage}_resume"]["refused"] == (
            "optimizer state 'exp_avg' of parameter 0 has shape (255, 32), the parameter "
            "(256, 32): the state dict was saved for another model or other parameter groups")


def _hybrid(rank: int, world: int, out: str) -> None:
    hybrid = {"sharding_degree": 2, "hybrid_dp": True}  # (replicate 2, shard 2) mesh
    torch.save({"train": _train(3, rank, world, False, **hybrid),
                "resume": _resume(3, rank, world, out, **hybrid)}, f"{out}/rank{rank}.pt")


@pytest.mark.slow
def test_four_processes_hybrid_stage3_starts_from_rank0_and_resumes_exactly(tmp_path):
    want = reference(4)
    for rank, r in enumerate(run_and_load(_hybrid, 4, tmp_path)):
        assert r["train"]["first"] == pytest.approx(want["first"][rank], abs=1e-12)
        assert max_diff(r["train"]["state"], want["state"]) <= 1e-9
        assert max_diff(r["resume"]["state"], r["train"]["state"]) <= 1e-12


def _llama(rank: int, world: int, out: str) -> None:
    torch.save({"train": _train(3, rank, world, False, arch="llama"),
                "resume": _resume(3, rank, world, out, arch="llama")}, f"{out}/rank{rank}.pt")


@pytest.mark.slow
def test_llama_stage3_starts_from_rank0_and_resumes_exactly(tmp_path):
    want = reference(WORLD, "llama")
    assert max_diff(make(1, "llama").state_dict(), make(0, "llama").state_dict()) > 1e-2
    for rank, r in enumerate(run_and_load(_llama, WORLD, tmp_path)):
        assert r["train"]["first"] == pytest.approx(want["first"][rank], abs=1e-12)
        assert max_diff(r["train"]["state"], want["state"]) <= 1e-9
        assert max_diff(r["resume"]["state"], r["train"]["state"]) <= 1e-12


def test_a_state_loaded_before_the_model_is_sharded_is_refused_naming_the_order(ranks):
    for r in ranks:
        assert r["loaded_before_model"] == (
            "sharding: the AdamW given to fleet.distributed_optimizer already holds state (it "
            "has stepped, or a state was loaded into it); sharding rebuilds it over the sharded "
            "parameters and would drop that state: create the optimizer fresh, and load a "
            "saved state with opt.load_state_dict once both fleet.distributed_model and "
            "fleet.distributed_optimizer were called")
