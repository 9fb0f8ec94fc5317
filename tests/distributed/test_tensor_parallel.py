"""Tensor-parallel layers on 2 processes against their unsplit counterparts.

Each rank builds its shard of an unsplit float64 layer (``from_linear`` / ``from_embedding``),
runs forward and backward with the same input and upstream gradient as the parent, and saves
its output, input gradient and shard gradients; the parent puts the shards together and
compares with the unsplit layer run in one process (1e-6). ``ParallelCrossEntropy`` is compared
with ``torch.nn.functional.cross_entropy`` over the full logits; a 2-layer MLP
(``ColumnParallelLinear(gather_output=False)`` + ``RowParallelLinear(input_is_parallel=True)``)
trains like the unsplit MLP under SGD with momentum and under Adam (1e-5, float32). The errors
are recorded in the ranks and checked here. The tensor-parallelism example of
docs/model_parallel.md runs first, as written (``fleet.init`` with ``mp_degree`` 2, the layers on
the topology's model-parallel group): every rank gets the losses of the unsplit model built
after the same seed and trained on one process (1e-5, float32).

One spawn runs every case; the parent compares.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spawn import run_and_load  # noqa: E402

WORLD, IN, OUT, VOCAB, DIM, N, STEPS = 2, 6, 8, 10, 4, 5, 4
TOL = 1e-6
DOC = Path(__file__).resolve().parents[2] / "docs" / "model_parallel.md"


def _data(seed: int, *shape: int, dtype=torch.float64) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _linear(seed: int, fan_in: int, fan_out: int, bias: bool = True) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(fan_in, fan_out, bias=bias).double()


def _embedding() -> nn.Embedding:
    torch.manual_seed(3)
    return nn.Embedding(VOCAB, DIM).double()


IDS = torch.tensor([[0, 4, 5, 9], [9, 9, 2, 7]])  # both ranks' rows, a repeated id
LABELS = torch.tensor([0, 7, 3, 4, 7])  # both halves of OUT = 8 classes


def _run(layer: nn.Module, x: torch.Tensor, upstream: torch.Tensor) -> dict:
    x = x.clone().requires_grad_(x.is_floating_point())
    y = layer(x)
    (y * upstream).sum().backward()
    return {"y": y.detach(), "x_grad": None if x.grad is None else x.grad.clone(),
            **{f"{k}_grad": p.grad.clone() for k, p in layer.named_parameters()}}


def _layer_cases(rank: int, group) -> dict:
    from fleetx.parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                        VocabParallelEmbedding)
    x, g_col, g_row = _data(1, N, IN), _data(2, N, OUT), _data(4, N, OUT)
    half = slice(rank * OUT // WORLD, (rank + 1) * OUT // WORLD)
    col = ColumnParallelLinear.from_linear(_linear(0, IN, OUT), mp_group=group)
    col_part = ColumnParallelLinear.from_linear(_linear(0, IN, OUT), gather_output=False,
                                                mp_group=group)
    row = RowParallelLinear.from_linear(_linear(5, OUT, OUT), mp_group=group)
    row_part = RowParallelLinear.from_linear(_linear(5, OUT, OUT), input_is_parallel=True,
                                             mp_group=group)
    emb = VocabParallelEmbedding.from_embedding(_embedding(), mp_group=group)
    return {"column": _run(col, x, g_col), "column_part": _run(col_part, x, g_col[:, half]),
            "row": _run(row, _data(3, N, OUT), g_row),
            "row_part": _run(row_part, _data(3, N, OUT)[:, half], g_row),
            "embedding": _run(emb, IDS, _data(6, 2, 4, DIM))}


def _init_cases(group) -> dict:
    """Built from the seed (not from an unsplit layer): the shard and the generator's state."""
    from fleetx.parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                        VocabParallelEmbedding)
    out = {}
    for name, build in (("column", lambda: ColumnParallelLinear(IN, OUT, mp_group=group)),
                        ("row", lambda: RowParallelLinear(OUT, IN, mp_group=group)),
                        ("embedding", lambda: VocabParallelEmbedding(VOCAB, DIM,
                                                                     mp_group=group))):
        torch.manual_seed(11)
        layer = build()
        out[name] = {"state": layer.state_dict(), "next": torch.rand(3)}
    return out


