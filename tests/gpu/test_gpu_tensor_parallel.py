"""The tensor-parallel layers on CUDA (Megatron-style splits over the model-parallel group):

* one process (``fleet.init`` with ``mp_degree`` 1, NCCL picked, no collective to run):
  ``ColumnParallelLinear``, ``RowParallelLinear``, ``VocabParallelEmbedding`` and
  ``ParallelCrossEntropy`` built on CUDA from unsplit float64 layers give the outputs and
  gradients of ``nn.Linear`` / ``nn.Embedding`` / ``F.cross_entropy`` on CUDA (1e-9), and a
  column + row MLP trains like the unsplit one (float32, Adam, 1e-5); the model-parallel random
  streams carry the CUDA generator: a draw inside a stream comes from the stream's seed and
  the global CUDA generator resumes where it was;
* two ranks over NCCL (``mp_degree`` 2, one GPU each): the same cases, the shards put
  together, equal the unsplit layers on one GPU. NCCL refuses two ranks on one GPU, so this
  case needs two GPUs and skips with fewer.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuda_jobs import needs_cuda, needs_gpus, run_two_ranks  # noqa: E402

pytestmark = needs_cuda
DEVICE = torch.device("cuda")
IN, OUT, VOCAB, DIM, ROWS, STEPS = 6, 8, 10, 4, 5, 4
IDS = torch.tensor([[0, 4, 5, 9], [9, 9, 2, 7]])  # both halves of the vocabulary, a repeat
LABELS = torch.tensor([0, 7, 3, 4, 7])  # both halves of OUT = 8 classes


def _data(seed: int, *shape: int, dtype=torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype).to(DEVICE)


def _linear(seed: int, fan_in: int, fan_out: int, dtype=torch.float64) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(fan_in, fan_out).to(dtype).to(DEVICE)


def _embedding() -> nn.Embedding:
    torch.manual_seed(3)
    return nn.Embedding(VOCAB, DIM).double().to(DEVICE)


def _run(layer: nn.Module, x: torch.Tensor, upstream: torch.Tensor) -> dict:
    """Forward, backward of ``sum(y * upstream)``: the output and every gradient (on the CPU)."""
    x = x.clone().requires_grad_(x.is_floating_point())
    y = layer(x)
    assert y.device.type == DEVICE.type
    (y * upstream).sum().backward()
    grads = {f"{k}_grad": p.grad.cpu() for k, p in layer.named_parameters()}
    return {"y": y.detach().cpu(), "x_grad": None if x.grad is None else x.grad.cpu(), **grads}


def _train(model: nn.Module) -> dict:
    """``STEPS`` Adam steps of MSE regression (float32): the losses and the final state."""
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    losses = []
    for step in range(STEPS):
        x = _data(30 + step, 16, IN, dtype=torch.float32)
        loss = F.mse_loss(model(x), _data(40 + step, 16, IN, dtype=torch.float32))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "state": {k: v.cpu() for k, v in model.state_dict().items()}}


def _cases(rank: int, world: int) -> dict:
    """Every case on this rank's shards, on the model-parallel group of ``fleet.init``."""
    from fleetx.parallel.cross_entropy import ParallelCrossEntropy
    from fleetx.parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                        VocabParallelEmbedding)
    half = slice(rank * OUT // world, (rank + 1) * OUT // world)
    column = ColumnParallelLinear.from_linear(_linear(0, IN, OUT), gather_output=False)
    row = RowParallelLinear.from_linear(_linear(5, OUT, OUT), input_is_parallel=True)
    embedding = VocabParallelEmbedding.from_embedding(_embedding())
    logits = _data(7, ROWS, OUT)[:, half].clone().requires_grad_()
    loss = ParallelCrossEntropy()(logits, LABELS.to(DEVICE))
    (loss * _data(9, ROWS)).sum().backward()
    mlp = nn.Sequential(
        ColumnParallelLinear.from_linear(_linear(20, IN, OUT, torch.float32),
                                         gather_output=False), nn.Tanh(),
        RowParallelLinear.from_linear(_linear(21, OUT, IN, torch.float32),
                                      input_is_parallel=True))
    return {"column": _run(column, _data(1, ROWS, IN), _data(2, ROWS, OUT)[:, half]),
            "row": _run(row, _data(3, ROWS, OUT)[:, half], _data(4, ROWS, OUT)),
            "embedding": _run(embedding, IDS.to(DEVICE), _data(6, 2, 4, DIM)),
            "ce": {"loss": loss.detach().cpu(), "grad": logits.grad.cpu()},
            "mlp": _train(mlp)}


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-9) -> bool:
    return a.shape == b.shape and (a.cpu() - b.cpu()).abs().max().item() <= tol


