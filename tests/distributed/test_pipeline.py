"""The pipeline on 2 (and, slow, 4) CPU processes equals the unsplit model.

Every stage loads its slice of the unsplit model's state dict (by the global keys, which tests
the key mapping), trains 3 mini-batches of 8 samples cut into 4 micro-batches of 2 with
momentum SGD, and saves its losses and state dict. The parent trains the unsplit model on the
same mini-batches and compares: losses and merged weights within 1e-5 (float32) for both
schedules and with recompute; under amp (bfloat16 autocast on CPU) against the unsplit model
under the same autocast and micro-batching; a tied embedding / output projection
(``SharedLayerDesc``) stays equal on the two stages that hold it and equals the unsplit model's
one weight. One spawn per world size runs every case.

A stage that dies (SIGKILL) or stays silent makes its neighbour fail within the transfer timeout
with an error naming the stage and its rank.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import spawn  # noqa: E402
from spawn import run, run_and_load  # noqa: E402

MICRO, ACC, STEPS, WIDTH, VOCAB = 2, 4, 3, 16, 12
CASES = {  # name -> (schedule_mode, recompute_interval, amp, seg_method)
    "1F1B": ("1F1B", 0, False, "uniform"),
    "FThenB": ("FThenB", 0, False, "uniform"),
    "1F1B_recompute": ("1F1B", 2, False, "uniform"),
    "FThenB_recompute": ("F-then-B", 1, False, "layer:Linear"),
    "1F1B_amp": ("1F1B", 0, True, "uniform"),
}


def mlp_layers(desc):
    """9 layers: Linear, Tanh, (Linear, Tanh) x 3, Linear."""
    from fleetx.parallel.pipeline import LayerDesc
    dims = [8] + [WIDTH] * 4 + [4]
    out = []
    for i in range(5):
        out.append(LayerDesc(nn.Linear, dims[i], dims[i + 1]) if desc else
                   nn.Linear(dims[i], dims[i + 1]))
        if i < 4:
            out.append(nn.Tanh())
    return out


def unsplit_mlp() -> nn.Sequential:
    torch.manual_seed(3)
    return nn.Sequential(*mlp_layers(desc=False))


def project(emb: nn.Embedding, h: torch.Tensor) -> torch.Tensor:
    return h @ emb.weight.t()


class TiedLM(nn.Module):
    """The unsplit counterpart of the shared-layer pipeline: one embedding, used twice."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.emb = nn.Embedding(VOCAB, WIDTH)
        # three Linears, so that every one of 4 uniform stages holds a parameter
        self.body = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH),
                                  nn.Tanh(), nn.Linear(WIDTH, WIDTH))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return project(self.emb, self.body(self.emb(tokens)))

    def pipeline_state(self) -> dict:
        """The state dict under the pipeline's global keys."""
        body = {f"{int(k[0]) + 1}{k[1:]}": v for k, v in self.body.state_dict().items()}
        return {"0.weight": self.emb.weight.detach(), **body, "6.weight": self.emb.weight.detach()}


def tied_layers():
    from fleetx.parallel.pipeline import LayerDesc, SharedLayerDesc
    return [SharedLayerDesc("embed", nn.Embedding, None, "weight", VOCAB, WIDTH),
            LayerDesc(nn.Linear, WIDTH, WIDTH), nn.Tanh(), LayerDesc(nn.Linear, WIDTH, WIDTH),
            nn.Tanh(), LayerDesc(nn.Linear, WIDTH, WIDTH),
            SharedLayerDesc("embed", nn.Embedding, project, "weight", VOCAB, WIDTH)]


def batches(tokens: bool = False):
    g = torch.Generator().manual_seed(5)
    n = MICRO * ACC
    if tokens:
        return [(torch.randint(0, VOCAB, (n,), generator=g),
                 torch.randint(0, VOCAB, (n,), generator=g)) for _ in range(STEPS)]
    return [(torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g))
            for _ in range(STEPS)]


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _stage(layers, full_state, loss_fn, mode, recompute, amp, seg):
    import torch.distributed as dist
    from fleetx.parallel.pipeline import PipelineLayer
    from fleetx.parallel.pipeline_parallel import PipelineParallel
    stage = PipelineLayer(layers, loss_fn=loss_fn, seg_method=seg, recompute_interval=recompute,
                          group=dist.group.WORLD)
    keys = stage.state_dict().keys()
    stage.load_state_dict({k: full_state[k] for k in keys})
    return PipelineParallel(stage, micro_batch_size=MICRO, accumulate_steps=ACC,
                            schedule_mode=mode, timeout=60,
                            autocast_dtype=torch.bfloat16 if amp else None)