CE_CASES = ("flat", "column", "3d")


def _ce_inputs(name: str) -> tuple:
    """Full float64 logits and labels of a cross-entropy case."""
    if name == "3d":
        return _data(8, 2, N, OUT), torch.stack([LABELS, LABELS.flip(0)])
    if name == "column":  # exp() of logits near 1000 overflows even in float64; the loss must not
        return _data(7, N, OUT) + 1000, LABELS[:, None]
    return _data(7, N, OUT), LABELS


def _cross_entropy_cases(rank: int, group) -> dict:
    from fleetx.parallel.cross_entropy import ParallelCrossEntropy
    ce, out = ParallelCrossEntropy(mp_group=group), {}
    half = slice(rank * OUT // WORLD, (rank + 1) * OUT // WORLD)
    for name in CE_CASES:
        logits, labels = _ce_inputs(name)
        part = logits[..., half].clone().requires_grad_()
        loss = ce(part, labels)
        (loss * _data(9, *loss.shape)).sum().backward()
        out[name] = {"loss": loss.detach(), "grad": part.grad}
    return out


def _train(model: nn.Module, opt_name: str) -> dict:
    """``STEPS`` steps of MSE regression (float32); the losses and the final state."""
    opt = _optimizer(opt_name, model)
    losses = []
    for step in range(STEPS):
        x = _data(30 + step, 16, IN, dtype=torch.float32)
        y = _data(40 + step, 16, IN, dtype=torch.float32)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "state": model.state_dict()}


def _mlp(rank: int, group, opt_name: str) -> dict:
    from fleetx.parallel.layers import ColumnParallelLinear, RowParallelLinear
    fc1, fc2 = _linear(20, IN, OUT).float(), _linear(21, OUT, IN).float()
    return _train(nn.Sequential(
        ColumnParallelLinear.from_linear(fc1, gather_output=False, mp_group=group), nn.Tanh(),
        RowParallelLinear.from_linear(fc2, input_is_parallel=True, mp_group=group)), opt_name)


def _optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return torch.optim.Adam(model.parameters(), lr=0.01)


def _message(fn) -> str:
    try:
        fn()
    except Exception as error:  # noqa: BLE001  (the parent checks the type and the text)
        return f"{type(error).__name__}: {error}"
    return "no error"


def _error_cases(group) -> dict:
    from fleetx.parallel import set_hcg
    from fleetx.parallel.cross_entropy import ParallelCrossEntropy
    from fleetx.parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                        VocabParallelEmbedding)
    emb = VocabParallelEmbedding(VOCAB, DIM, mp_group=group)
    ce = ParallelCrossEntropy(mp_group=group)
    set_hcg(None)
    return {
        "column": _message(lambda: ColumnParallelLinear(4, 7, mp_group=group)),
        "column_from": _message(lambda: ColumnParallelLinear.from_linear(nn.Linear(4, 5),
                                                                         mp_group=group)),
        "row": _message(lambda: RowParallelLinear(5, 4, mp_group=group)),
        "embedding": _message(lambda: VocabParallelEmbedding(9, 4, mp_group=group)),
        "no_group": _message(lambda: ColumnParallelLinear(4, 8)),
        "no_group_ce": _message(lambda: ParallelCrossEntropy()),
        "id": _message(lambda: emb(torch.tensor([3, VOCAB]))),
        "label": _message(lambda: ce(torch.zeros(2, 4), torch.tensor([1, 8]))),
        "label_shape": _message(lambda: ce(torch.zeros(2, 4), torch.tensor([[1, 2]]))),
        "label_type": _message(lambda: ce(torch.zeros(2, 4), torch.tensor([1.0, 2.0]))),
    }


