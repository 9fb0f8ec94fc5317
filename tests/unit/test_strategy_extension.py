"""A strategy defined outside fleetx: its module (here, this file) and its field are all it takes.

The strategy below records the training losses. Registered with its switch declared, the
planner plans it among fleetx's own, the plan and ``fleet.explain()`` name it with its reason,
its hooks run in one process's training, Paddle's name for it shows in the applied meta list,
and its field saves, loads and checks like Paddle's. Nothing in the fleetx package names it.
Each test registers it and removes it again, so no other test sees it.
"""
from __future__ import annotations

import contextlib
import io
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest
import torch
from torch import nn

import fleetx
from fleetx import DistributedStrategy
from fleetx.fleet import Fleet
from fleetx.strategy import fields
from fleetx.strategy.algorithms.data_parallel import DataParallelStrategy
from fleetx.strategy.api import (Mode, PlanInput, Strategy, StrategyError, TrainingContext,
                                 Verdict, WorldInfo, register, registered, unregister)
from fleetx.strategy.config import Config, option
from fleetx.strategy.planner import load_strategies, make_plan


# -- the strategy's module -------------------------------------------------------------------
@dataclass
class LossLogConfig(Config):
    """``strategy.loss_log_configs``: which losses to keep."""

    section = "loss_log_configs"

    every: int = option(1, "Keep the loss of every this many backward passes.", ge=1)


class LossLogStrategy(Strategy):
    """Keeps every ``every``-th loss and counts the optimizer steps, in the optimizer's state."""

    name = "loss_log"
    config = LossLogConfig
    paddle_name = "LossLogOptimizer"
    runs_after = (DataParallelStrategy,)  # a relation to one of fleetx's own strategies

    def can_apply(self, plan_input: PlanInput) -> Verdict:
        if plan_input.world.mode is not Mode.COLLECTIVE:
            return Verdict.fail("runs in collective mode only")
        every = self.strategy.typed_config("loss_log").every
        return Verdict.ok(f"keeps every {every}. loss")

    def apply(self, ctx: TrainingContext) -> None:
        every = self.strategy.typed_config("loss_log").every
        log = ctx.state[self.name] = {"losses": [], "seen": 0, "steps": 0}

        def record(loss: torch.Tensor) -> None:
            log["seen"] += 1
            if log["seen"] % every == 0:
                log["losses"].append(loss.item())

        def count() -> None:
            log["steps"] += 1

        ctx.loss_listeners.append(record)
        ctx.after_step.append(count)


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """The strategy and its field, as importing its module would install them; removed after."""
    fields.declare("loss_log", "Keep the training losses (loss_log_configs).", LossLogConfig)
    try:
        register(LossLogStrategy)
        try:
            yield
        finally:
            unregister(LossLogStrategy)
    finally:
        fields.undeclare("loss_log")


@pytest.fixture
def loss_log():
    with installed():
        yield


def _strategy(every: int = 1) -> DistributedStrategy:
    s = DistributedStrategy()
    s.loss_log = True
    s.loss_log_configs = {"every": every}
    return s


# -- the tests -------------------------------------------------------------------------------
def test_the_planner_plans_it_in_its_declared_place(loss_log):
    plan = make_plan(PlanInput(_strategy(2), WorldInfo(world_size=2)))
    assert plan.applied == ("data_parallel", "loss_log")
    entry = next(e for e in plan.entries if e.name == "loss_log")
    assert entry.reason == "keeps every 2. loss"
    assert "2. loss_log                   applied   keeps every 2. loss" in str(plan)
    off = make_plan(PlanInput(DistributedStrategy(), WorldInfo()))
    assert next(e for e in off.entries if e.name == "loss_log").reason == "off"


def test_its_failed_precondition_is_reported_like_any_strategy(loss_log):
    with pytest.raises(StrategyError, match="loss_log: runs in collective mode only"):
        make_plan(PlanInput(_strategy(), WorldInfo(mode=Mode.PS)), [LossLogStrategy])