def _train_case(model, data) -> dict:
    opt = sgd(model.parameters())
    losses = [model.train_batch(list(b), opt).item() for b in data]
    return {"losses": losses, "state": {k: v.clone() for k, v in model.state_dict().items()},
            "eval": model.eval_batch(list(data[0])).item(), "peak": model.peak_in_flight}


def _train(rank: int, world: int, out: str) -> None:
    import torch.distributed as dist
    dist.init_process_group("gloo")
    results = {}
    full = unsplit_mlp().state_dict()
    for name, (mode, recompute, amp, seg) in CASES.items():
        model = _stage(mlp_layers(desc=True), full, nn.MSELoss(), mode, recompute, amp, seg)
        results[name] = _train_case(model, batches())
    tied = _stage(tied_layers(), TiedLM().pipeline_state(), nn.CrossEntropyLoss(), "1F1B", 0,
                  False, "uniform")
    results["tied"] = _train_case(tied, batches(tokens=True))
    torch.save(results, f"{out}/rank{rank}.pt")


def _reference(model, data, amp: bool, loss_fn) -> tuple[list, dict]:
    """The unsplit model on the same mini-batches, micro-batched like the pipeline."""
    opt = sgd(model.parameters())
    losses = []
    for x, y in data:
        total = 0.0
        for xs, ys in zip(x.split(MICRO), y.split(MICRO)):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                loss = loss_fn(model(xs), ys)
            (loss / ACC).backward()
            total += loss.item() / ACC
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, model.state_dict()


def _merged(ranks, name) -> dict:
    merged = {}
    for r in ranks:
        merged.update(r[name]["state"])
    return merged


def _check(ranks, world):
    for name, (_, _, amp, _) in CASES.items():
        model = unsplit_mlp()
        losses, state = _reference(model, batches(), amp, nn.MSELoss())
        merged = _merged(ranks, name)
        assert merged.keys() == state.keys()
        for r in ranks:  # the mean loss over the micro-batches, on every stage
            assert r[name]["losses"] == pytest.approx(losses, abs=1e-5), name
        assert max((merged[k] - v).abs().max().item() for k, v in state.items()) <= 1e-5, name
        assert max((merged[k] - v).abs().max().item()
                   for k, v in unsplit_mlp().state_dict().items()) > 1e-3  # it did train
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            x, y = batches()[0]
            micro = [nn.functional.mse_loss(model(xs), ys).float()
                     for xs, ys in zip(x.split(MICRO), y.split(MICRO))]
        for r in ranks:
            assert r[name]["eval"] == pytest.approx(torch.stack(micro).mean().item(), abs=1e-5)
    # 1F1B keeps at most (stages - stage) micro-batches alive, F-then-B all of them
    assert [r["1F1B"]["peak"] for r in ranks] == [min(world - s, ACC) for s in range(world)]
    assert [r["FThenB"]["peak"] for r in ranks] == [ACC] * world


def _check_tied(ranks):
    lm = TiedLM()
    losses, _ = _reference(lm, batches(tokens=True), False, nn.CrossEntropyLoss())
    expected = lm.emb.weight.detach()
    first, last = ranks[0]["tied"]["state"], ranks[-1]["tied"]["state"]
    assert ranks[-1]["tied"]["losses"] == pytest.approx(losses, abs=1e-5)
    assert torch.equal(first["0.weight"], last["6.weight"])
    assert (first["0.weight"] - expected).abs().max().item() <= 1e-5


@pytest.fixture(scope="module")
def two_stages(tmp_path_factory):
    return run_and_load(_train, 2, tmp_path_factory.mktemp("pipe2"), deadline=300)


def test_two_stages_equal_the_unsplit_model(two_stages):
    _check(two_stages, 2)


def test_two_stages_state_dict_keys_are_the_global_indexes(two_stages):
    assert set(two_stages[0]["1F1B"]["state"]) == {"0.weight", "0.bias", "2.weight", "2.bias",
                                                    "4.weight", "4.bias"}
    assert set(two_stages[1]["1F1B"]["state"]) == {"6.weight", "6.bias", "8.weight", "8.bias"}


