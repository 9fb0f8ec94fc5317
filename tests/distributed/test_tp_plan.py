"""Tensor parallelism from a plan, on 2 processes, against the unsplit model on one (float64).

* ``LlamaForCausalLM`` (tiny config, grouped-query attention: 4 heads and 2 key/value heads,
  one of each kind per rank) given to ``fleet.distributed_model`` with ``mp_degree`` 2: its
  own ``_tp_plan`` is applied (the projections become fleetx's parallel layers), the logits
  equal the unsplit model's and, after two Adam steps on ``out.loss``, the gathered parameters
  equal the unsplit model's after the same steps (1e-10). The ranks are seeded apart before
  building the model: the split starts from the model-parallel group's first rank.
* A nanoGPT-style model (separate q/k/v projections, heads read from the tensor's shape,
  embedding tied to the head) split by ``fleet.meta_parallel.parallelize`` with a user plan:
  the same two properties, and the tie kept.

The 4-process case (slow) runs dp 2 x mp 2: each data-parallel replica steps on its half of the
batch and the result equals one process on the whole batch. One spawn per world size; the
parent compares.
"""
from __future__ import annotations

import contextlib
import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hf_models  # noqa: E402
from spawn import run_and_load  # noqa: E402

TOL, STEPS, LR = 1e-10, 2, 1e-2
VOCAB, DIM, HEADS, LEN = 64, 16, 4, 8

GPT_PLAN = {"wte": "embedding_rowwise", "blocks.*.attn.q": "colwise",
            "blocks.*.attn.k": "colwise", "blocks.*.attn.v": "colwise",
            "blocks.*.attn.proj": "rowwise", "blocks.*.mlp.fc": "colwise",
            "blocks.*.mlp.proj": "rowwise", "lm_head": "colwise_gather_output"}


