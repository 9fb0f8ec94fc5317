"""The example GPT with its blocks split over 2 processes (``GPTConfig(tensor_parallel=True)``,
``hybrid_configs["mp_degree"] = 2``) trains: both ranks see the same loss at every step, the
loss on a fixed batch falls, each rank holds half of every split weight, and the ranks' shards
differ (drawn from the per-rank model-parallel stream, not copies of one another)."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "distributed"))
from spawn import run_and_load  # noqa: E402

VOCAB, EMBD, STEPS = 20, 32, 25


def _work(rank: int, world: int, out: str) -> None:
    import torch.nn.functional as F

    sys.path.insert(0, str(ROOT / "examples" / "gpt"))
    from model import GPT, GPTConfig

    from fleetx import fleet
    s = fleet.DistributedStrategy()
    s.hybrid_configs = {"mp_degree": 2}
    s.tensor_parallel_configs = {"tensor_init_seed": 7}
    fleet.init(is_collective=True, strategy=s)
    torch.manual_seed(0)
    model = fleet.distributed_model(GPT(GPTConfig(VOCAB, 16, n_layer=2, n_head=2, n_embd=EMBD,
                                                  tensor_parallel=True)))
    opt = fleet.distributed_optimizer(torch.optim.AdamW(model.parameters(), lr=3e-3))
    ids = torch.randint(0, VOCAB, (4, 13), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(STEPS):
        loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        opt.minimize(loss)
        losses.append(loss.item())
    block = model.module.blocks[0]
    torch.save({"losses": losses, "q": block.attn.q.weight.detach().clone(),
                "up": block.mlp[0].weight.shape, "down": block.mlp[2].weight.shape,
                "plan": fleet.applied_strategies()}, f"{out}/rank{rank}.pt")


def test_gpt_blocks_split_over_two_processes_train(tmp_path):
    ranks = run_and_load(_work, 2, tmp_path, deadline=240)
    a, b = ranks
    assert max(abs(x - y) for x, y in zip(a["losses"], b["losses"])) <= 1e-5
    assert a["losses"][-1] < 0.5 * a["losses"][0]
    assert a["up"] == (2 * EMBD, EMBD) and a["down"] == (EMBD, 2 * EMBD)  # 4C split in two
    assert a["q"].shape == (EMBD // 2, EMBD) and not torch.equal(a["q"], b["q"])
    assert "data_parallel" not in a["plan"]  # dp_degree 1: nothing replicated, no DDP
