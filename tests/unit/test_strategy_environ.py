"""Strategies take the launcher's settings from the world object, captured when the world is
made, never from the process environment in ``apply``: a variable changed (even to garbage)
after the world was made does not reach the parameter-server runtime."""
from __future__ import annotations

import pathlib
import re

import torch
from torch import nn

from fleetx.strategy.api import Mode, TrainingContext, WorldInfo, registered
from fleetx.strategy.distributed_strategy import DistributedStrategy
from fleetx.strategy.planner import load_strategies

STRATEGY_DIR = pathlib.Path(__file__).resolve().parents[2] / "fleetx" / "strategy"


def test_the_world_captures_the_environment_and_apply_uses_only_that(monkeypatch):
    monkeypatch.setenv("FLEETX_PS_MAX_LR", "3.5")
    monkeypatch.setenv("FLEETX_PS_SECRET", "s3cret")
    world = WorldInfo(mode=Mode.PS, server_num=1, server_endpoints=("127.0.0.1:9",))
    assert world.environ["FLEETX_PS_MAX_LR"] == "3.5"
    assert "s3cret" not in repr(world)  # held for the runtime, never printed
    monkeypatch.setenv("FLEETX_PS_MAX_LR", "not a number")  # would raise EnvError if read now
    monkeypatch.setenv("FLEETX_PS_SECRET", "changed")
    load_strategies()
    model = nn.Linear(2, 1)
    s = DistributedStrategy()
    ctx = TrainingContext(world, s, torch.optim.SGD(model.parameters(), lr=0.1), model)
    registered("parameter_server")(s).apply(ctx)
    assert ctx.runtime.config.max_lr == 3.5
    assert ctx.runtime.config.secret == "s3cret"


def test_no_strategy_module_reads_the_environment_itself():
    # Strategies read settings from world.environ; only fleetx/env.py touches os.environ, and a
    # strategy module calls the env getters only with an explicit mapping. plan.py (part of the
    # api.py contract) is where the world object captures the variables.
    for path in STRATEGY_DIR.glob("*.py"):
        if path.name == "plan.py":
            continue
        text = path.read_text(encoding="utf-8")
        assert "os.environ" not in text and "getenv" not in text, path.name
        for call in re.findall(r"env\.get(?:_int|_float|_list)?\(([^)]*)\)", text):
            assert "env=" in call, f"{path.name}: env getter without a mapping: {call}"