def test_two_stages_tied_embedding_and_projection(two_stages):
    _check_tied(two_stages)


@pytest.mark.slow
def test_four_stages_equal_the_unsplit_model(tmp_path):
    ranks = run_and_load(_train, 4, tmp_path, deadline=600)
    _check(ranks, 4)
    _check_tied(ranks)


def _faulty(rank: int, world: int, out: str, fault: str) -> None:
    import torch.distributed as dist
    from fleetx.parallel.api import PipelineError
    dist.init_process_group("gloo")
    model = _stage(mlp_layers(desc=True), unsplit_mlp().state_dict(), nn.MSELoss(), "1F1B", 0,
                   False, "uniform")
    model.p2p.timeout = __import__("datetime").timedelta(seconds=5)
    if rank == 1:
        if fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(40)  # silent: never sends or receives
        return
    try:
        model.train_batch(list(batches()[0]), sgd(model.parameters()))
    except PipelineError as error:
        Path(out, "error.txt").write_text(str(error))


@pytest.mark.parametrize("fault", ["kill", pytest.param("silent", marks=pytest.mark.slow)])
def test_a_dead_or_silent_stage_is_an_error_naming_it(tmp_path, fault):
    context = spawn.start(_faulty, 2, str(tmp_path), fault)
    first = context.processes[0]
    try:
        first.join(timeout=120)  # generous: the bound is the 5 s timeout plus start-up
        assert first.exitcode == 0
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    message = (tmp_path / "error.txt").read_text()
    # which transfer notices first depends on timing (a send to a dead peer, or the wait for
    # its gradient); every one names the peer
    assert message.startswith("pipeline stage 0 (rank 0): "), message
    assert " stage 1 (rank 1) failed within 5 s" in message, message


def _through_fleet(rank: int, world: int, out: str, amp: bool) -> None:
    from fleetx import fleet
    from fleetx.fleet.meta_parallel import PipelineLayer, PipelineParallel
    s = fleet.DistributedStrategy()
    s.hybrid_configs = {"dp_degree": 1, "pp_degree": world}
    s.pipeline_configs = {"micro_batch_size": MICRO, "accumulate_steps": ACC,
                          "schedule_mode": "F-then-B"}
    if amp:  # the default loss scale (2**15) and one custom list entry: tanh in float32
        s.amp = True
        s.amp_configs = {"custom_black_list": ["tanh"]}
    fleet.init(is_collective=True, strategy=s)
    stage = PipelineLayer(mlp_layers(desc=True), loss_fn=nn.MSELoss())
    stage.load_state_dict({k: v for k, v in unsplit_mlp().state_dict().items()
                           if k in stage.state_dict()})
    model = fleet.distributed_model(stage)
    assert isinstance(model, PipelineParallel) and model.schedule_mode == "FThenB"
    opt = fleet.distributed_optimizer(sgd(stage.parameters()))
    losses = [model.train_batch(list(b), opt).item() for b in batches()]
    scale = opt.get_loss_scaling() if amp else None
    torch.save({"losses": losses, "state": model.state_dict(), "scale": scale},
               f"{out}/rank{rank}.pt")


class Float32Tanh(nn.Module):
    """Tanh computed in float32 under autocast: what custom_black_list ["tanh"] asks for."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            return torch.tanh(x.float())


@pytest.mark.parametrize("amp", [False, True], ids=["float32", "amp"])
def test_fleet_distributed_model_runs_a_pipeline_layer_with_pipeline_configs(tmp_path, amp):
    """Through fleet.distributed_optimizer: every micro-batch's backward runs through the
    training context. Under amp the last stage's loss is scaled by 2**15 and every stage's
    gradients are unscaled by its step guard (unscaled twice or not at all, the weights would
    be 2**15 times off), and the tanh layers on both stages run in float32 as listed."""
    run(_through_fleet, 2, str(tmp_path), amp, deadline=300)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    model = unsplit_mlp()
    if amp:
        for i, layer in enumerate(model):
            if isinstance(layer, nn.Tanh):
                model[i] = Float32Tanh()
    losses, state = _reference(model, batches(), amp, nn.MSELoss())
    merged = {**ranks[0]["state"], **ranks[1]["state"]}
    for r in ranks:
        assert r["losses"] == pytest.approx(losses, abs=1e-5)
        assert r["scale"] == (2.0 ** 15 if amp else None)
    assert max((merged[k] - v).abs().max().item() for k, v in state.items()) <= 1e-5
