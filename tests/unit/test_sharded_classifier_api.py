"""ShardedClassifier's public signature, its errors, and the head on a one-process topology.

The errors that need a group of 2 (a class count the degree does not divide) are checked in
tests/distributed/test_sharded_classifier.py; here the argument checks that come first.
"""
from __future__ import annotations

import inspect

import pytest
import torch
from torch.nn import functional as F

from fleetx.fleet import meta_parallel
from fleetx.parallel import HybridCommunicateGroup, NoHybridGroupError, set_hcg
from fleetx.parallel.classifier import ShardedClassifier
from fleetx.strategy.topology import Topology


@pytest.fixture
def one_process_topology():
    set_hcg(HybridCommunicateGroup(Topology(dp_degree=1, sharding_degree=1)))
    yield
    set_hcg(None)


def test_signature_and_exports():
    import fleetx.parallel
    assert meta_parallel.ShardedClassifier is ShardedClassifier
    assert fleetx.parallel.ShardedClassifier is ShardedClassifier
    params = list(inspect.signature(ShardedClassifier.__init__).parameters.values())[1:]
    assert [(p.name, p.default) for p in params] == [
        ("in_features", inspect.Parameter.empty), ("num_classes", inspect.Parameter.empty),
        ("margin", "softmax"), ("scale", None), ("margin_m", None), ("mp_group", None),
        ("dtype", None)]
    assert params[5].kind is inspect.Parameter.KEYWORD_ONLY


def test_defaults_are_plsc_s(one_process_topology):
    arc = ShardedClassifier(4, 6, "arcface")
    cos = ShardedClassifier(4, 6, "cosface")
    soft = ShardedClassifier(4, 6)
    assert (arc.scale, arc.margin_m) == (64.0, 0.5)
    assert (cos.scale, cos.margin_m) == (64.0, 0.4)
    assert (soft.scale, soft.margin_m) == (1.0, 0.0)


@pytest.mark.parametrize("kwargs, message", [
    ({"margin": "sphereface"}, "ShardedClassifier: margin='sphereface' is not one of "
                               "'softmax', 'arcface', 'cosface'"),
    ({"margin": "softmax", "margin_m": 0.3}, "ShardedClassifier: margin_m=0.3 has no meaning "
                                              "for margin='softmax'"),
    ({"margin": "arcface", "scale": 0}, "ShardedClassifier: scale=0.0 must be > 0"),
    ({"margin": "arcface", "margin_m": -0.1}, "ShardedClassifier: margin_m=-0.1 must be in "
                                              "[0, pi)"),
    ({"margin": "cosface", "margin_m": 4.0}, "ShardedClassifier: margin_m=4.0 must be in "
                                             "[0, pi)"),
])
def test_bad_arguments_name_the_value_and_the_choices(kwargs, message):
    with pytest.raises(ValueError) as info:
        ShardedClassifier(4, 6, **kwargs)
    assert str(info.value).startswith(message)


@pytest.mark.parametrize("name, args", [("in_features", (0, 6)), ("num_classes", (4, 2.5)),
                                        ("num_classes", (4, True))])
def test_sizes_must_be_positive_ints(name, args):
    with pytest.raises(ValueError, match=f"ShardedClassifier: {name}=.* must be a positive int"):
        ShardedClassifier(*args)


def test_no_group_says_how_to_get_one():
    with pytest.raises(NoHybridGroupError) as info:
        ShardedClassifier(4, 6, "arcface")
    text = str(info.value)
    assert text.startswith("ShardedClassifier has no model-parallel group")
    assert "fleet.init(" in text and "mp_degree" in text and "mp_group=" in text


def test_features_of_the_wrong_width(one_process_topology):
    head = ShardedClassifier(4, 6, "arcface")
    with pytest.raises(ValueError, match=r"features of shape \(3, 5\); expected \[N, 4\]"):
        head(torch.zeros(3, 5), torch.zeros(3, dtype=torch.long))


def test_one_process_arcface_is_the_textbook_formula(one_process_topology):
    """mp 1: the loss is cross entropy over s*cos with the target's cos replaced by cos(acos+m)."""
    torch.manual_seed(0)
    head = ShardedClassifier(4, 6, "arcface").double()
    x = torch.randn(5, 4, dtype=torch.float64)
    y = torch.tensor([0, 5, 2, 2, 3])
    cos = F.normalize(x, dim=-1) @ F.normalize(head.weight.detach(), dim=-1).T
    cos[range(5), y] = torch.cos(torch.acos(cos[range(5), y]) + 0.5)
    want = F.cross_entropy(64 * cos, y, reduction="none")
    assert (head(x, y) - want).abs().max() < 1e-10
    assert torch.equal(head.predict(x), (F.normalize(x, dim=-1) @ F.normalize(
        head.weight.detach(), dim=-1).T).argmax(-1))
