"""ShardedClassifier on 2 processes against a plain one-process head with the same margin.

The reference head below computes the full ``[N, C]`` logits and applies the margin the way PLSC
writes it (``theta = acos(cos)``, then ``cos(theta + m)`` or ``cos - m``, put in with a one-hot
mask) before ``F.cross_entropy``: a different formulation from the module's (no ``acos``, a
scatter on the owning rank, the parallel cross entropy). Each rank builds its shard of the same
full weight (``from_weight``), runs forward and backward with the same features, labels and
upstream gradient as the parent, and saves its loss, feature gradient, shard gradient and
predictions; the parent puts the shards together and compares (float64 and float32, 1e-5).
One spawn runs every case; the errors that need a group of 2 are recorded there too.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spawn import run_and_load  # noqa: E402

WORLD, IN, CLASSES, N = 2, 5, 8, 6
LABELS = torch.tensor([0, 7, 3, 4, 5, 1])  # both ranks' halves of the 8 classes
MARGINS = {"softmax": (1.0, 0.0), "arcface": (64.0, 0.5), "cosface": (64.0, 0.4)}
DTYPES = {"float64": torch.float64, "float32": torch.float32}
TOL = 1e-5


def _data(seed: int, *shape: int, dtype=torch.float64) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _inputs(dtype: torch.dtype, singular: bool = False) -> tuple:
    """Full weight, features, upstream gradient. Classes 1 and 5 share a weight row (a tie
    across the two ranks for predict); with ``singular``, sample 5's feature lies on that row
    (cos = 1, where acos' derivative is infinite) and is labelled 5."""
    weight = _data(1, CLASSES, IN)
    weight[5] = weight[1]
    features = _data(2, N, IN)
    if singular:
        features[5] = 3 * weight[1]
    return weight.to(dtype), features.to(dtype), _data(3, N).to(dtype)


def reference_loss(weight, features, labels, margin: str) -> torch.Tensor:
    """The unsharded head: full logits, PLSC's margin, ``F.cross_entropy`` per sample."""
    scale, m = MARGINS[margin]
    if margin == "softmax":
        logits = features @ weight.T
    else:
        cos = (F.normalize(features, dim=-1) @ F.normalize(weight, dim=-1).T).clamp(-1, 1)
        if margin == "arcface":
            target = torch.cos(torch.acos(cos) + m)
        else:
            target = cos - m
        one_hot = F.one_hot(labels, CLASSES).to(cos.dtype)
        logits = cos + one_hot * (target - cos)
    return F.cross_entropy(logits * scale, labels, reduction="none")


def reference_predict(weight, features, margin: str) -> torch.Tensor:
    if margin == "softmax":
        return (features @ weight.T).argmax(-1)
    return (F.normalize(features, dim=-1) @ F.normalize(weight, dim=-1).T).argmax(-1)


def _case(group, margin: str, dtype: torch.dtype, singular: bool = False) -> dict:
    from fleetx.parallel.classifier import ShardedClassifier
    weight, features, upstream = _inputs(dtype, singular)
    head = ShardedClassifier.from_weight(weight, margin, mp_group=group)
    x = features.clone().requires_grad_()
    loss = head(x, LABELS)
    (loss * upstream).sum().backward()
    return {"loss": loss.detach(), "x_grad": x.grad, "w_grad": head.weight.grad,
            "predict": head.predict(features), "range": head.class_range,
            "loss_n1": head(features, LABELS[:, None]).detach()}


def _message(fn) -> str:
    try:
        fn()
    except Exception as error:  # noqa: BLE001  (the parent checks the type and the text)
        return f"{type(error).__name__}: {error}"
    return "no error"


def _work(rank: int, world: int, out: str) -> None:
    import torch.distributed as dist

    from fleetx.parallel.classifier import ShardedClassifier
    dist.init_process_group("gloo")  # the env:// variables spawn.py sets
    group = dist.new_group(list(range(world)))
    cases = {(m, d): _case(group, m, dt) for m in MARGINS for d, dt in DTYPES.items()}
    cases.update({(m, "singular"): _case(group, m, torch.float64, True) for m in MARGINS})
    torch.manual_seed(7)
    seeded = ShardedClassifier(IN, 10_000, "arcface", mp_group=group).weight.detach()
    head = ShardedClassifier(IN, CLASSES, "cosface", mp_group=group)
    errors = {"classes": _message(lambda: ShardedClassifier(IN, 7, "arcface", mp_group=group)),
              "label": _message(lambda: head(torch.zeros(2, IN), torch.tensor([1, 8])))}
    torch.save({"cases": cases, "seeded": seeded, "errors": errors}, f"{out}/rank{rank}.pt")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_and_load(_work, WORLD, tmp_path_factory.mktemp("plsc"), deadline=240)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    # relative to the largest magnitude: float32 gradients of size ~30 differ by ~1e-4 when
    # the two sides sum in another order (another number of threads), which is rounding
    scale = max(1.0, b.double().abs().max().item())
    return a.shape == b.shape and (a.double() - b.double()).abs().max().item() <= TOL * scale


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("margin", sorted(MARGINS))
def test_sharded_head_equals_the_unsharded_head(ranks, margin, dtype):
    weight, features, upstream = _inputs(DTYPES[dtype])
    weight.requires_grad_()
    x = features.clone().requires_grad_()
    loss = reference_loss(weight, x, LABELS, margin)
    (loss * upstream).sum().backward()
    got = [r["cases"][(margin, dtype)] for r in ranks]
    for r in got:  # every rank: the whole per-sample loss and the whole feature gradient
        assert r["loss"].dtype == DTYPES[dtype]
        assert _close(r["loss"], loss.detach()) and _close(r["loss_n1"], loss.detach()[:, None])
        assert _close(r["x_grad"], x.grad)
    assert [r["range"] for r in got] == [(0, 4), (4, 8)]
    assert _close(torch.cat([r["w_grad"] for r in got]), weight.grad)
    assert loss.detach().abs().max() > 0.1 and weight.grad.abs().max() > 0.01  # not vacuous


@pytest.mark.parametrize("margin", sorted(MARGINS))
def test_a_feature_on_its_class_centre(ranks, margin):
    """cos = 1 (up to rounding): the loss is the reference's and every gradient is finite
    (ArcFace's slope d cos(theta + m) / d cos is infinite at theta = 0; the clamped sine keeps
    it finite); the other samples' feature gradients are the reference's."""
    weight, features, upstream = _inputs(torch.float64, singular=True)
    weight.requires_grad_()
    x = features.clone().requires_grad_()
    loss = reference_loss(weight, x, LABELS, margin)
    (loss * upstream).sum().backward()
    for r in ranks:
        got = r["cases"][(margin, "singular")]
        assert _close(got["loss"], loss.detach())
        assert torch.isfinite(got["x_grad"]).all() and torch.isfinite(got["w_grad"]).all()
        assert _close(got["x_grad"][:5], x.grad[:5])


@pytest.mark.parametrize("margin", sorted(MARGINS))
def test_predictions_equal_the_argmax_of_the_full_logits(ranks, margin):
    weight, features, _ = _inputs(torch.float64, singular=True)
    want = reference_predict(weight, features, margin)
    for r in ranks:
        got = r["cases"][(margin, "singular")]["predict"]
        assert got.dtype == torch.int64 and torch.equal(got, want)
    # classes 1 (rank 0) and 5 (rank 1) tie on sample 5: the smaller id, as torch.argmax
    assert want[5].item() == 1


def test_seeded_shards_form_the_one_process_weight(ranks):
    """The same torch.manual_seed gives the same full weight at mp 2 as at mp 1."""
    from fleetx.parallel import HybridCommunicateGroup, set_hcg
    from fleetx.parallel.classifier import ShardedClassifier
    from fleetx.strategy.topology import Topology
    set_hcg(HybridCommunicateGroup(Topology(dp_degree=1, sharding_degree=1)))
    try:
        torch.manual_seed(7)
        full = ShardedClassifier(IN, 10_000, "arcface").weight.detach()
    finally:
        set_hcg(None)
    assert torch.equal(torch.cat([r["seeded"] for r in ranks]), full)
    assert abs(full.std().item() - math.sqrt(2 / (IN + 10_000))) < 1e-3


def test_errors_on_two_ranks(ranks):
    for r in ranks:
        e = r["errors"]
        assert e["classes"].startswith("ValueError: ShardedClassifier: num_classes=7 is not "
                                       "divisible by the model-parallel degree 2")
        assert e["label"].startswith("ValueError: ParallelCrossEntropy: label 8 is outside "
                                     "the classes [0, 8)")
