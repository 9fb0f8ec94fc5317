"""Hugging Face models (``GPT2LMHeadModel``, ``LlamaForCausalLM`` from tiny configs) through the
strategies on 2 processes, called as HF scripts call them: ``out = model(input_ids=x,
labels=x)``, ``opt.minimize(out.loss)``, ``model.generate(...)``.

In float64 with Adam (a formula, so 1e-9), 2 processes each on half of every batch end with the
parameters of 1 plain process trained on the union batches: data parallel (with and without
``find_unused_parameters``), sharding stages 1, 2 and 3 (Adam; AdamW with nanoGPT's two groups at
every stage is tests/distributed/test_recipe_sharding.py), gradient merge (1 process on the union of the merged
micro-batches), recompute by class (GPT-2's ``GPT2Block``) or by a glob of names (Llama's ``model.layers.*``;
each block's MLP then runs twice per step),
``auto``, and ``save_checkpoint`` / ``load_checkpoint`` (resumed in a fresh fleet from other
initial weights, then trained on: the uninterrupted run). Local SGD (``k_steps=2``) equals two
replicas in one process whose parameters are averaged every 2 steps. DGC before its
``rampup_begin_step`` equals momentum-SGD data parallel (float32, 1e-5), and after it leaves the
ranks identical and away from dense training (it compressed). Amp (bfloat16 on CPU) trains with
the ranks identical and the parameters off float32's (bfloat16 was in force). Greedy ``generate`` on the wrapped model after training
gives the tokens of the plain trained model, at data parallel and at sharding stage 3 — there
with rank 0 stopping at its first token while rank 1 goes on (the forwards stay paired).

One spawn of 2 processes per model runs every case; the parent computes the 1-process
references and compares. GPT-2 is the default stage; Llama is slow.
"""
from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hf_models  # noqa: E402  (tests/hf_models.py)
from spawn import max_diff, run_and_load  # noqa: E402

WORLD, B, STEPS, LR, MU = 2, 2, 3, 1e-2, 0.9
NEW = 5  # tokens generated
MODELS = {  # the factory, what recompute is given (a class, a glob), a block it selects
    "gpt2": (hf_models.gpt2, ["GPT2Block"], "transformer.h.0"),
    "llama": (hf_models.llama, ["model.layers.*"], "model.layers.1"),
}
F64_CASES = {  # name: (strategy switches, micro-batches per step)
    "dp": ({}, 1),
    "dp_unused": ({"find_unused_parameters": True}, 1),
    "stage1": ({"sharding": True, "sharding_configs": {"stage": 1}}, 1),
    "stage2": ({"sharding": True, "sharding_configs": {"stage": 2}}, 1),
    "stage3": ({"sharding": True, "sharding_configs": {"stage": 3}}, 1),
    "merge": ({"gradient_merge": True, "gradient_merge_configs": {"k_steps": 2}}, 2),
    "recompute": ({"recompute": True}, 1),
    "auto": ({"auto": True}, 1),
}
DGC_BEGIN, DGC_STEPS, DGC_WIDTH = 2, 4, 64  # width 64: embeddings of 16384 values get compressed


def data(steps: int, k: int = 1, seed: int = 1) -> list:
    """``steps * k`` micro-batches of token ids, ``WORLD * B`` sequences each."""
    return [hf_models.batch(WORLD * B, seed=seed + i) for i in range(steps * k)]


def make(name: str, dtype=torch.float64, **config):
    return MODELS[name][0](**config).to(dtype)


def adam_reference(name: str, steps: int = STEPS, k: int = 1) -> torch.nn.Module:
    """One process, plain Adam, each step on the union of the ranks' (merged) batches."""
    model = make(name)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    micro = data(steps, k)
    for i in range(steps):
        x = torch.cat(micro[i * k:(i + 1) * k])
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    return model


def strategy(switches: dict):
    from fleetx import fleet
    s = fleet.DistributedStrategy()
    for key, value in switches.items():
        setattr(s, key, value)
    return s


def build(f, name: str, switches: dict, opt_of, dtype=torch.float64, seed: int = 0, **config):
    """``f`` initialised for ``switches``; the wrapped model and optimizer."""
    f.init(is_collective=True, strategy=strategy(switches))
    model = f.distributed_model(make(name, dtype, seed=seed, **config))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # auto / sharding notes about the CPU
        return model, f.distributed_optimizer(opt_of(model.parameters()))


def train(model, opt, micro: list, rank: int) -> None:
    sl = slice(rank * B, (rank + 1) * B)
    for x in micro:
        out = model(input_ids=x[sl], labels=x[sl])  # a ModelOutput, as without fleetx
        assert out.logits.shape[:2] == x[sl].shape
        opt.minimize(out.loss)


def prompt(rank: int) -> torch.Tensor:
    return hf_models.batch(1, length=4, seed=100 + rank)


def greedy(model, rank: int, eos=None) -> torch.Tensor:
    x = prompt(rank)
    return model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW,
                          do_sample=False, eos_token_id=eos, pad_token_id=0)


