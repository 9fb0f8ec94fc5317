"""The pure parts of the sharding engine: which sub-modules become FSDP units, and the refusals of
the optimizer rebinding (no processes needed)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from fleetx.strategy.algorithms.sharding_engine import (ShardRecord, rebound_optimizer,
                                                        sharding_units)
from fleetx.strategy.api import StrategyError


class Net(nn.Module):
    """Containers of every kind, a parameter-free child and a tied pair; no repeated block (a
    ModuleList of two modules of one class), so each child is a unit."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 4)
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.LayerNorm(4)])
        self.stack = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4))
        self.heads = nn.ModuleDict({"a": nn.Linear(4, 2)})
        self.act = nn.ReLU()
        self.out = nn.Linear(4, 5, bias=False)
        self.out.weight = self.embed.weight  # tied: both stay in the root unit


def test_units_look_through_containers_and_leave_tied_modules_to_the_root():
    model = Net()
    names = {id(m): n for n, m in model.named_modules()}
    assert [names[id(u)] for u in sharding_units(model)] == [
        "blocks.0", "blocks.1", "stack.0", "stack.2", "heads.a"]


def test_an_optimizer_over_a_foreign_parameter_is_refused_naming_its_group_and_shape():
    model, stranger = nn.Linear(3, 2), nn.Parameter(torch.ones(7, 1))
    opt = torch.optim.Adam([{"params": model.parameters()}, {"params": [stranger]}])
    with pytest.raises(StrategyError) as err:
        rebound_optimizer(opt, model, ShardRecord(2, (1, 2)))
    assert str(err.value) == (
        "sharding: param group 1 of the Adam holds a parameter of shape (7, 1) that is not a "
        "parameter of the model given to fleet.distributed_model; build the optimizer over that "
        "model's parameters only")


def test_an_optimizer_already_over_the_model_is_kept():
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert rebound_optimizer(opt, model, ShardRecord(2, (1, 2))) is opt
