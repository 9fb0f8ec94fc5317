"""The tensor-parallel layers' public signatures, and the layers on a one-process topology.

The signatures are the documented API (docs/model_parallel.md): Paddle's argument order minus
``weight_attr`` / ``name``, with fleetx's keyword-only ``mp_group`` (and ``device`` / ``dtype``,
as for ``nn.Linear``; the embedding's ``padding_idx`` as for ``nn.Embedding``). On one process without ``torch.distributed`` the hybrid group's model
group is None: the layers are the unsplit layers, built from the same seed.
"""
from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

from fleetx.fleet import meta_parallel
from fleetx.parallel import HybridCommunicateGroup, set_hcg
from fleetx.parallel.layers import sharded_parameters
from fleetx.strategy.topology import Topology

SIGNATURES = {
    "ColumnParallelLinear": "(in_features, out_features, has_bias=True, gather_output=True, *, "
                            "mp_group=None, device=None, dtype=None)",
    "RowParallelLinear": "(in_features, out_features, has_bias=True, input_is_parallel=False, *, "
                         "mp_group=None, device=None, dtype=None)",
    "VocabParallelEmbedding": "(num_embeddings, embedding_dim, *, mp_group=None, "
                              "padding_idx=None, device=None, dtype=None)",
    "ParallelCrossEntropy": "(*, mp_group=None)",
}


def _bare(fn) -> str:
    """``fn``'s signature without ``self`` and annotations: names, kinds and defaults."""
    sig = inspect.signature(fn)
    params = [p.replace(annotation=inspect.Parameter.empty)
              for p in list(sig.parameters.values())[1:]]
    return str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty))


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_signature(name):
    assert _bare(getattr(meta_parallel, name).__init__) == SIGNATURES[name]


def test_from_unsplit_signatures():
    assert _bare(meta_parallel.ColumnParallelLinear.from_linear.__func__) == \
        "(linear, gather_output=True, *, mp_group=None)"
    assert _bare(meta_parallel.RowParallelLinear.from_linear.__func__) == \
        "(linear, input_is_parallel=False, *, mp_group=None)"
    assert _bare(meta_parallel.VocabParallelEmbedding.from_embedding.__func__) == \
        "(embedding, *, mp_group=None)"


@pytest.fixture
def one_process_topology():
    set_hcg(HybridCommunicateGroup(Topology(dp_degree=1, sharding_degree=1)))
    yield
    set_hcg(None)


def test_one_process_layers_are_the_unsplit_layers(one_process_topology):
    torch.manual_seed(0)
    tp = nn.Sequential(meta_parallel.VocabParallelEmbedding(10, 4),
                       meta_parallel.ColumnParallelLinear(4, 6),
                       meta_parallel.RowParallelLinear(6, 3))
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 6), nn.Linear(6, 3))
    assert tp.state_dict().keys() == plain.state_dict().keys()
    assert all(torch.equal(v, plain.state_dict()[k]) for k, v in tp.state_dict().items())
    ids = torch.tensor([[1, 9, 0]])
    assert torch.equal(tp(ids), plain(ids))
    assert tp[1].world_size == 1 and tp[1].rank == 0
    # the row-parallel bias is replicated, not a shard
    assert [id(p) for p in sharded_parameters(tp)] == [
        id(tp[0].weight), id(tp[1].weight), id(tp[1].bias), id(tp[2].weight)]


def test_one_process_cross_entropy_is_cross_entropy(one_process_topology):
    logits = torch.randn(5, 7, dtype=torch.float64)
    labels = torch.tensor([0, 6, 3, 3, 1])
    got = meta_parallel.ParallelCrossEntropy()(logits, labels[:, None])
    want = nn.functional.cross_entropy(logits, labels, reduction="none")
    assert got.shape == (5, 1) and torch.allclose(got[:, 0], want, atol=1e-12, rtol=0)