def _check(ranks: list) -> None:
    """The shards of every rank, put together, against the unsplit layers on CUDA."""
    cat = torch.cat
    ref = _run(_linear(0, IN, OUT), _data(1, ROWS, IN), _data(2, ROWS, OUT))
    got = [r["column"] for r in ranks]  # rank r: output columns (weight rows) of its share
    assert _close(cat([r["y"] for r in got], -1), ref["y"])
    assert _close(cat([r["weight_grad"] for r in got]), ref["weight_grad"])
    assert _close(cat([r["bias_grad"] for r in got]), ref["bias_grad"])
    assert all(_close(r["x_grad"], ref["x_grad"]) for r in got)  # summed over the group
    ref = _run(_linear(5, OUT, OUT), _data(3, ROWS, OUT), _data(4, ROWS, OUT))
    got = [r["row"] for r in ranks]  # rank r: input columns of the weight, the whole bias
    assert all(_close(r["y"], ref["y"]) and _close(r["bias_grad"], ref["bias_grad"])
               for r in got)
    assert _close(cat([r["weight_grad"] for r in got], 1), ref["weight_grad"])
    assert _close(cat([r["x_grad"] for r in got], -1), ref["x_grad"])
    ref = _run(_embedding(), IDS.to(DEVICE), _data(6, 2, 4, DIM))
    got = [r["embedding"] for r in ranks]  # rank r: its rows of the vocabulary
    assert all(_close(r["y"], ref["y"]) for r in got)
    assert _close(cat([r["weight_grad"] for r in got]), ref["weight_grad"])
    assert (ref["weight_grad"][9] != 0).all()  # the repeated id's rows add up
    logits = _data(7, ROWS, OUT).requires_grad_()
    loss = F.cross_entropy(logits, LABELS.to(DEVICE), reduction="none")
    (loss * _data(9, ROWS)).sum().backward()
    assert all(_close(r["ce"]["loss"], loss.detach()) for r in ranks)
    assert _close(cat([r["ce"]["grad"] for r in ranks], -1), logits.grad)
    _check_mlp([r["mlp"] for r in ranks])


def _check_mlp(got: list) -> None:
    start = nn.Sequential(_linear(20, IN, OUT, torch.float32), nn.Tanh(),
                          _linear(21, OUT, IN, torch.float32))
    moved = start.state_dict()["0.weight"].cpu().clone()
    ref = _train(start)
    state = ref["state"]
    for r in got:
        assert max(abs(a - b) for a, b in zip(r["losses"], ref["losses"])) <= 1e-5
        assert _close(r["state"]["2.bias"], state["2.bias"], 1e-5)
    for key, dim in (("0.weight", 0), ("0.bias", 0), ("2.weight", 1)):
        assert _close(torch.cat([r["state"][key] for r in got], dim), state[key], 1e-5), key
    assert (state["0.weight"] - moved).abs().max() > 1e-2  # the steps moved the weights


def _fleet_with_mp(degree: int):
    from fleetx import DistributedStrategy
    from fleetx.fleet import Fleet
    s = DistributedStrategy()
    s.hybrid_configs = {"mp_degree": degree}
    fleet = Fleet()
    fleet.init(is_collective=True, strategy=s)
    return fleet


def test_one_cuda_rank_equals_the_unsplit_layers(one_process):
    fleet = _fleet_with_mp(1)
    assert fleet.local_device() == torch.device("cuda", 0)
    _check([_cases(0, 1)])


def test_random_streams_carry_the_cuda_generator():
    from fleetx.parallel.random import RNGStatesTracker
    tracker = RNGStatesTracker()
    torch.cuda.manual_seed(5)
    torch.rand(3, device="cuda")  # the global generator somewhere past its seed
    outside = torch.cuda.get_rng_state()
    tracker.add("stream", 1234)
    assert torch.equal(torch.cuda.get_rng_state(), outside)  # registering draws nothing here
    ones = torch.ones(64, device="cuda")
    with tracker.rng_state("stream"):
        first = (torch.rand(4, device="cuda"), F.dropout(ones, 0.5))
    assert torch.equal(torch.cuda.get_rng_state(), outside)  # the global generator resumes
    with tracker.rng_state("stream"):
        second = torch.rand(4, device="cuda")  # the stream goes on where it stopped
    torch.cuda.manual_seed(1234)
    want = (torch.rand(4, device="cuda"), F.dropout(ones, 0.5), torch.rand(4, device="cuda"))
    assert torch.equal(first[0], want[0]) and torch.equal(first[1], want[1])
    assert torch.equal(second, want[2]) and not torch.equal(first[0], second)
    assert (first[1] == 0).any() and (first[1] != 0).any()  # dropout did drop, not all


def _two_ranks(rank: int, world: int, out: str) -> None:
    import torch.distributed as dist
    fleet = _fleet_with_mp(world)
    hcg = fleet.get_hybrid_communicate_group()
    torch.save({"cases": _cases(hcg.get_model_parallel_rank(), world),
                "backend": dist.get_backend(), "device": str(fleet.local_device())},
               f"{out}/rank{rank}.pt")


@needs_gpus(2)
def test_two_ranks_over_nccl_equal_the_unsplit_layers(tmp_path):
    run_two_ranks(_two_ranks, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert [(r["backend"], r["device"]) for r in ranks] == [("nccl", "cuda:0"),
                                                            ("nccl", "cuda:1")]
    _check([r["cases"] for r in ranks])
