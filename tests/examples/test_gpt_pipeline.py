"""The example GPT as a pipeline of 2 stages (``model.pipeline_layers``, the head tied to the
token embedding across the stages by a ``SharedLayerDesc``, the blocks split evenly) trains
equal to the unsplit ``GPT``: the stages' state dicts, merged and mapped by
``model.unpipelined_state``, load into a ``GPT``; three ``train_batch`` steps of 2 micro-batches
give the losses and weights of the same steps on that ``GPT`` (1e-5, float32)."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "distributed"))
from spawn import run_and_load  # noqa: E402

VOCAB, BLOCK, EMBD, LAYERS, STEPS = 20, 12, 16, 2, 3


def _batches() -> list:
    g = torch.Generator().manual_seed(3)
    ids = [torch.randint(0, VOCAB, (4, BLOCK + 1), generator=g) for _ in range(STEPS)]
    return [(x[:, :-1], x[:, 1:]) for x in ids]


def _work(rank: int, world: int, out: str) -> None:
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT / "examples" / "gpt"))
    from model import GPTConfig, lm_loss, pipeline_layers

    from fleetx import fleet
    s = fleet.DistributedStrategy()
    s.hybrid_configs = {"pp_degree": 2}
    s.pipeline_configs = {"micro_batch_size": 2, "accumulate_steps": 2}
    fleet.init(is_collective=True, strategy=s)
    torch.manual_seed(rank)  # the stages draw differently; the tie must still hold
    stage = fleet.meta_parallel.PipelineLayer(
        pipeline_layers(GPTConfig(VOCAB, BLOCK, LAYERS, 2, EMBD)), loss_fn=lm_loss,
        seg_method="layer:PipeBlock")
    model = fleet.distributed_model(stage)
    initial = [None] * world
    dist.all_gather_object(initial, {k: v.clone() for k, v in model.state_dict().items()})
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.5))
    losses = [model.train_batch(list(batch), opt).item() for batch in _batches()]
    final = [None] * world
    dist.all_gather_object(final, model.state_dict())
    torch.save({"initial": initial, "final": final, "losses": losses,
                "layers": sorted({k.split(".")[0] for k in model.state_dict()}, key=int)},
               f"{out}/rank{rank}.pt")


def test_pipelined_gpt_trains_equal_to_the_unsplit_gpt(tmp_path):
    sys.path.insert(0, str(ROOT / "examples" / "gpt"))
    from model import GPT, GPTConfig, lm_loss, unpipelined_state

    a, b = run_and_load(_work, 2, tmp_path, deadline=240)
    # embeddings and block 0 on stage 0; block 1, the final norm and the head on stage 1
    assert a["layers"] == ["0", "1"] and b["layers"] == ["2", "3", "4"]
    merged = {k: v for stage in a["initial"] for k, v in stage.items()}
    assert torch.equal(merged["0.tok_emb.weight"], merged["4.tok_emb.weight"])  # tied copies
    plain = GPT(GPTConfig(VOCAB, BLOCK, LAYERS, 2, EMBD))
    plain.load_state_dict(unpipelined_state(merged, LAYERS))
    opt = torch.optim.SGD(plain.parameters(), lr=0.5)
    losses = []
    for x, y in _batches():  # the same 2 micro-batches of 2, their mean loss
        halves = [lm_loss(plain(x[i:i + 2]), y[i:i + 2]) for i in (0, 2)]
        opt.zero_grad()
        (sum(halves) / 2).backward()
        opt.step()
        losses.append(sum(h.item() for h in halves) / 2)
    assert a["losses"] == b["losses"]
    assert max(abs(p - q) for p, q in zip(a["losses"], losses)) < 1e-5
    final = unpipelined_state({k: v for stage in a["final"] for k, v in stage.items()}, LAYERS)
    assert not torch.allclose(final["tok_emb.weight"], merged["0.tok_emb.weight"])  # trained
    tied = {k: v for stage in b["final"] for k, v in stage.items()}["4.tok_emb.weight"]
    assert torch.equal(tied, final["tok_emb.weight"])  # the head's copy stayed the same
    for name, value in plain.state_dict().items():
        assert torch.allclose(final[name], value, atol=1e-5, rtol=0), name
