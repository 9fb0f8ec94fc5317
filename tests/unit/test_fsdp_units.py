"""Which modules become FSDP2 units at sharding stages 2 and 3 (no processes needed): the
repeated blocks of Hugging Face models and of any model with a block list, ``_no_split_modules``,
the child rule for models without blocks, ``sharding_configs['units']`` by class or glob with its
refusals (exact messages), and the plan that lists the units."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hf_models  # noqa: E402  (tests/hf_models.py)

from fleetx.strategy.algorithms.fsdp_units import describe_units, plan_units  # noqa: E402
from fleetx.strategy.algorithms.sharding_engine import sharding_units  # noqa: E402
from fleetx.strategy.api import ModelInfo, PlanInput, StrategyError, WorldInfo  # noqa: E402
from fleetx.strategy.distributed_strategy import DistributedStrategy  # noqa: E402
from fleetx.strategy.planner import make_plan  # noqa: E402


def units(model: nn.Module, entries=()) -> list[tuple[str, str]]:
    return [(u.name, u.cls) for u in plan_units(ModelInfo.of(model), entries)]


def test_gpt2_units_are_its_blocks_and_the_tied_embedding_and_head_stay_in_the_root():
    model = hf_models.gpt2(n_layer=3)
    assert units(model) == [(f"transformer.h.{i}", "GPT2Block") for i in range(3)]
    # the old child rule found no unit here: transformer is tied to lm_head
    assert model.lm_head.weight is model.transformer.wte.weight


def test_llama_units_are_its_decoder_layers():
    assert units(hf_models.llama(n_layer=3)) == [
        (f"model.layers.{i}", "LlamaDecoderLayer") for i in range(3)]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])  # a list in a block


class Tower(nn.Module):
    """Blocks two levels down, a list of one class only once, and a tied head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 4)
        self.encoder = nn.ModuleDict({"layer": nn.ModuleList([Block(), Block(), Block()])})
        self.single = nn.ModuleList([nn.Linear(4, 4), nn.LayerNorm(4)])
        self.head = nn.Linear(4, 5, bias=False)
        self.head.weight = self.embed.weight


def test_repeated_blocks_anywhere_become_units_outermost_only():
    assert units(Tower()) == [(f"encoder.layer.{i}", "Block") for i in range(3)]