def _example() -> str:
    section = DOC.read_text(encoding="utf-8").split("## Tensor parallelism", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def _doc_case() -> dict:
    scope: dict = {}
    exec(compile(_example(), str(DOC), "exec"), scope)  # calls fleet.init: the world's group
    return {"losses": scope["losses"], "head": tuple(scope["model"][4].weight.shape)}


def _work(rank: int, world: int, out: str) -> None:
    import torch.distributed as dist
    doc = _doc_case()
    group = dist.new_group(list(range(world)))
    results = {"doc": doc, "layers": _layer_cases(rank, group), "init": _init_cases(group),
               "ce": _cross_entropy_cases(rank, group),
               "mlp": {o: _mlp(rank, group, o) for o in ("sgd", "adam")},
               "errors": _error_cases(group)}
    torch.save(results, f"{out}/rank{rank}.pt")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_and_load(_work, WORLD, tmp_path_factory.mktemp("tp"), deadline=240)


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = TOL) -> bool:
    return a.shape == b.shape and (a - b).abs().max().item() <= tol


def test_column_parallel_linear_equals_nn_linear(ranks):
    ref = _run(_linear(0, IN, OUT), _data(1, N, IN), _data(2, N, OUT))
    got = [r["layers"]["column"] for r in ranks]
    part = [r["layers"]["column_part"] for r in ranks]
    for r in got:
        assert _close(r["y"], ref["y"]) and _close(r["x_grad"], ref["x_grad"])
    for key in ("weight_grad", "bias_grad"):  # rank r holds rows [r*out/mp, (r+1)*out/mp)
        assert _close(torch.cat([r[key] for r in got]), ref[key])
        assert _close(torch.cat([r[key] for r in part]), ref[key])
    assert _close(torch.cat([r["y"] for r in part], dim=-1), ref["y"])
    for r in part:  # each rank's partial input gradient, summed over the group
        assert _close(r["x_grad"], ref["x_grad"])
    assert ref["weight_grad"].abs().max() > 0.1  # a vacuous comparison would pass too


def test_row_parallel_linear_equals_nn_linear(ranks):
    ref = _run(_linear(5, OUT, OUT), _data(3, N, OUT), _data(4, N, OUT))
    for case in ("row", "row_part"):
        got = [r["layers"][case] for r in ranks]
        for r in got:
            assert _close(r["y"], ref["y"]) and _close(r["bias_grad"], ref["bias_grad"])
        # rank r holds the matching columns; the bias is the full bias on every rank
        assert _close(torch.cat([r["weight_grad"] for r in got], dim=1), ref["weight_grad"])
        x_grad = [r["x_grad"] for r in got]
        if case == "row":
            assert all(_close(g, ref["x_grad"]) for g in x_grad)
        else:
            assert _close(torch.cat(x_grad, dim=-1), ref["x_grad"])


def test_vocab_parallel_embedding_equals_nn_embedding(ranks):
    ref = _run(_embedding(), IDS, _data(6, 2, 4, DIM))
    got = [r["layers"]["embedding"] for r in ranks]
    for r in got:
        assert _close(r["y"], ref["y"])
    assert _close(torch.cat([r["weight_grad"] for r in got]), ref["weight_grad"])
    assert (ref["weight_grad"][9] != 0).all()  # the repeated id's rows add up


def test_seeded_construction_gives_the_unsplit_initialisation(ranks):
    unsplit = {"column": lambda: nn.Linear(IN, OUT), "row": lambda: nn.Linear(OUT, IN),
               "embedding": lambda: nn.Embedding(VOCAB, DIM)}
    along = {"column": {"weight": 0, "bias": 0}, "row": {"weight": 1, "bias": None},
             "embedding": {"weight": 0}}
    for name, build in unsplit.items():
        torch.manual_seed(11)
        full = build().state_dict()
        after = torch.rand(3)
        for key, dim in along[name].items():
            shards = [r["init"][name]["state"][key] for r in ranks]
            if dim is None:  # replicated
                assert all(torch.equal(s, full[key]) for s in shards)
            else:
                assert torch.equal(torch.cat(shards, dim=dim), full[key])
        # the generator ends where the unsplit layer leaves it: later draws are the same
        assert all(torch.equal(r["init"][name]["next"], after) for r in ranks)


