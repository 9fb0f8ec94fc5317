"""Sharding rebuilds the user's optimizer (ZeroRedundancyOptimizer at stage 1, over FSDP2's
shards at stages 2 and 3) from its class, its groups and the defaults its constructor takes:
torch 2.13's ``AdamW`` records a default (``decoupled_weight_decay``) its constructor refuses.
No processes: the rebuild itself is checked here, the stages in
tests/distributed/test_recipe_sharding.py."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from fleetx.strategy.algorithms.sharding_engine import _same_kind
from fleetx.strategy.api import StrategyError


def _groups(model: nn.Module) -> list:
    """nanoGPT's two groups: decay on the 2-D weights only."""
    return [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]


def test_adamw_with_two_groups_is_rebuilt_with_each_groups_own_values():
    model = nn.Linear(3, 2)
    adamw = torch.optim.AdamW(_groups(model), lr=3e-4, betas=(0.9, 0.95))
    assert "decoupled_weight_decay" in adamw.defaults  # what the constructor refuses
    new = _same_kind(adamw, [dict(g) for g in adamw.param_groups])
    assert type(new) is torch.optim.AdamW
    assert [g["weight_decay"] for g in new.param_groups] == [0.1, 0.0]
    assert all(g["betas"] == (0.9, 0.95) and g["lr"] == 3e-4 and g["decoupled_weight_decay"]
               for g in new.param_groups)


class _Keywords(torch.optim.SGD):
    """An optimizer taking any keyword: every default is passed back."""

    def __init__(self, params, **kwargs):
        self.seen = dict(kwargs)
        super().__init__(params, lr=kwargs.pop("lr"), momentum=kwargs.pop("momentum", 0.0))


def test_a_constructor_taking_any_keyword_gets_every_default():
    opt = _Keywords(nn.Linear(2, 2).parameters(), lr=0.1, momentum=0.5)
    new = _same_kind(opt, [dict(g) for g in opt.param_groups])
    assert new.seen == opt.defaults


class _Fixed(torch.optim.SGD):
    """An optimizer whose constructor takes no hyperparameter at all."""

    def __init__(self, params, scale):
        super().__init__(params, lr=0.1 * scale)


def test_a_constructor_missing_a_required_argument_is_named():
    opt = _Fixed(nn.Linear(2, 2).parameters(), scale=1.0)
    with pytest.raises(StrategyError, match=r"cannot rebuild _Fixed over the sharded parameters "
                       r"from its defaults \(.*scale.*\); its constructor must accept its own "
                       r"defaults as keyword arguments"):
        _same_kind(opt, [dict(g) for g in opt.param_groups])
