"""Recompute combined with sharding, on 2 processes: at every stage, gradients and parameters
after a few Adam steps equal the same sharded strategy without recompute (1e-6).

Sharding shapes the model when it is given to ``distributed_model`` (FSDP2 ``fully_shard`` on
each top-level block and the root at stages 2 and 3); recompute checkpoints the named modules
when the model is first run, so it wraps the forward of modules that are already FSDP units
(``"0"``), or sit inside one (``"1.net"``, ``"1.net.0"``). At stage 3 a unit's parameters are
freed after its forward, so the recomputed forward in backward only works if they are gathered
again for it: the equality below proves it. The functional form (``fleet.utils.recompute(block,
x)`` in the model's forward) checkpoints the call of an FSDP unit itself, FSDP2's gathering hooks
included, and must equal too. The blocks hold a dropout, so the recomputed forward must also
draw the same mask. One spawn runs every case; the parent compares.
"""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spawn import max_diff, run_and_load  # noqa: E402

WORLD, B, WIDTH, STEPS, LR = 2, 4, 8, 3, 0.01
# Every block holding parameters is checkpointed somewhere: a whole FSDP unit, a child of a
# unit, and a leaf inside a unit.
NAMES = ["0", "1.net", "2.net.0"]


class Block(nn.Module):
    """A residual MLP block that counts its forwards (a recomputed block runs twice a step)."""

    def __init__(self) -> None:
        super().__init__()
        # Odd width: FSDP2 pads shards of a dimension that does not divide by the ranks.
        self.net = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH + 1), nn.GELU(), nn.Dropout(0.3),
                                 nn.Linear(2 * WIDTH + 1, WIDTH))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x + self.net(x)


def make_model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(Block(), Block(), Block(), nn.Linear(WIDTH, 3))


class Functional(nn.Module):
    """The same layers as :func:`make_model`, each block run through ``fleet.utils.recompute``
    from the forward (``functional=True``) or called plainly."""

    def __init__(self, functional: bool) -> None:
        super().__init__()
        self.layers, self.functional = make_model(), functional

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from fleetx.fleet.utils import recompute
        for layer in self.layers:
            x = recompute(layer, x) if self.functional and isinstance(layer, Block) else layer(x)
        return x


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach().clone()


def _case(rank: int, stage: int, recompute: bool, functional: bool = False) -> dict:
    """Adam steps under sharding ``stage`` (with recompute of NAMES or not), then one more
    backward: the full gradients, the full parameters, the plan and the blocks' forward counts."""
    from fleetx import fleet
    s = fleet.DistributedStrategy()
    s.sharding, s.sharding_configs = True, {"stage": stage}
    if recompute and not functional:
        s.recompute, s.recompute_configs = True, {"checkpoints": NAMES}
    fleet.init(is_collective=True, strategy=s)
    plain = Functional(recompute) if functional else make_model()
    layers = plain.layers if functional else plain
    inner = []  # calls of block 1's first Linear, which recompute of "1.net" runs again
    layers[1].net[0].register_forward_hook(lambda *_: inner.append(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = fleet.distributed_model(plain)
        opt = fleet.distributed_optimizer(torch.optim.Adam(model.parameters(), lr=LR))
    torch.manual_seed(100 + rank)  # each rank its own dropout masks, the same in both cases
    g = torch.Generator().manual_seed(2)
    sl = slice(rank * B, (rank + 1) * B)
    data = [(torch.randn(WORLD * B, WIDTH, generator=g), torch.randn(WORLD * B, 3, generator=g))
            for _ in range(STEPS + 1)]
    for x, y in data[:STEPS]:
        opt.minimize(nn.functional.mse_loss(model(x[sl]), y[sl]))
    x, y = data[STEPS]
    nn.functional.mse_loss(model(x[sl]), y[sl]).backward()
    grads = {name: _full(p.grad) for name, p in plain.named_parameters()}
    return {"grads": grads, "state": model.state_dict(), "plan": fleet.applied_strategies(),
            "calls": [layers[i].calls for i in range(3)] + [len(inner)]}


def _train(rank: int, world: int, out: str) -> None:
    results = {(stage, rc): _case(rank, stage, rc) for stage in (1, 2, 3) for rc in (False, True)}
    results.update({(stage, "functional"): _case(rank, stage, True, functional=True)
                    for stage in (1, 2, 3)})
    torch.save(results, f"{out}/rank{rank}.pt")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_and_load(_train, WORLD, tmp_path_factory.mktemp("sharding_recompute"),
                        deadline=600)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_recompute_with_sharding_equals_sharding_alone(ranks, stage):
    for r in ranks:
        plain, recomputed = r[(stage, False)], r[(stage, True)]
        assert "sharding" in recomputed["plan"] and "recompute" in recomputed["plan"]
        assert "recompute" not in plain["plan"]
        assert max_diff(plain["state"], make_model().state_dict()) > 1e-3  # the steps moved
        assert max_diff(recomputed["state"], plain["state"]) <= 1e-6
        assert max_diff(recomputed["grads"], plain["grads"]) <= 1e-6
        assert min(v.abs().max().item() for v in plain["grads"].values()) > 0


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_recompute_really_runs_the_named_blocks_twice(ranks, stage):
    forwards = STEPS + 1
    for r in ranks:
        assert r[(stage, False)]["calls"] == [forwards] * 4
        # block 0 is checkpointed whole (forward again in backward); blocks 1 and 2 only
        # inside, so their own forward runs once, and block 1's net (with its Linear) twice
        assert r[(stage, True)]["calls"] == [2 * forwards, forwards, forwards, 2 * forwards]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_functional_recompute_of_an_fsdp_unit_equals_sharding_alone(ranks, stage):
    for r in ranks:
        plain, functional = r[(stage, False)], r[(stage, "functional")]
        assert "recompute" not in functional["plan"]
        # the model's keys carry the wrapper's "layers." prefix
        state = {k.removeprefix("layers."): v for k, v in functional["state"].items()}
        grads = {k.removeprefix("layers."): v for k, v in functional["grads"].items()}
        assert max_diff(state, plain["state"]) <= 1e-6
        assert max_diff(grads, plain["grads"]) <= 1e-6
        assert functional["calls"][:3] == [2 * (STEPS + 1)] * 3  # every block recomputed
