"""Sharding stage 3 on Hugging Face models shards their blocks (2 processes, float64, Adam).

``GPT2LMHeadModel`` (4 blocks) with the default units: ``fleet.explain()`` says the units come
with the model before ``distributed_model`` and lists them after; the FSDP2 units are exactly
the root and ``transformer.h.*``; the parameters gathered on a rank during a forward never
exceed the root plus two blocks (and are below the whole model: the saving is real); after
the steps the parameters equal one process trained on the union batch (1e-9, a formula).
``LlamaForCausalLM`` with ``sharding_configs['units']`` naming nested units (each decoder layer
and its MLP, by glob and by class) keeps the same contract; wrapping it again with other units
is refused. One spawn runs both.
"""
from __future__ import annotations

import io
import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hf_models  # noqa: E402  (tests/hf_models.py)
from spawn import max_diff, run_and_load  # noqa: E402

WORLD, B, STEPS, LR = 2, 2, 3, 1e-2
CASES = {  # name: (factory, layers, sharding_configs['units'], the units expected)
    "gpt2": (hf_models.gpt2, 4, [], [f"transformer.h.{i}" for i in range(4)]),
    "llama": (hf_models.llama, 2, ["model.layers.*", "LlamaMLP"],
              ["model.layers.0", "model.layers.0.mlp", "model.layers.1", "model.layers.1.mlp"]),
}


def make(name: str) -> torch.nn.Module:
    factory, layers = CASES[name][:2]
    return factory(n_layer=layers).to(torch.float64)


def data() -> list:
    return [hf_models.batch(WORLD * B, seed=1 + i) for i in range(STEPS)]


def reference(name: str) -> dict:
    """One process, plain Adam, each step on the union of the ranks' batches."""
    model = make(name)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    for x in data():
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def _explain(fleet) -> str:
    out = io.StringIO()
    fleet.explain(file=out)
    return out.getvalue()


def _peak_forward(model, x) -> int:
    """The most parameter bytes gathered at any module boundary of one forward."""
    from fleetx.strategy.algorithms.sharding_engine import gathered_bytes
    peak = [0]

    def note(*_):
        peak[0] = max(peak[0], gathered_bytes(model))
    handles = [m.register_forward_pre_hook(note) for m in model.modules()]
    handles += [m.register_forward_hook(note) for m in model.modules()]
    model(input_ids=x, labels=x)
    for h in handles:
        h.remove()
    return peak[0]


def _case(rank: int, name: str) -> dict:
    from torch.distributed.fsdp import FSDPModule

    from fleetx import fleet
    s = fleet.DistributedStrategy()
    s.sharding = True
    s.sharding_configs = {"stage": 3, "units": CASES[name][2]}
    fleet.init(is_collective=True, strategy=s)
    before = _explain(fleet)
    plain = make(name)
    model = fleet.distributed_model(plain)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = fleet.distributed_optimizer(torch.optim.Adam(model.parameters(), lr=LR))
    sl = slice(rank * B, (rank + 1) * B)
    peak = _peak_forward(model, data()[0][sl])
    opt.clear_grad()  # the measured forward built no graph that steps: only its hooks
    for x in data():
        opt.minimize(model(input_ids=x[sl], labels=x[sl]).loss)
    return {"before": before, "after": _explain(fleet), "peak": peak,
            "units": [n for n, m in plain.named_modules() if isinstance(m, FSDPModule)],
            "state": model.state_dict(), "changed": _units_changed(fleet, plain)}


def _units_changed(fleet, sharded) -> str:
    """The error of wrapping the sharded model again with other units."""
    from fleetx.strategy.api import StrategyError
    s = fleet.DistributedStrategy()
    s.sharding = True
    s.sharding_configs = {"stage": 3, "units": ["*.*.0"]}
    fleet.init(is_collective=True, strategy=s)
    try:
        fleet.distributed_model(sharded)
    except StrategyError as err:
        return str(err)
    return ""


def _cases(rank: int, world: int, out: str) -> None:
    torch.save({name: _case(rank, name) for name in CASES}, f"{out}/rank{rank}.pt")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    hf_models.transformers()
    return run_and_load(_cases, WORLD, tmp_path_factory.mktemp("units"))


def _bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def test_explain_names_the_units_once_the_model_is_given(ranks):
    for r in ranks:
        assert "units: chosen when the model is given to fleet.distributed_model" in (
            r["gpt2"]["before"])
        assert "units: 4 units (4 GPT2Block: the repeated blocks) and the root" in (
            r["gpt2"]["after"])
        assert ("units: 4 units (2 LlamaDecoderLayer, 2 LlamaMLP: sharding_configs['units']) "
                "and the root") in r["llama"]["after"]


@pytest.mark.parametrize("name", list(CASES))
def test_the_units_are_sharded_and_stage3_equals_one_process_on_the_union_batch(ranks, name):
    want = reference(name)
    assert max_diff(want, make(name).state_dict()) > 1e-3  # the steps moved the parameters
    for r in ranks:
        assert r[name]["units"] == [""] + CASES[name][3]
        assert set(r[name]["state"]) == set(want)
        assert max_diff(r[name]["state"], want) <= 1e-9


def test_other_units_for_a_sharded_model_are_refused(ranks):
    for r in ranks:
        assert r["llama"]["changed"] == (
            "sharding: the model was already sharded with sharding_configs['units'] = "
            "['model.layers.*', 'LlamaMLP'] and is now asked for ['*.*.0']; sharding cannot be "
            "undone: wrap a fresh model")


def test_the_forward_gathers_at_most_the_root_and_two_blocks(ranks):
    model = make("gpt2")
    block = _bytes(model.transformer.h[0])
    root = _bytes(model) - len(model.transformer.h) * block
    for r in ranks:
        assert root + block <= r["gpt2"]["peak"] <= root + 2 * block < _bytes(model)