def test_blocks_of_a_module_dict_become_units_as_torchtitan_keeps_them():
    class Titan(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok_embeddings = nn.Embedding(5, 4)
            self.layers = nn.ModuleDict({str(i): Block() for i in range(2)})
            self.output = nn.Linear(4, 5)
    assert units(Titan()) == [("layers.0", "Block"), ("layers.1", "Block")]


def test_no_split_modules_name_units_outside_a_list_and_a_tied_block_stays_in_the_root():
    model = Tower()
    model._no_split_modules = ["LayerNorm"]
    model.encoder.layer[1].experts[0].weight = model.embed.weight  # block 1 now splits a tie
    # block 1 stays in the root; of its own list, the expert outside the tie is a unit
    assert units(model) == [("encoder.layer.0", "Block"), ("encoder.layer.1.experts.1", "Linear"),
                            ("encoder.layer.2", "Block"), ("single.1", "LayerNorm")]


def test_a_model_without_blocks_keeps_the_child_rule():
    model = nn.Sequential(nn.Linear(6, 9), nn.GELU(), nn.Linear(9, 7), nn.GELU(), nn.Linear(7, 3))
    found = plan_units(ModelInfo.of(model))
    assert [(u.name, u.rule) for u in found] == [("0", "children"), ("2", "children"),
                                                 ("4", "children")]
    assert describe_units(found) == ("3 units (3 Linear: each child: no repeated block list) "
                                     "and the root")
    assert sharding_units(model) == [model[0], model[2], model[4]]


def test_entries_by_class_and_by_glob_where_star_stays_in_one_segment():
    model = hf_models.gpt2()
    assert units(model, ["transformer.h.*"]) == [("transformer.h.0", "GPT2Block"),
                                                 ("transformer.h.1", "GPT2Block")]
    assert units(model, ["GPT2MLP", "transformer.h.1"]) == [
        ("transformer.h.0.mlp", "GPT2MLP"), ("transformer.h.1", "GPT2Block"),
        ("transformer.h.1.mlp", "GPT2MLP")]
    assert units(hf_models.llama(), ["model.layers.*.mlp"]) == [
        ("model.layers.0.mlp", "LlamaMLP"), ("model.layers.1.mlp", "LlamaMLP")]


def _refusal(model: nn.Module, entry: str) -> str:
    with pytest.raises(StrategyError) as err:
        plan_units(ModelInfo.of(model), [entry])
    return str(err.value)


def test_an_entry_that_matches_nothing_names_it_and_the_nearest_valid_entries():
    model = hf_models.llama()
    assert _refusal(model, "model.layer.*") == (
        "sharding_configs['units']: 'model.layer.*' matches no module of LlamaForCausalLM (a "
        "class name, or a qualified-name glob where * stays within one segment); nearest "
        "valid: 'model.layers.*', 'model.layers.*.mlp', 'model.layers.*.self_attn'")
    assert "nearest valid: 'LlamaDecoderLayer', " in _refusal(model, "LlamaDecoderLayers")
    assert _refusal(model, "model.rotary_emb") == (
        "sharding_configs['units']: 'model.rotary_emb' matches only modules without parameters "
        "('model.rotary_emb') of LlamaForCausalLM (a class name, or a qualified-name glob where "
        "* stays within one segment); nearest valid: 'model.norm', 'model.layers.*', "
        "'model.layers.*.mlp'")


def test_an_entry_naming_a_container_or_splitting_a_tie_is_refused():
    model = hf_models.gpt2()
    assert _refusal(model, "transformer.h") == (
        "sharding_configs['units']: 'transformer.h' names 'transformer.h', a ModuleList, which "
        "is never called, so FSDP2 would never gather it: name its modules instead "
        "('transformer.h.*' or 'GPT2Block')")
    assert _refusal(model, "lm_head") == (
        "sharding_configs['units']: 'lm_head' makes 'lm_head' (Linear) a unit, but its "
        "parameter 'lm_head.weight' is tied to 'transformer.wte.weight' outside it; a unit of "
        "its own would split the tie into two parameters: leave it out (it stays in the root "
        "with its twin)")
    assert "'transformer.wte' (Embedding) a unit" in _refusal(model, "transformer.wte")


def _plan(model=None, stage: int = 3, **configs):
    s = DistributedStrategy()
    s.sharding = True
    s.sharding_configs = dict(stage=stage, **configs)
    info = ModelInfo.of(model) if model is not None else ModelInfo()
    return make_plan(PlanInput(s, WorldInfo(world_size=2), info))


def _reason(plan) -> str:
    return next(e.reason for e in plan.entries if e.name == "sharding")


@pytest.mark.parametrize("stage", [2, 3])
def test_the_plan_lists_the_units_once_the_model_is_known(stage):
    assert _reason(_plan(stage=stage)).endswith(
        "units: chosen when the model is given to fleet.distributed_model")
    assert _reason(_plan(hf_models.llama(n_layer=4), stage)).endswith(
        "units: 4 units (4 LlamaDecoderLayer: the repeated blocks) and the root")
    assert _reason(_plan(hf_models.gpt2(), stage, units=["GPT2MLP"])).endswith(
        "units: 2 units (2 GPT2MLP: sharding_configs['units']) and the root")


def test_the_plan_refuses_a_bad_entry_and_stage_1_ignores_units():
    with pytest.raises(StrategyError, match="sharding: sharding_configs\\['units'\\]: "
                                            "'GPT2Blocks' matches no module"):
        _plan(hf_models.gpt2(), units=["GPT2Blocks"])
    assert "units" not in _reason(_plan(hf_models.gpt2(), stage=1, units=["GPT2Blocks"]))


def test_units_must_be_a_list_of_names():
    s = DistributedStrategy()
    with pytest.raises(TypeError, match=r"sharding_configs\['units'\] must be a list of str, "
                                        r"got str 'GPT2Block'"):
        s.sharding_configs = {"units": "GPT2Block"}
