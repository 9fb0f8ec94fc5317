"""``fleet.export_model`` and ``DistributedModel.save_pretrained`` on 2 processes, every layout.

Each exported file is read back with safetensors (or ``torch.load``) into the plain, unsplit
model with ``strict=True`` and compared with that model trained alike on one process (Adam,
the union batch), or with the parameters the stages hold:

* data parallel and sharding stages 1, 2 and 3: a model whose embedding is tied to its head
  and whose widths (9, 7) do not divide by 2 (stage 3's shards are uneven), with a persistent
  buffer; safetensors and torch files;
* Hugging Face: ``GPT2LMHeadModel`` at stage 3 through ``save_pretrained`` on the wrapped model
  and ``LlamaForCausalLM`` at stage 2 through ``fleet.export_model(format="torch")``; each
  directory loads with ``from_pretrained`` and gives the logits of the model trained on one
  process;
* tensor parallel (``mp_degree`` 2): a model of fleetx's own parallel layers (float64) against
  the unsplit model trained alike, and Llama split by its own ``_tp_plan`` read back by
  ``from_pretrained`` against the unsplit model;
* pipeline (``pp_degree`` 2): the stages' merged state, and a ``SharedLayerDesc`` tie written
  once and re-tied by ``safetensors.torch.load_model``.

Two spawns (one per topology family); the parent compares. The crash-safety and argument
checks run in one process (tests/unit/test_checkpoint_export.py). Slow: dp 2 x mp 2 on 4
processes (Llama's plan, each replica on half the batch) equals one process on the whole batch;
an export called on rank 0 alone fails after ``FLEETX_TIMEOUT`` (naming rank 1 with
``FLEETX_DEBUG_COLLECTIVES=1``) instead of hanging.
"""
from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hf_models  # noqa: E402
from spawn import max_diff, run_and_load  # noqa: E402
from test_tp_plan import float64  # noqa: E402  (layers and HF buffers built in float64)

B, STEPS, LR, VOCAB = 4, 2, 0.01, 11
TOL = 1e-5


