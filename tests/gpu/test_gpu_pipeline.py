"""The pipeline (``PipelineLayer`` through ``fleet.distributed_model``, ``train_batch``) on CUDA:

* one process (one stage, NCCL picked): under ``strategy.amp`` (float16 autocast, the loss
  scaled by 2**15 in every micro-batch's backward and unscaled by the step guard), 3
  mini-batches of 4 micro-batches train like the unsplit model under ``torch.autocast``
  float16 + ``torch.amp.GradScaler`` with the same micro-batching (losses and weights 1e-5);
* two stages over NCCL (``pp_degree`` 2, one GPU each; the stages built on the CPU and moved,
  as ``examples/gpt/train.py --pp`` does): 1F1B and F-then-B in float32, 1F1B under amp, a
  token embedding tied to the output projection across the stages (``SharedLayerDesc``), and
  1F1B with 8 MiB activations (more than NCCL buffers, where sends facing each other must not
  wait for each other) equal the unsplit model on one GPU (1e-5); ``eval_batch`` gives the
  unsplit model's loss on every stage. NCCL refuses two ranks on one GPU, so this case needs
  two GPUs and skips with fewer.
"""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuda_jobs import needs_cuda, needs_gpus, run_two_ranks  # noqa: E402

pytestmark = needs_cuda
DEVICE = torch.device("cuda")
MICRO, ACC, STEPS, WIDTH, VOCAB = 2, 4, 3, 16, 12
# 2**20 floats a micro-batch row: an 8 MiB activation (and gradient) per transfer, more than
# NCCL's default buffer (4 MiB), so the sends that face each other in 1F1B cannot all complete
# before their receives are posted
WIDE = 2 ** 20
DIMS = {"mlp": [8] + [WIDTH] * 4 + [4], "wide": [8, WIDE, 4]}
CASES = {"1F1B": ("1F1B", False, "mlp"), "FThenB": ("F-then-B", False, "mlp"),
         "1F1B_amp": ("1F1B", True, "mlp"), "tied": ("1F1B", False, "tied"),
         "1F1B_wide": ("1F1B", False, "wide")}  # schedule, amp, model


def _project(emb: nn.Embedding, h: torch.Tensor) -> torch.Tensor:
    return h @ emb.weight.t()


def _mlp(dims: list, layer=nn.Linear) -> list:
    """Linear layers of ``dims`` with a Tanh between each two."""
    out: list = []
    for i in range(len(dims) - 1):
        out += [layer(dims[i], dims[i + 1])] + ([nn.Tanh()] if i < len(dims) - 2 else [])
    return out


def _layers(kind: str) -> list:
    """The pipeline's layers: an MLP (9 layers; ``wide``: 3), or an embedding, 3 Linears and
    the embedding again as the output projection (``tied``)."""
    from fleetx.parallel.pipeline import LayerDesc, SharedLayerDesc
    if kind != "tied":
        return _mlp(DIMS[kind], lambda *shape: LayerDesc(nn.Linear, *shape))
    return ([SharedLayerDesc("embed", nn.Embedding, None, "weight", VOCAB, WIDTH)]
            + _mlp([WIDTH] * 4, lambda *shape: LayerDesc(nn.Linear, *shape))
            + [SharedLayerDesc("embed", nn.Embedding, _project, "weight", VOCAB, WIDTH)])


