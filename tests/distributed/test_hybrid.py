"""Hybrid parallelism on 4 CPU processes equals the plain one-process model.

One small language model (a token embedding tied to the output projection, two residual MLP
blocks) trains 3 steps of momentum SGD on mini-batches of 8 sequences under dp 2 x mp 2,
dp 2 x pp 2, mp 2 x pp 2 and mp 4, all in one spawn (``fleet.init`` again for each layout). Tensor
parallelism puts the blocks' linears in ``ColumnParallelLinear`` / ``RowParallelLinear``
(seeded like the unsplit ``nn.Linear``); the pipelines are ``PipelineLayer``s with the
embedding a ``SharedLayerDesc`` on both stages (``test_hybrid_plan.py`` trains mp 2 x pp 2 once
more with the stages' plain blocks split by a plan, in the default stage); data parallelism gives each replica half of
every mini-batch. Each layout trains twice: plainly, and with
``fleet.distributed_optimizer(opt).clip_grad_norm_`` before every step (called from a step
pre-hook under ``train_batch``), with a max norm below every step's norm so the clipping acts.

The parent trains the unsplit model on the whole mini-batches (``torch.nn.utils.clip_grad_norm_``
for the clipped runs) and compares the mean losses, the returned norms and the weights put
together from the shards and stages (1e-5, float32). It also checks that DDP runs over the
data-parallel group only, and no DDP at all with dp_degree 1.

Slow (about two minutes on 2 shared cores): CI's slow stage runs it.
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

WORLD, VOCAB, WIDTH, HIDDEN, SEQ, BATCH, STEPS = 4, 16, 8, 16, 4, 8, 3
MAX_NORM, TOL = 0.05, 1e-5

pytestmark = pytest.mark.slow
LAYOUTS = {"dp2_mp2": (2, 2, 1), "dp2_pp2": (2, 1, 2), "mp2_pp2": (1, 2, 2),
           "mp4": (1, 4, 1)}  # dp, mp, pp (test_hybrid_plan.py: mp2_pp2_plan, default stage)
# mp2_pp2_plan: the stages' blocks (PipelineLayer names its layers by their index) split by a plan
PLAN, PLAN_LAYOUT = {"*.fc1": "colwise", "*.fc2": "rowwise"}, (1, 2, 2)
RUNS = {"plain": None, "clip": 2.0, "clip_inf": float("inf")}  # run -> clipping norm type


class Embed(nn.Embedding):
    """The token embedding, initialised from its own seed (the same on every stage)."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(VOCAB, WIDTH)


class Block(nn.Module):
    """``x + fc2(tanh(fc1(x)))``; with ``mp`` the linears are split Megatron-style."""

    def __init__(self, seed: int, mp: bool) -> None:
        super().__init__()
        torch.manual_seed(seed)  # the split layers draw the unsplit layers' initialisation
        if mp:
            from fleetx.fleet.meta_parallel import ColumnParallelLinear, RowParallelLinear
            self.fc1 = ColumnParallelLinear(WIDTH, HIDDEN, gather_output=False)
            self.fc2 = RowParallelLinear(HIDDEN, WIDTH, input_is_parallel=True)
        else:
            self.fc1, self.fc2 = nn.Linear(WIDTH, HIDDEN), nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


def project(embed: nn.Embedding, h: torch.Tensor) -> torch.Tensor:
    return h @ embed.weight.t()


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


class LM(nn.Module):
    """The model unsplit (``mp=False``) or tensor-parallel (``mp=True``)."""

    def __init__(self, mp: bool = False) -> None:
        super().__init__()
        self.embed = Embed()
        self.blocks = nn.Sequential(Block(1, mp), Block(2, mp))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return project(self.embed, self.blocks(self.embed(ids)))


def pipeline_layers(mp: bool) -> list:
    from fleetx.fleet.meta_parallel import LayerDesc, SharedLayerDesc
    return [SharedLayerDesc("embed", Embed, None, "weight"), LayerDesc(Block, 1, mp),
            LayerDesc(Block, 2, mp), SharedLayerDesc("embed", Embed, project, "weight")]


def batch(step: int) -> tuple:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step))
    return ids[:, :-1], ids[:, 1:]


# the pipeline's global keys -> the unsplit model's names
_STAGE_KEYS = {"0": "embed", "1": "blocks.0", "2": "blocks.1", "3": "embed"}


def _plain_names(state: dict) -> dict:
    out = {}
    for key, value in state.items():
        head, rest = key.split(".", 1)
        out[f"{_STAGE_KEYS[head]}.{rest}" if head in _STAGE_KEYS else key] = value.clone()
    return out