class TiedNet(nn.Module):
    """An embedding tied to the output head, odd widths, a persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.emb = nn.Embedding(VOCAB, 6)
        self.body = nn.Sequential(nn.Linear(6, 9), nn.GELU(), nn.Linear(9, 7), nn.GELU(),
                                  nn.Linear(7, 6))
        self.head = nn.Linear(6, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("temperature", torch.tensor([0.5]))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.emb(ids))) / self.temperature


def ids(world: int, seed: int = 2) -> list:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (world * B, 5), generator=g) for _ in range(STEPS)]


def lm_loss(logits: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x.reshape(-1))


def reference_tied(world: int) -> nn.Module:
    model = TiedNet()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    for x in ids(world):
        lm_loss(model(x), x).backward()
        opt.step()
        opt.zero_grad()
    return model


def hf_batches(world: int) -> list:
    return [hf_models.batch(world * 2, seed=3 + i) for i in range(STEPS)]


def reference_hf(build) -> nn.Module:
    model = build()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    for x in hf_batches(2):
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    return model


def _strategy(stage: int = 0, **hybrid):
    from fleetx import fleet
    s = fleet.DistributedStrategy()
    if stage:
        s.sharding = True
        s.sharding_configs = {"stage": stage}
    if hybrid:
        s.hybrid_configs = hybrid
    return s


def _train(rank: int, model: nn.Module, batches: list, loss_fn, parts: int = 2) -> nn.Module:
    """Wrap ``model``, train with Adam on part ``rank`` of ``parts`` of every batch; the
    wrapper."""
    from fleetx import fleet
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrapped = fleet.distributed_model(model)
        opt = fleet.distributed_optimizer(torch.optim.Adam(wrapped.parameters(), lr=LR))
    for x in batches:
        part = x[rank * len(x) // parts:(rank + 1) * len(x) // parts]
        opt.minimize(loss_fn(wrapped, part))
    return wrapped


def _data_parallel_cases(rank: int, world: int, out: str) -> None:
    from fleetx import fleet
    tied_loss = lambda m, x: lm_loss(m(x), x)  # noqa: E731
    hf_loss = lambda m, x: m(input_ids=x, labels=x).loss  # noqa: E731
    for stage in (0, 1, 2, 3):
        fleet.init(is_collective=True, strategy=_strategy(stage))
        _train(rank, TiedNet(), ids(world), tied_loss)
        written = fleet.export_model(f"{out}/stage{stage}.safetensors")
        assert written == f"{out}/stage{stage}.safetensors", written
        if stage in (0, 3):
            fleet.export_model(f"{out}/stage{stage}.pt", format="torch")
    fleet.init(is_collective=True, strategy=_strategy(3))
    _train(rank, hf_models.gpt2(), hf_batches(world), hf_loss).save_pretrained(f"{out}/gpt2")
    fleet.init(is_collective=True, strategy=_strategy(2))
    _train(rank, hf_models.llama(), hf_batches(world), hf_loss)
    fleet.export_model(f"{out}/llama", format="torch")
    torch.save({"files": sorted(os.listdir(out))}, f"{out}/rank{rank}.pt")


@pytest.fixture(scope="module")
def dp_ranks(tmp_path_factory):
    hf_models.transformers()
    out = tmp_path_factory.mktemp("export_dp")
    return out, run_and_load(_data_parallel_cases, 2, out, deadline=240)


def _load_strict(model: nn.Module, path: Path) -> nn.Module:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_model
        load_model(model, str(path), strict=True)  # a tie written once is re-tied
    else:
        model.load_state_dict(torch.load(path, weights_only=True), strict=True)
    return model


@pytest.mark.parametrize("stage", [0, 1, 2, 3], ids=["dp", "stage1", "stage2", "stage3"])
def test_every_layout_exports_the_model_trained_on_one_process(dp_ranks, stage):
    out, _ = dp_ranks
    want = reference_tied(2).state_dict()
    assert max_diff(want, TiedNet().state_dict()) > 1e-3  # training moved the parameters
    names = [f"stage{stage}.safetensors"] + ([f"stage{stage}.pt"] if stage in (0, 3) else [])
    for name in names:
        got = _load_strict(TiedNet(), out / name)
        assert got.head.weight is got.emb.weight  # loading kept the tie
        assert max_diff(got.state_dict(), want) <= TOL, name


def test_safetensors_writes_a_tie_once_and_plain_keys(dp_ranks):
    from safetensors.torch import load_file
    out, _ = dp_ranks
    keys = set(load_file(str(out / "stage3.safetensors")))
    assert keys == set(TiedNet().state_dict()) - {"head.weight"}  # the later alias left out
    torch_keys = set(torch.load(out / "stage3.pt", weights_only=True))
    assert torch_keys == set(TiedNet().state_dict())  # torch.save keeps every key


def _logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=hf_models.batch(2, seed=9)).logits


@pytest.mark.parametrize("name,build,weights", [
    ("gpt2", hf_models.gpt2, "model.safetensors"),
    ("llama", hf_models.llama, "pytorch_model.bin")])
def test_hugging_face_export_loads_with_from_pretrained(dp_ranks, name, build, weights):
    tf = hf_models.transformers()
    out, ranks = dp_ranks
    folder = out / name
    assert sorted(os.listdir(folder)) == sorted(["config.json", "generation_config.json",
                                                 weights])
    want = reference_hf(build)
    auto = tf.AutoModelForCausalLM.from_pretrained(folder)
    assert type(auto) is type(want)  # the model's class, not FSDP's subclass
    if name == "gpt2":
        assert auto.lm_head.weight is auto.transformer.wte.weight
    got = type(want).from_pretrained(folder)
    assert max_diff(got.state_dict(), want.state_dict()) <= TOL
    for model in (auto, got):
        assert (_logits(model) - _logits(want)).abs().max().item() <= TOL
    # no temporary name is left behind, on any rank's view of the folder
    assert all(not f.startswith(".") for r in ranks for f in r["files"])


# -- tensor and pipeline parallel ----------------------------------------------------------------
W, TP_VOCAB = 8, 12


def tp_model(split: bool) -> nn.Sequential:
    """fleetx's own tensor-parallel example (docs/model_parallel.md), or its unsplit twin:
    built after the same seed, the shards put together are the unsplit weights."""
    from fleetx.fleet import meta_parallel as mpu
    torch.manual_seed(0)
    if not split:
        return nn.Sequential(nn.Embedding(TP_VOCAB, W), nn.Linear(W, 4 * W), nn.GELU(),
                             nn.Linear(4 * W, W), nn.Linear(W, TP_VOCAB, bias=False))
    return nn.Sequential(mpu.VocabParallelEmbedding(TP_VOCAB, W),
                         mpu.ColumnParallelLinear(W, 4 * W, gather_output=False), nn.GELU(),
                         mpu.RowParallelLinear(4 * W, W, input_is_parallel=True),
                         mpu.ColumnParallelLinear(W, TP_VOCAB, has_bias=False))


def train_tp(model: nn.Module) -> nn.Module:
    """Adam on the same tokens on every rank (model parallel: no data split)."""
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    g = torch.Generator().manual_seed(4)
    for _ in range(STEPS):
        x = torch.randint(0, TP_VOCAB, (4, 6), generator=g)
        lm_loss(model(x), x).backward()
        opt.step()
        opt.zero_grad()
    return model


def _pipeline_case(rank: int, out: str) -> dict:
    from fleetx import fleet
    from fleetx.fleet.meta_parallel import PipelineLayer
    from test_pipeline import ACC, MICRO, batches, mlp_layers, sgd, tied_layers
    s = _strategy(dp_degree=1, pp_degree=2)
    s.pipeline_configs = {"micro_batch_size": MICRO, "accumulate_steps": ACC}
    fleet.init(is_collective=True, strategy=s)
    torch.manual_seed(3)
    stage = PipelineLayer(mlp_layers(desc=True), loss_fn=nn.MSELoss())
    model = fleet.distributed_model(stage)
    opt = fleet.distributed_optimizer(sgd(stage.parameters()))
    for b in batches():
        model.train_batch(list(b), opt)
    fleet.export_model(f"{out}/pipeline.safetensors")
    torch.manual_seed(4)
    tied = PipelineLayer(tied_layers(), loss_fn=nn.CrossEntropyLoss())
    fleet.export_model(f"{out}/tied.safetensors", model=tied)
    fleet.export_model(f"{out}/tied.pt", format="torch", model=tied)
    return {"pipeline": model.state_dict(), "tied": tied.state_dict()}


def _model_parallel_cases(rank: int, world: int, out: str) -> None:
    from fleetx import fleet
    fleet.init(is_collective=True, strategy=_strategy(dp_degree=1, mp_degree=2))
    with float64():
        fleet.export_model(f"{out}/tp.safetensors", model=train_tp(tp_model(split=True)))
    hf_loss = lambda m, x: m(input_ids=x, labels=x).loss  # noqa: E731
    with float64():  # float32 rounding, amplified by Adam, would hide a wrong gather less well
        llama = _train(0, hf_models.llama().double(), hf_batches(1), hf_loss, parts=1)
        assert type(llama.module.lm_head).__name__ == "ColumnParallelLinear"  # split by the plan
        fleet.export_model(f"{out}/llama_tp")
    torch.save(_pipeline_case(rank, out), f"{out}/rank{rank}.pt")


@pytest.fixture(scope="module")
def mp_ranks(tmp_path_factory):
    hf_models.transformers()
    out = tmp_path_factory.mktemp("export_mp")
    return out, run_and_load(_model_parallel_cases, 2, out, deadline=240)


def test_tensor_parallel_layers_export_the_unsplit_model_trained_alike(mp_ranks):
    out, _ = mp_ranks
    with float64():
        want = train_tp(tp_model(split=False)).state_dict()
        got = _load_strict(tp_model(split=False), out / "tp.safetensors").state_dict()
    assert got["1.weight"].shape == (4 * W, W) and got["3.weight"].shape == (W, 4 * W)
    assert max_diff(got, want) <= 1e-10


def test_tensor_parallel_llama_from_its_plan_loads_with_from_pretrained(mp_ranks):
    tf = hf_models.transformers()
    out, _ = mp_ranks
    with float64():
        want = hf_models.llama().double()
        opt = torch.optim.Adam(want.parameters(), lr=LR)
        for x in hf_batches(1):  # the same batch on both model-parallel ranks
            want(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad()
        got = tf.AutoModelForCausalLM.from_pretrained(out / "llama_tp")
        assert got.dtype == torch.float64  # the dtype the export recorded
        assert max_diff(got.state_dict(), want.state_dict()) <= 1e-10
        assert (_logits(got) - _logits(want)).abs().max().item() <= 1e-10


def _merged(ranks: list, case: str) -> dict:
    merged: dict = {}
    for r in ranks:
        merged.update(r[case])
    return merged


def test_pipeline_exports_the_stages_under_the_unsplit_keys(mp_ranks):
    from test_pipeline import mlp_layers
    out, ranks = mp_ranks
    assert set(ranks[0]["pipeline"]).isdisjoint(ranks[1]["pipeline"])  # each stage its layers
    plain = _load_strict(nn.Sequential(*mlp_layers(desc=False)), out / "pipeline.safetensors")
    assert max_diff(plain.state_dict(), _merged(ranks, "pipeline")) == 0


def test_pipeline_shared_layer_is_written_once_and_loads_tied(mp_ranks):
    from safetensors.torch import load_file
    from test_pipeline import tied_layers
    out, ranks = mp_ranks
    assert "6.weight" in ranks[1]["tied"] and "0.weight" in ranks[0]["tied"]
    assert set(load_file(str(out / "tied.safetensors"))) == set(_merged(ranks, "tied")) - {
        "6.weight"}
    for name in ("tied.safetensors", "tied.pt"):
        layers = [d.build_layer() if hasattr(d, "build_layer") else d for d in tied_layers()]
        layers[6] = layers[0]  # the unsplit model uses one embedding at both places
        plain = _load_strict(nn.Sequential(*layers), out / name)
        assert max_diff(plain.state_dict(), _merged(ranks, "tied")) == 0, name


def _one_rank_calls(rank: int, world: int, out: str, debug: str) -> None:
    """Rank 0 alone exports (the ``if rank == 0:`` habit of DDP scripts); rank 1 goes on."""
    import time
    os.environ.update(FLEETX_TIMEOUT="3", FLEETX_DEBUG_COLLECTIVES=debug)
    from fleetx import fleet
    fleet.init(is_collective=True)
    fleet.distributed_model(nn.Linear(2, 2))
    started, error = time.monotonic(), None
    if rank == 0:
        try:
            fleet.export_model(f"{out}/never.safetensors")
        except Exception as err:  # noqa: BLE001  (what the user sees)
            error = (type(err).__name__, str(err))
    else:
        time.sleep(5)
    torch.save({"error": error, "seconds": time.monotonic() - started}, f"{out}/rank{rank}.pt")


@pytest.mark.slow
@pytest.mark.parametrize("debug", ["0", "1"], ids=["plain", "debug_collectives"])
def test_an_export_called_on_one_rank_names_the_rank_that_did_not_call_it(tmp_path, debug):
    """As docs/export.md says: a CommError naming the rank that did not call it (here it only
    sleeps, so after FLEETX_TIMEOUT), with or without FLEETX_DEBUG_COLLECTIVES; no file."""
    import spawn
    spawn.run(_one_rank_calls, 2, str(tmp_path), debug, deadline=60)
    got = torch.load(tmp_path / "rank0.pt")
    assert got["error"] is not None and got["seconds"] < 10
    assert got["error"][0] == "CommError" and "fleet.export_model" in got["error"][1], got
    assert "rank 0 called it, rank(s) 1 did not" in got["error"][1], got
    assert not (tmp_path / "never.safetensors").exists()


def _hybrid_case(rank: int, world: int, out: str) -> None:
    """dp 2 x mp 2: Llama split by its plan, each data-parallel replica on half the batch."""
    from fleetx import fleet
    fleet.init(is_collective=True, strategy=_strategy(dp_degree=2, mp_degree=2))
    dp_rank = fleet.get_hybrid_communicate_group().get_data_parallel_rank()
    hf_loss = lambda m, x: m(input_ids=x, labels=x).loss  # noqa: E731
    with float64():
        _train(dp_rank, hf_models.llama().double(), hf_batches(2), hf_loss)
        fleet.export_model(f"{out}/llama_dp_mp")
    torch.save({"dp_rank": dp_rank}, f"{out}/rank{rank}.pt")


@pytest.mark.slow
def test_data_parallel_over_tensor_parallel_exports_the_model_of_one_process(tmp_path):
    tf = hf_models.transformers()
    ranks = run_and_load(_hybrid_case, 4, tmp_path, deadline=300)
    assert sorted(r["dp_rank"] for r in ranks) == [0, 0, 1, 1]
    with float64():
        want = reference_hf(lambda: hf_models.llama().double())
        got = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "llama_dp_mp")
        assert max_diff(got.state_dict(), want.state_dict()) <= 1e-10
