"""A tensor-parallel plan that cannot apply is refused before anything is split, naming the
module (or plan entry) and the numbers; a plan that can apply resolves to the expected modules.

``resolve_plan`` checks without communicating, so these run in one process: Llama's own plan
(4 heads, 2 key/value heads) at degree 2 splits every projection, the embedding and the head;
degree 4 cannot split 2 key/value heads; an unknown style, an entry matching nothing or naming
a parameter, a style on the wrong kind of module, sizes the degree does not divide, a fused
q/k/v projection split by columns, and a tie split two ways are each refused.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
from torch import nn

from fleetx.fleet import meta_parallel
from fleetx.parallel.tp_plan import PlanError, model_plan, resolve_plan

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hf_models  # noqa: E402  (tests/hf_models.py)


class Attn(nn.Module):
    def __init__(self, dim: int = 16, head_dim: int = 4, fused: bool = False) -> None:
        super().__init__()
        self.head_dim = head_dim
        if fused:
            self.c_attn = nn.Linear(dim, 3 * dim)
        else:
            self.q, self.k, self.v = (nn.Linear(dim, dim) for _ in range(3))
        self.proj = nn.Linear(dim, dim)


class Net(nn.Module):
    def __init__(self, fused: bool = False, tied: bool = True) -> None:
        super().__init__()
        self.wte = nn.Embedding(30, 16)
        self.attn = Attn(fused=fused)
        self.mlp = nn.Sequential(nn.Linear(16, 24), nn.GELU(), nn.Linear(24, 16))
        self.head = nn.Linear(16, 30, bias=False)
        if tied:
            self.head.weight = self.wte.weight


def _refused(model, plan, degree) -> str:
    with pytest.raises(PlanError) as err:
        resolve_plan(model, plan, degree)
    return str(err.value)


def test_llama_plan_resolves_to_its_projections_embedding_and_head():
    model = hf_models.llama(n_layer=2)
    plan = model_plan(model)
    found = {a.name: a.style for a in resolve_plan(model, plan, 2)}
    assert found["model.layers.1.self_attn.q_proj"] == "colwise"
    assert found["model.layers.1.self_attn.o_proj"] == "rowwise"
    assert found["model.layers.0.mlp.down_proj"] == "rowwise"
    assert found["model.embed_tokens"] == "embedding_rowwise"
    assert found["lm_head"] == "colwise_gather_output"
    assert len(found) == 2 * 7 + 2  # q k v o gate up down per layer, the embedding, the head


def test_llama_key_value_heads_the_degree_cannot_split_are_named():
    text = _refused(hf_models.llama(n_layer=1), model_plan(hf_models.llama(n_layer=1)), 4)
    assert text.startswith("model.layers.0.self_attn.k_proj (colwise): its 16 features are 2 "
                           "heads of head_dim 8, and 2 heads cannot be split over "
                           "model-parallel degree 4")


def test_unknown_style_names_the_entry_and_the_styles():
    text = _refused(Net(), {"attn.q": "sequence_parallel"}, 2)
    assert "plan entry 'attn.q': style 'sequence_parallel' is not one fleetx carries out" in text
    assert "colwise, colwise_gather_output, colwise_rep, embedding_rowwise, replicate" in text


def test_an_entry_matching_nothing_or_naming_a_parameter_is_named():
    assert "'atn.q' matches no module of Net; closest module names: attn.q" in \
        _refused(Net(), {"atn.q": "colwise"}, 2)
    assert "names parameters (attn.q.weight...); name their module instead (attn.q)" in \
        _refused(Net(), {"attn.q.weight": "colwise"}, 2)


def test_wrong_kind_and_sizes_the_degree_does_not_divide():
    assert _refused(Net(), {"wte": "colwise"}, 2).startswith(
        "wte (Embedding): style 'colwise' (plan entry 'wte') splits an nn.Linear")
    assert _refused(Net(tied=False), {"mlp.0": "colwise"}, 5) == (
        "mlp.0 (colwise): out_features=24 is not divisible by the model-parallel degree 5")
    assert _refused(Net(tied=False), {"wte": "embedding_rowwise"}, 4) == (
        "wte (embedding_rowwise): vocabulary size (num_embeddings)=30 is not divisible by the "
        "model-parallel degree 4")
    assert "4 heads cannot be split over model-parallel degree 8" in \
        _refused(Net(tied=False), {"attn.q": "colwise"}, 8)


def test_a_fused_qkv_projection_split_by_columns_is_refused_with_the_fix():
    text = _refused(Net(fused=True, tied=False), {"attn.c_attn": "colwise"}, 2)
    assert "a fused query/key/value projection cannot be split by columns" in text
    assert "separate q/k/v projections, plan each as 'colwise'" in text


def test_a_tie_split_two_ways_is_refused_and_one_split_alike_is_kept():
    text = _refused(Net(), {"wte": "embedding_rowwise", "head": "rowwise_split_input"}, 2)
    assert text.startswith("tied parameters wte.weight (embedding_rowwise), head.weight "
                           "(rowwise_split_input) would be split differently")
    assert "tied parameters wte.weight (not planned), head.weight (colwise_gather_output)" in \
        _refused(Net(), {"head": "colwise_gather_output"}, 2)
    alike = {"wte": "embedding_rowwise", "head": "colwise_gather_output"}
    assert [a.name for a in resolve_plan(Net(), alike, 2)] == ["wte", "head"]


def test_parallelize_without_a_plan_on_a_model_without_one_says_how_to_give_one():
    with pytest.raises(PlanError, match=r"Net carries no tensor-parallel plan \(_tp_plan\); "
                                        r"pass one: parallelize\(model, "):
        meta_parallel.parallelize(Net())