class Attention(nn.Module):
    """Causal self-attention with separate q/k/v projections; the number of heads is read from
    the projected tensor (``-1``), so a rank holding half of the heads runs the same code."""

    def __init__(self) -> None:
        super().__init__()
        self.head_dim = DIM // HEADS
        self.q, self.k, self.v, self.proj = (nn.Linear(DIM, DIM) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (f(x).view(b, t, -1, self.head_dim).transpose(1, 2)
                   for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.proj = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = (nn.LayerNorm(DIM), Attention(),
                                                      nn.LayerNorm(DIM), MLP())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT's shape: token and position embeddings, blocks, the head tied to ``wte``."""

    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, DIM), nn.Embedding(LEN, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.ln_f, self.lm_head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def gpt() -> GPT:
    torch.manual_seed(3)
    return GPT().double()


def llama() -> nn.Module:
    return hf_models.llama(seed=0).double()


def gpt_ids(size: int = 4) -> torch.Tensor:
    return torch.randint(0, VOCAB, (size, LEN), generator=torch.Generator().manual_seed(5))


def gpt_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(ids)[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def llama_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def _steps(model, opt, loss_fn, batches, step) -> None:
    for ids in batches:
        step(opt, loss_fn(model, ids))


def reference(build, loss_fn, batches) -> dict:
    """The unsplit model on one process: its first logits and its state after the Adam steps."""
    model = build()
    logits = _logits(model, batches[0])
    opt = torch.optim.Adam(model.parameters(), lr=LR)

    def step(o, loss):
        loss.backward()
        o.step()
        o.zero_grad()
    _steps(model, opt, loss_fn, batches, step)
    return {"logits": logits, "state": model.state_dict()}


def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids)
    return (out if isinstance(out, torch.Tensor) else out.logits).detach().clone()


def _llama_case(rank: int, dp: int, mp: int) -> dict:
    """fleet.distributed_model applies the model's own plan; this data-parallel rank's slice."""
    from fleetx import fleet
    from fleetx.parallel.layers import ColumnParallelLinear, VocabParallelEmbedding
    s = fleet.DistributedStrategy()
    s.hybrid_configs = {"mp_degree": mp, "dp_degree": dp}
    fleet.init(is_collective=True, strategy=s)
    torch.manual_seed(100 + rank)  # seeded apart: the split must start from one model anyway
    plain = llama() if rank % mp == 0 else hf_models.llama(seed=rank + 7).double()
    model = fleet.distributed_model(plain)
    attn = plain.model.layers[0].self_attn
    kinds = {"q": type(attn.q_proj).__name__, "o": type(attn.o_proj).__name__,
             "head": type(plain.lm_head).__name__,
             "embed": isinstance(plain.model.embed_tokens, VocabParallelEmbedding),
             "q_rows": tuple(attn.q_proj.weight.shape), "k_rows": tuple(attn.k_proj.weight.shape),
             "gather": isinstance(plain.lm_head, ColumnParallelLinear)
             and plain.lm_head.gather_output}
    batches = [hf_models.batch(4, seed=1 + i) for i in range(STEPS)]
    share = slice(fleet.get_hybrid_communicate_group().get_data_parallel_rank() * 4 // dp,
                  (fleet.get_hybrid_communicate_group().get_data_parallel_rank() + 1) * 4 // dp)
    logits = _logits(model, batches[0])
    opt = fleet.distributed_optimizer(torch.optim.Adam(model.parameters(), lr=LR))
    model.train()
    _steps(model, opt, llama_loss, [b[share] for b in batches], lambda o, loss: o.minimize(loss))
    return {"kinds": kinds, "logits": logits,
            "state": fleet.meta_parallel.full_state_dict(plain),
            "plan": fleet.applied_strategies()}


def _gpt_case(group) -> dict:
    from fleetx import fleet
    model = fleet.meta_parallel.parallelize(gpt(), GPT_PLAN, mp_group=group)
    logits = _logits(model, gpt_ids())
    opt = torch.optim.Adam(model.parameters(), lr=LR)

    def step(o, loss):
        loss.backward()
        o.step()
        o.zero_grad()
    _steps(model, opt, gpt_loss, [gpt_ids()] * STEPS, step)
    return {"logits": logits, "tied": model.lm_head.weight is model.wte.weight,
            "state": fleet.meta_parallel.full_state_dict(model),
            "local": tuple(model.blocks[0].mlp.fc.weight.shape)}


@contextlib.contextmanager
def float64():
    """Hugging Face models built and run in float64 (their buffers follow the default)."""
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(torch.float32)


def _work(rank: int, world: int, out: str) -> None:
    import torch.distributed as dist
    with float64():
        results = {"llama": _llama_case(rank, world // 2, 2)}
    if world == 2:
        results["gpt"] = _gpt_case(dist.new_group([0, 1]))
    torch.save(results, f"{out}/rank{rank}.pt")


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and (a - b).abs().max().item() <= TOL


def _same_state(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    assert worst <= TOL, worst


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    hf_models.transformers()
    return run_and_load(_work, 2, tmp_path_factory.mktemp("tp_plan"), deadline=240)


def _llama_reference() -> dict:
    with float64():
        return reference(llama, llama_loss, [hf_models.batch(4, seed=1 + i)
                                             for i in range(STEPS)])


def test_llama_own_plan_equals_the_unsplit_model(ranks):
    ref = _llama_reference()
    with float64():
        start = llama().state_dict()
    assert max((ref["state"][k] - v).abs().max().item() for k, v in start.items()) > 1e-3
    for r in ranks:
        k = r["llama"]["kinds"]
        assert (k["q"], k["o"], k["embed"], k["gather"]) == (
            "ColumnParallelLinear", "RowParallelLinear", True, True)
        # 4 query heads and 2 key/value heads of head_dim 8: half of each per rank
        assert (k["q_rows"], k["k_rows"]) == ((16, 32), (8, 32))
        assert "tensor_parallel_plan" in r["llama"]["plan"]
        assert _close(r["llama"]["logits"], ref["logits"])
        _same_state(r["llama"]["state"], ref["state"])


def test_nanogpt_user_plan_equals_the_unsplit_model(ranks):
    ref = reference(gpt, gpt_loss, [gpt_ids()] * STEPS)
    for r in ranks:
        assert r["gpt"]["tied"] and r["gpt"]["local"] == (2 * DIM, DIM)
        assert _close(r["gpt"]["logits"], ref["logits"])
        state = {k: v for k, v in r["gpt"]["state"].items()}
        _same_state(state, ref["state"])
    assert not math.isclose(ref["logits"].abs().sum().item(), 0.0)


@pytest.mark.slow
def test_data_parallel_over_tensor_parallel_equals_one_process(tmp_path):
    """dp 2 x mp 2: each replica steps on half of the batch; together one process's step."""
    hf_models.transformers()
    got = run_and_load(_work, 4, tmp_path, deadline=300)
    ref = _llama_reference()
    for r in got:
        assert _close(r["llama"]["logits"], ref["logits"])
        assert "data_parallel" in r["llama"]["plan"]
        _same_state(r["llama"]["state"], ref["state"])