def test_its_field_checks_saves_and_loads_like_paddles(loss_log, tmp_path):
    s = _strategy(3)
    assert s.loss_log is True and s.typed_config("loss_log").every == 3
    with pytest.raises(ValueError, match=r"unknown loss_log_configs key 'evry' \(did you mean "
                                         r"'every'\?\)"):
        s.loss_log_configs = {"evry": 2}
    with pytest.raises(ValueError, match=r"loss_log_configs\['every'\] must be >= 1, got 0"):
        s.loss_log_configs = {"every": 0}
    with pytest.raises(TypeError, match="loss_log must be a bool, got int 1"):
        s.loss_log = 1
    s.save_to_prototxt(tmp_path / "s.prototxt")
    text = (tmp_path / "s.prototxt").read_text()
    assert "loss_log: true" in text and "loss_log_configs {\n  every: 3\n}" in text
    loaded = DistributedStrategy()
    loaded.load_from_prototxt(tmp_path / "s.prototxt")
    assert loaded == s and DistributedStrategy.from_dict(s.to_dict()) == s
    assert pickle.loads(pickle.dumps(s)) == s
    assert "loss_log=True <-> loss_log_configs" in repr(s)
    # its configs set while its switch is off are named, as Paddle's are
    quiet = DistributedStrategy()
    quiet.loss_log_configs = {"every": 2}
    plan = make_plan(PlanInput(quiet, WorldInfo()))
    assert "loss_log_configs set while strategy.loss_log is off" in str(plan)


def test_its_hooks_run_in_training_and_fleet_reports_it(loss_log, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PADDLE_TRAINER_ENDPOINTS",
                 "PADDLE_TRAINER_ID", "PADDLE_PSERVERS_IP_PORT_LIST", "FLEETX_DRY_RUN"):
        monkeypatch.delenv(name, raising=False)
    fleet = Fleet()
    fleet.init(is_collective=True, strategy=_strategy(2))
    torch.manual_seed(0)
    model = fleet.distributed_model(nn.Linear(4, 1))
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    out = io.StringIO()
    fleet.explain(file=out)
    assert "1. loss_log                   applied   keeps every 2. loss" in out.getvalue()
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    losses = []
    for _ in range(4):
        loss = nn.functional.mse_loss(model(x), y)
        losses.append(loss.item())
        opt.minimize(loss)
    log = opt.state_dict()["fleetx"]["loss_log"]
    assert log == {"losses": [losses[1], losses[3]], "seen": 4, "steps": 4}
    assert fleet.applied_strategies() == ("loss_log",)
    assert fleet._get_applied_meta_list() == ["LossLogOptimizer"]
    assert fleet._final_strategy().loss_log is True


def test_nothing_in_fleetx_names_it_and_it_is_gone_afterwards():
    package = Path(fleetx.__file__).parent
    assert not [p for p in package.rglob("*.py") if "loss_log" in p.read_text(encoding="utf-8")]
    with installed():
        assert registered("loss_log") is LossLogStrategy
    load_strategies()
    assert "loss_log" not in [c.name for c in registered()]
    assert "loss_log" not in dir(DistributedStrategy())
    with pytest.raises(AttributeError, match="unknown DistributedStrategy attribute 'loss_log'"):
        DistributedStrategy().loss_log


def test_a_taken_or_misnamed_field_is_refused():
    with pytest.raises(ValueError, match="amp, amp_configs is a DistributedStrategy field "
                                         "already"):
        fields.declare("amp", "Again.", type("AmpAgain", (LossLogConfig,),
                                             {"section": "amp_configs"}))
    with pytest.raises(ValueError, match="the config of switch 'log' must have section "
                                         "'log_configs', got 'loss_log_configs'"):
        fields.declare("log", "Misnamed.", LossLogConfig)
    with pytest.raises(ValueError, match="unknown declared switch 'loss_log'"):
        fields.undeclare("loss_log")


def test_a_strategy_built_before_the_declaration_says_so():
    early = DistributedStrategy()
    with installed():
        with pytest.raises(TypeError, match="strategy.loss_log was declared after this "
                                            "DistributedStrategy was built; build a new one"):
            early.loss_log = True
        assert not hasattr(early, "loss_log") and _strategy().loss_log is True