class _TiedLM(nn.Module):
    """The unsplit counterpart of the tied pipeline: one embedding, used twice."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.body = nn.Sequential(*_mlp([WIDTH] * 4))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return _project(self.emb, self.body(self.emb(tokens)))


def _unsplit(kind: str) -> nn.Module:
    """The unsplit model (seeded), on the CPU."""
    torch.manual_seed(4)
    return _TiedLM() if kind == "tied" else nn.Sequential(*_mlp(DIMS[kind]))


def _global_state(kind: str) -> dict:
    """The unsplit model's state under the pipeline's keys (its layer indexes)."""
    model = _unsplit(kind)
    if kind != "tied":
        return model.state_dict()
    body = {f"{int(k[0]) + 1}{k[1:]}": v for k, v in model.body.state_dict().items()}
    return {"0.weight": model.emb.weight.detach(), **body, "6.weight": model.emb.weight.detach()}


def _batches(kind: str) -> list:
    g = torch.Generator().manual_seed(5)
    n = MICRO * ACC
    if kind == "tied":
        return [(torch.randint(0, VOCAB, (n,), generator=g),
                 torch.randint(0, VOCAB, (n,), generator=g)) for _ in range(STEPS)]
    return [(torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g))
            for _ in range(STEPS)]


def _loss_fn(kind: str) -> nn.Module:
    return nn.CrossEntropyLoss() if kind == "tied" else nn.MSELoss()


def _sgd(params, kind: str) -> torch.optim.Optimizer:
    # the wide model's output sums 2**20 products whose weights all move together: a small
    # step keeps its training stable
    return torch.optim.SGD(params, lr=1e-6 if kind == "wide" else 0.1, momentum=0.9)


def _reference(kind: str, amp: bool, stages: int) -> dict:
    """The unsplit model on one device, micro-batched like the pipeline: autocast in the
    device's amp dtype and a GradScaler at fleetx's default scale (2**15, no growth here).
    Under amp a stage's output reaches the next stage in float32 (amp hands a model's output
    on in float32), so the unsplit MLP casts where the 2 stages meet (after layer 4)."""
    from fleetx.amp import low_precision_dtype
    model = _unsplit(kind).to(DEVICE)
    if amp and stages == 2 and kind == "mlp":
        model[4].register_forward_hook(lambda module, args, out: out.float())
    opt, loss_fn = _sgd(model.parameters(), kind), _loss_fn(kind)
    scaler = torch.amp.GradScaler(DEVICE.type, init_scale=2.0 ** 15, enabled=amp)
    dtype = low_precision_dtype(DEVICE.type)
    losses = []
    for x, y in _batches(kind):
        total = 0.0
        for xs, ys in zip(x.to(DEVICE).split(MICRO), y.to(DEVICE).split(MICRO)):
            with torch.autocast(DEVICE.type, dtype=dtype, enabled=amp):
                loss = loss_fn(model(xs), ys)
            scaler.scale(loss / ACC).backward()
            total += loss.item() / ACC
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(total)
    x, y = _batches(kind)[0]
    with torch.no_grad(), torch.autocast(DEVICE.type, dtype=dtype, enabled=amp):
        micro = [loss_fn(model(xs), ys).item()
                 for xs, ys in zip(x.to(DEVICE).split(MICRO), y.to(DEVICE).split(MICRO))]
    return {"losses": losses, "state": {k: v.cpu() for k, v in model.state_dict().items()},
            "eval": sum(micro) / len(micro)}


def _through_fleet(case: str, world: int) -> dict:
    """``case`` trained through fleet on this process's stage (built on the CPU, moved)."""
    from fleetx import DistributedStrategy
    from fleetx.fleet import Fleet
    from fleetx.fleet.meta_parallel import PipelineLayer, PipelineParallel
    mode, amp, kind = CASES[case]
    s = DistributedStrategy()
    s.hybrid_configs = {"pp_degree": world}
    s.pipeline_configs = {"micro_batch_size": MICRO, "accumulate_steps": ACC,
                          "schedule_mode": mode}
    s.amp = amp
    fleet = Fleet()
    fleet.init(is_collective=True, strategy=s)
    stage = PipelineLayer(_layers(kind), loss_fn=_loss_fn(kind))
    full = _global_state(kind)
    stage.load_state_dict({k: full[k] for k in stage.state_dict()})
    seen: list = []
    stage.register_forward_hook(lambda m, a, out: seen.append(f"{out.dtype} {out.device.type}"))
    model = fleet.distributed_model(stage.to(fleet.local_device()))
    assert isinstance(model, PipelineParallel)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = fleet.distributed_optimizer(_sgd(model.parameters(), kind))
    device = fleet.local_device()
    losses = [model.train_batch([x.to(device), y.to(device)], opt).item()
              for x, y in _batches(kind)]
    x, y = _batches(kind)[0]
    return {"losses": losses, "state": {k: v.cpu() for k, v in model.state_dict().items()},
            "eval": model.eval_batch([x.to(device), y.to(device)]).item(),
            "scale": opt.get_loss_scaling() if amp else None, "seen": sorted(set(seen)),
            "device": str(device)}


def _check(case: str, ranks: list) -> None:
    _, amp, kind = CASES[case]
    want = _reference(kind, amp, len(ranks))
    merged: dict = {}
    for r in ranks:
        merged.update(r["state"])
        assert r["losses"] == pytest.approx(want["losses"], abs=1e-5), case
        assert r["eval"] == pytest.approx(want["eval"], abs=1e-5), case
        assert r["scale"] == (2.0 ** 15 if amp else None), case
    if kind == "tied":  # the stages' copies of the tied matrix: one weight, the unsplit one's
        assert torch.equal(ranks[0]["state"]["0.weight"], ranks[-1]["state"]["6.weight"])
        merged = {"emb.weight": merged["0.weight"],
                  **{f"body.{int(k[0]) - 1}{k[1:]}": v for k, v in merged.items()
                     if k[0] in "12345"}}
    assert merged.keys() == want["state"].keys(), case
    assert max((merged[k] - v).abs().max().item() for k, v in want["state"].items()) <= 1e-5
    assert abs(want["losses"][-1] - want["losses"][0]) > 1e-3, case  # the steps trained


def test_one_stage_under_amp_equals_autocast_and_grad_scaler(one_process):
    got = _through_fleet("1F1B_amp", 1)
    assert got["device"] == "cuda:0"
    assert got["seen"] == ["torch.float16 cuda"]  # the stage's output, under autocast
    _check("1F1B_amp", [got])


def _two_stages(rank: int, world: int, out: str) -> None:
    torch.save({case: _through_fleet(case, world) for case in CASES}, f"{out}/rank{rank}.pt")


@needs_gpus(2)
def test_two_stages_over_nccl_equal_the_unsplit_model(tmp_path):
    run_two_ranks(_two_stages, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert [r["1F1B"]["device"] for r in ranks] == ["cuda:0", "cuda:1"]
    for case in CASES:
        _check(case, [r[case] for r in ranks])