def _generate_paired(model, rank: int) -> dict:
    """Greedy tokens on every rank; rank 0 then stops at its first token, rank 1 does not."""
    first = greedy(model, rank)
    eos = int(first[0, prompt(rank).shape[1]]) if rank == 0 else -1
    return {"tokens": first, "eos": eos, "stopped": greedy(model, rank, eos=eos)}


def _f64_cases(rank: int, name: str) -> dict:
    from fleetx import fleet
    results = {}
    for case, (switches, k) in F64_CASES.items():
        if case == "recompute":
            switches = dict(switches, recompute_configs={"checkpoints": MODELS[name][1]})
        model, opt = build(fleet, name, switches, lambda p: torch.optim.Adam(p, lr=LR))
        # the block's MLP: its call runs inside the checkpointed forward, so once per forward
        block = model.get_submodule(MODELS[name][2] + ".mlp")
        calls = []
        handle = block.register_forward_pre_hook(lambda *_: calls.append(1))
        train(model, opt, data(STEPS, k), rank)
        handle.remove()
        results[case] = {"state": model.state_dict(), "plan": fleet.applied_strategies(),
                         "block_forwards": len(calls)}
        if case in ("dp", "stage3"):
            results[case]["generate"] = _generate_paired(model, rank)
    return results


def _checkpoint(rank: int, name: str, out: str) -> dict:
    from fleetx import fleet
    adam = lambda p: torch.optim.Adam(p, lr=LR)  # noqa: E731
    f = fleet.Fleet()
    model, opt = build(f, name, {}, adam)
    micro = data(STEPS)
    train(model, opt, micro[:2], rank)
    f.save_checkpoint(f"{out}/{name}_ckpt")
    train(model, opt, micro[2:], rank)
    g = fleet.Fleet()
    resumed, ropt = build(g, name, {}, adam, seed=7)
    g.load_checkpoint(f"{out}/{name}_ckpt")
    train(resumed, ropt, micro[2:], rank)
    return {"end": model.state_dict(), "resumed_end": resumed.state_dict()}


def _localsgd(rank: int, name: str) -> dict:
    from fleetx import fleet
    switches = {"localsgd": True, "localsgd_configs": {"k_steps": 2, "begin_step": 1}}
    model, opt = build(fleet, name, switches, lambda p: torch.optim.SGD(p, lr=LR, momentum=MU))
    trace = []
    for x in data(4):
        train(model, opt, [x], rank)
        trace.append({k: v.clone() for k, v in model.state_dict().items()})  # live tensors
    return {"trace": trace, "plan": fleet.applied_strategies()}


def _dgc(rank: int, name: str) -> dict:
    from fleetx import fleet
    switches = {"dgc": True, "dgc_configs": {"rampup_begin_step": DGC_BEGIN, "sparsity": [0.99]}}
    width = {"n_embd": DGC_WIDTH} if name == "gpt2" else {"hidden": DGC_WIDTH}
    model, opt = build(fleet, name, switches, lambda p: torch.optim.SGD(p, lr=LR, momentum=MU),
                       dtype=torch.float32, **width)
    trace = []
    for x in data(DGC_STEPS):
        train(model, opt, [x], rank)
        trace.append({k: v.clone() for k, v in model.state_dict().items()})  # live tensors
    return {"trace": trace, "plan": fleet.applied_strategies()}


def _amp(rank: int, name: str) -> dict:
    from fleetx import fleet
    model, opt = build(fleet, name, {"amp": True}, lambda p: torch.optim.Adam(p, lr=LR),
                       dtype=torch.float32)
    train(model, opt, data(STEPS), rank)
    return {"state": model.state_dict(), "plan": fleet.applied_strategies()}


def _all_cases(rank: int, world: int, out: str, name: str) -> None:
    results = _f64_cases(rank, name)
    results.update(checkpoint=_checkpoint(rank, name, out), localsgd=_localsgd(rank, name),
                   dgc=_dgc(rank, name), amp=_amp(rank, name))
    torch.save(results, f"{out}/rank{rank}.pt")


@pytest.fixture(scope="module", params=[
    "gpt2", pytest.param("llama", marks=pytest.mark.slow)])
def ranks(request, tmp_path_factory):
    name = request.param
    hf_models.transformers()
    return name, run_and_load(_cases_of[name], WORLD, tmp_path_factory.mktemp(f"hf_{name}"))


def _gpt2_cases(rank: int, world: int, out: str) -> None:
    _all_cases(rank, world, out, "gpt2")


def _llama_cases(rank: int, world: int, out: str) -> None:
    _all_cases(rank, world, out, "llama")


_cases_of = {"gpt2": _gpt2_cases, "llama": _llama_cases}  # picklable: module-level functions


@pytest.fixture(scope="module")
def references(ranks):
    name = ranks[0]
    return {"plain": adam_reference(name), "merge": adam_reference(name, k=2)}


