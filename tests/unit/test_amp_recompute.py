"""amp and recompute together: a module that recompute checkpoints is recomputed in backward in
the precisions it ran in during the forward, black-listed (float32) layers included.

torch.utils.checkpoint restores the forward's autocast state when it recomputes, but not amp's
per-module precision hooks; without them a float32-listed ``Linear`` inside a recomputed block
is recomputed in bfloat16 and checkpoint refuses the mismatch ("Recomputed values ... have
different metadata").
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from fleetx import DistributedStrategy
from fleetx.fleet import Fleet

DEPTH, WIDTH, BATCH = 3, 16, 8


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.LayerNorm(2 * WIDTH),
                            nn.Linear(2 * WIDTH, WIDTH)) for _ in range(DEPTH)]
    return nn.Sequential(*blocks, nn.Linear(WIDTH, 1))


def _grads(black: list[str], recompute: bool) -> dict[str, torch.Tensor]:
    s = DistributedStrategy()
    s.amp = True
    s.amp_configs = {"custom_black_list": black, "init_loss_scaling": 1.0}
    if recompute:
        s.recompute = True
        s.recompute_configs = {"checkpoints": [str(i) for i in range(DEPTH)]}
    fleet = Fleet()
    fleet.init(is_collective=True, strategy=s)
    model = fleet.distributed_model(_mlp())
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.0))
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(1))
    opt.backward(model(x).pow(2).mean())
    return {n: p.grad.clone() for n, p in model.module.named_parameters()}


@pytest.mark.parametrize("black", [["Linear"], ["LayerNorm"], []])
def test_recomputed_blocks_keep_their_listed_precision(one_process, black):
    expected = _grads(black, recompute=False)
    got = _grads(black, recompute=True)
    assert got.keys() == expected.keys()
    for name, grad in expected.items():
        assert torch.equal(got[name], grad), name


def test_the_black_list_changes_the_gradients(one_process):
    """Not vacuous: float32 and bfloat16 linear layers give different gradients here."""
    assert not all(torch.equal(a, b) for a, b in
                   zip(_grads(["Linear"], False).values(), _grads([], False).values()))