def _train_layout(rank: int, layout: str, norm_type) -> dict:
    import torch.distributed as dist

    from fleetx import fleet
    from fleetx.fleet.meta_parallel import PipelineLayer
    dp, mp, pp = PLAN_LAYOUT if layout == "mp2_pp2_plan" else LAYOUTS[layout]
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": dp, "mp_degree": mp, "pp_degree": pp}
    local = BATCH // dp
    if pp > 1:
        strategy.pipeline_configs = {"micro_batch_size": local // 2, "accumulate_steps": 2}
    fleet.init(is_collective=True, strategy=strategy)
    hcg = fleet.get_hybrid_communicate_group()
    if layout == "mp2_pp2_plan":  # plain blocks, split by fleet.meta_parallel.parallelize
        pipe = PipelineLayer(pipeline_layers(False), loss_fn=lm_loss)
        model = fleet.distributed_model(fleet.meta_parallel.parallelize(pipe, PLAN))
    elif pp > 1:
        model = fleet.distributed_model(PipelineLayer(pipeline_layers(mp > 1), loss_fn=lm_loss))
    else:
        model = fleet.distributed_model(LM(mp=mp > 1))
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9))
    norms: list = []
    if norm_type is not None:
        opt.register_step_pre_hook(
            lambda *_: norms.append(opt.clip_grad_norm_(MAX_NORM, norm_type).item()))
    part = slice(hcg.get_data_parallel_rank() * local, (hcg.get_data_parallel_rank() + 1) * local)
    losses = []
    for step in range(STEPS):
        x, y = (t[part] for t in batch(step))
        if pp > 1:
            losses.append(model.train_batch([x, y], opt).item())
        else:
            loss = lm_loss(model(x), y)
            opt.minimize(loss)
            losses.append(loss.item())
    engine = getattr(model, "_engine", None)
    ddp = (dist.get_process_group_ranks(engine.process_group)
           if isinstance(engine, nn.parallel.DistributedDataParallel) else None)
    return {"losses": losses, "norms": norms, "state": _plain_names(model.state_dict()),
            "coord": (hcg.get_data_parallel_rank(), hcg.get_stage_id(),
                      hcg.get_model_parallel_rank()),
            "dp_ranks": hcg.group_ranks("data"), "ddp_ranks": ddp}


def _work(rank: int, world: int, out: str) -> None:
    results = {(layout, run): _train_layout(rank, layout, norm_type)
               for layout in LAYOUTS for run, norm_type in RUNS.items()
               if run != "clip_inf" or layout == "dp2_mp2"}
    torch.save(results, f"{out}/rank{rank}.pt")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_and_load(_work, WORLD, tmp_path_factory.mktemp("hybrid"), deadline=480)


def reference(norm_type) -> dict:
    """The unsplit model trained on the whole mini-batches in one process."""
    model = LM()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    losses, norms = [], []
    for step in range(STEPS):
        x, y = batch(step)
        loss = lm_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        if norm_type is not None:
            norms.append(nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, norm_type).item())
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "state": model.state_dict()}


_SPLIT = {"fc1.weight": 0, "fc1.bias": 0, "fc2.weight": 1}  # dim of the tensor-parallel shards


def merged(results: list, key: str) -> torch.Tensor:
    """``key`` of the unsplit model put together from data-parallel replica 0's ranks; every
    replica and every model-parallel rank holding a replicated tensor must agree."""
    holders = [(r["coord"][2], r) for r in results if key in r["state"]]
    dim = next((d for suffix, d in _SPLIT.items() if key.endswith(suffix)), None)
    first = [r for _, r in holders if r["coord"][0] == 0]
    for _, r in holders:  # the replicas (data-parallel ranks, stages holding a tie) agree
        same = next(f for f in first if f["coord"][2] == r["coord"][2])
        assert torch.allclose(r["state"][key], same["state"][key], atol=1e-6, rtol=0), key
    shards = {r["coord"][2]: r["state"][key] for r in first}
    if dim is None or len(shards) == 1:
        return shards[0]
    return torch.cat([shards[m] for m in sorted(shards)], dim=dim)


def _layout_cases() -> list:
    return [(layout, run) for layout in LAYOUTS for run in RUNS
            if run != "clip_inf" or layout == "dp2_mp2"]


@pytest.mark.parametrize("layout,run", _layout_cases())
def test_hybrid_layout_trains_like_the_plain_model(ranks, layout, run):
    check_layout([r[(layout, run)] for r in ranks], run)


def check_layout(got: list, run: str) -> None:
    """The ranks' results of one layout and run (``got``, in rank order) equal the unsplit
    model's: losses (the mean over the replicas), clipped norms and merged weights."""
    ref = reference(RUNS[run])
    replicas = {}  # every rank of a replica (stages, model-parallel ranks) has its loss
    for r in got:
        replicas.setdefault(r["coord"][0], []).append(r["losses"])
    for losses in replicas.values():
        assert all(max(abs(a - b) for a, b in zip(x, losses[0])) <= 1e-6 for x in losses)
    for step in range(STEPS):  # each replica had half of the batch: the mean of the two
        mean = sum(losses[0][step] for losses in replicas.values()) / len(replicas)
        assert abs(mean - ref["losses"][step]) <= TOL, (step, mean, ref["losses"][step])
    if RUNS[run] is not None:
        assert all(n > MAX_NORM for n in ref["norms"])  # the clipping acted on every step
        for r in got:
            assert len(r["norms"]) == STEPS
            assert max(abs(a - b) for a, b in zip(r["norms"], ref["norms"])) <= TOL
    for key, want in ref["state"].items():
        assert torch.allclose(merged(got, key), want, atol=TOL, rtol=0), key
    # the steps moved the weights (equal untrained weights would prove nothing)
    assert (ref["state"]["blocks.0.fc1.weight"] - LM().blocks[0].fc1.weight).abs().max() > 1e-3


def test_data_parallelism_uses_the_data_parallel_group_only(ranks):
    for rank, r in enumerate(ranks):
        dp_mp, mp4 = r[("dp2_mp2", "plain")], r[("mp4", "plain")]
        assert dp_mp["dp_ranks"] == [rank % 2, rank % 2 + 2]  # the same shard, two replicas
        assert dp_mp["ddp_ranks"] == dp_mp["dp_ranks"]
        assert mp4["dp_ranks"] == [rank] and mp4["ddp_ranks"] is None  # dp_degree 1: no DDP