@pytest.mark.parametrize("case", [c for c in F64_CASES])
def test_two_processes_equal_one_process_on_the_union_batch(ranks, references, case):
    name, results = ranks
    want = references["merge" if case == "merge" else "plain"].state_dict()
    assert max_diff(want, make(name).state_dict()) > 1e-3  # the steps moved the parameters
    for r in results:
        got = r[case]
        assert set(got["state"]) == set(want)  # the plain model's keys
        assert max_diff(got["state"], want) <= 1e-9, got["plan"]
    applied = results[0][case]["plan"]
    expected = {"dp": "data_parallel", "dp_unused": "data_parallel", "stage1": "sharding",
                "stage2": "sharding", "stage3": "sharding", "merge": "gradient_merge",
                "recompute": "recompute"}.get(case)
    assert expected is None or expected in applied


def test_recompute_runs_each_named_block_forward_twice_per_step(ranks):
    _, results = ranks
    for r in results:
        assert r["recompute"]["block_forwards"] == 2 * STEPS
        assert r["dp"]["block_forwards"] == STEPS


@pytest.mark.parametrize("case", ["dp", "stage3"])
def test_generate_on_the_wrapped_model_equals_the_plain_model(ranks, references, case):
    _, results = ranks
    plain = references["plain"]
    for rank, r in enumerate(results):
        got = r[case]["generate"]
        want = greedy(plain, rank)
        assert want.shape[1] == prompt(rank).shape[1] + NEW
        assert torch.equal(got["tokens"], want)
        assert torch.equal(got["stopped"], greedy(plain, rank, eos=got["eos"]))
    # rank 0 stopped after one token while rank 1 generated them all
    assert results[0][case]["generate"]["stopped"].shape[1] == prompt(0).shape[1] + 1
    assert results[1][case]["generate"]["stopped"].shape[1] == prompt(1).shape[1] + NEW


def test_checkpoint_resumed_in_a_fresh_fleet_equals_uninterrupted_training(ranks, references):
    _, results = ranks
    want = references["plain"].state_dict()
    for r in results:
        assert max_diff(r["checkpoint"]["resumed_end"], r["checkpoint"]["end"]) == 0
        assert max_diff(r["checkpoint"]["end"], want) <= 1e-9


def local_sgd_simulation(name: str, steps: int = 4) -> list:
    """Two replicas, each momentum SGD on its half; step 1 synchronous (gradients averaged),
    then parameters averaged after every second local step (steps 3 and 5...)."""
    replicas = [make(name), make(name)]
    opts = [torch.optim.SGD(m.parameters(), lr=LR, momentum=MU) for m in replicas]
    trace = []
    for step, x in enumerate(data(steps), start=1):
        for rank, model in enumerate(replicas):
            sl = x[rank * B:(rank + 1) * B]
            model(input_ids=sl, labels=sl).loss.backward()
        if step <= 1:
            for p0, p1 in zip(*(m.parameters() for m in replicas)):
                p0.grad = p1.grad = (p0.grad + p1.grad) / 2
        for opt in opts:
            opt.step()
            opt.zero_grad()
        if step > 1 and (step - 1) % 2 == 0:
            with torch.no_grad():
                for p0, p1 in zip(*(m.parameters() for m in replicas)):
                    p0.copy_((p0 + p1) / 2)
                    p1.copy_(p0)
        trace.append([copy.deepcopy(m.state_dict()) for m in replicas])
    return trace


def test_localsgd_equals_two_averaged_replicas(ranks):
    name, results = ranks
    want = local_sgd_simulation(name)
    for rank, r in enumerate(results):
        assert "localsgd" in r["localsgd"]["plan"]
        for step, state in enumerate(r["localsgd"]["trace"]):
            assert max_diff(state, want[step][rank]) <= 1e-9, step
    # between averages the ranks drift apart; right after one they are equal
    t0, t1 = results[0]["localsgd"]["trace"], results[1]["localsgd"]["trace"]
    assert max_diff(t0[1], t1[1]) > 1e-6 and max_diff(t0[2], t1[2]) == 0


def momentum_sgd(name: str, steps: int, **width) -> dict:
    model = make(name, torch.float32, **width)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MU)
    for x in data(steps):
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def test_dgc_is_data_parallel_before_rampup_then_compresses(ranks):
    name, results = ranks
    width = {"n_embd": DGC_WIDTH} if name == "gpt2" else {"hidden": DGC_WIDTH}
    before, dense = momentum_sgd(name, DGC_BEGIN, **width), momentum_sgd(name, DGC_STEPS, **width)
    for r in results:
        assert "dgc" in r["dgc"]["plan"]
        assert max_diff(r["dgc"]["trace"][DGC_BEGIN - 1], before) <= 1e-5
        assert max_diff(r["dgc"]["trace"][-1], dense) > 1e-4  # sparse updates, not dense ones
    assert max_diff(results[0]["dgc"]["trace"][-1], results[1]["dgc"]["trace"][-1]) == 0


def test_amp_keeps_the_ranks_identical_and_moves_off_float32(ranks):
    name, results = ranks
    fp32 = adam_reference(name).state_dict()
    for r in results:
        assert "amp" in r["amp"]["plan"]
        assert max_diff(r["amp"]["state"], {k: v.float() for k, v in fp32.items()}) > 1e-4
    assert max_diff(results[0]["amp"]["state"], results[1]["amp"]["state"]) == 0