@pytest.mark.parametrize("name", CE_CASES)
def test_parallel_cross_entropy_equals_cross_entropy(ranks, name):
    logits, labels = _ce_inputs(name)
    logits.requires_grad_()
    loss = F.cross_entropy(logits.reshape(-1, OUT), labels.reshape(-1),
                           reduction="none").reshape(labels.shape)
    (loss * _data(9, *loss.shape)).sum().backward()
    got = [r["ce"][name] for r in ranks]
    for r in got:  # per-sample, in the labels' shape ([N, 1] for [N, 1] labels), float64
        assert r["loss"].dtype == torch.float64
        assert _close(r["loss"], loss.detach())
    assert _close(torch.cat([r["grad"] for r in got], dim=-1), logits.grad)
    assert torch.isfinite(logits.grad).all() and logits.grad.abs().max() > 0.01


@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_parallel_mlp_trains_like_the_unsplit_mlp(ranks, opt_name):
    ref = _train(nn.Sequential(_linear(20, IN, OUT).float(), nn.Tanh(),
                               _linear(21, OUT, IN).float()), opt_name)
    got = [r["mlp"][opt_name] for r in ranks]
    for r in got:
        assert max(abs(a - b) for a, b in zip(r["losses"], ref["losses"])) <= 1e-5
    state = ref["state"]
    assert _close(torch.cat([r["state"]["0.weight"] for r in got]), state["0.weight"], 1e-5)
    assert _close(torch.cat([r["state"]["0.bias"] for r in got]), state["0.bias"], 1e-5)
    assert _close(torch.cat([r["state"]["2.weight"] for r in got], dim=1), state["2.weight"],
                  1e-5)
    assert all(_close(r["state"]["2.bias"], state["2.bias"], 1e-5) for r in got)
    # the steps moved the weights (equality of untouched layers would prove nothing)
    assert (state["0.weight"] - _linear(20, IN, OUT).weight.float()).abs().max() > 1e-2


def test_errors_name_the_numbers_and_the_way_out(ranks):
    for r in ranks:
        e = r["errors"]
        assert e["column"].startswith("ValueError: ColumnParallelLinear: out_features=7 is "
                                      "not divisible by the model-parallel degree 2")
        assert "out_features=5" in e["column_from"]
        assert e["row"].startswith("ValueError: RowParallelLinear: in_features=5 is not "
                                   "divisible by the model-parallel degree 2")
        assert "num_embeddings=9" in e["embedding"] and "degree 2" in e["embedding"]
        for key, who in (("no_group", "ColumnParallelLinear"),
                         ("no_group_ce", "ParallelCrossEntropy")):
            assert e[key].startswith(f"NoHybridGroupError: {who} has no model-parallel group")
            assert "fleet.init(" in e[key] and "mp_degree" in e[key] and "mp_group=" in e[key]
        assert e["id"] == (f"IndexError: VocabParallelEmbedding: id {VOCAB} is outside the "
                           f"vocabulary [0, {VOCAB})")
        assert e["label"].startswith("ValueError: ParallelCrossEntropy: label 8 is outside "
                                     "the classes [0, 8)")
        assert e["label_shape"].startswith("ValueError: ParallelCrossEntropy: labels of shape "
                                           "(1, 2) do not match logits of shape (2, 4)")
        assert e["label_type"].startswith("TypeError: ParallelCrossEntropy: labels must be "
                                          "integer class ids")


def _unsplit_doc_losses() -> list:
    vocab, width = 1000, 64
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(vocab, width), nn.Linear(width, 4 * width), nn.GELU(),
                          nn.Linear(4 * width, width), nn.Linear(width, vocab, bias=False))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, vocab, (8, 17), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(3):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_the_documented_example_trains_like_the_unsplit_model(ranks):
    want = _unsplit_doc_losses()
    assert want[-1] < want[0]  # the steps trained (equal untrained losses would prove little)
    for r in ranks:
        assert r["doc"]["head"] == (500, 64)  # each rank holds half of the vocabulary head
        assert max(abs(a - b) for a, b in zip(r["doc"]["losses"], want)) <= 1e-5
