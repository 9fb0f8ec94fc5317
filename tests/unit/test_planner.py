"""The planner is a pure function: strategies' verdicts, requirements and conflicts, no processes."""
from types import SimpleNamespace

import pytest
import torch

from fleetx import DistributedStrategy

from fleetx.strategy import api
from fleetx.strategy.algorithms.data_parallel import DataParallelStrategy
from fleetx.strategy.api import (Mode, ModelInfo, OptimizerInfo, PlanInput, Strategy,
                                 StrategyError, Verdict, WorldInfo, register, registered)
from fleetx.strategy.planner import make_plan, plan_for


def strategy(**kw):
    s = DistributedStrategy()
    for key, value in kw.items():
        setattr(s, key, value)
    return s


def test_one_process_plans_nothing():
    plan = make_plan(PlanInput(strategy(), WorldInfo()))
    assert plan.applied == ()
    entry = next(e for e in plan.entries if e.name == "data_parallel")
    assert entry.reason == "one process: nothing to synchronise"
    assert "no strategy applies" in str(plan)


def test_data_parallel_is_first_and_reports_bucket():
    plan = make_plan(PlanInput(strategy(fuse_grad_size_in_MB=8), WorldInfo(world_size=4)))
    assert plan.applied[0] == "data_parallel"
    assert "bucket 8 MB" in str(plan) and "over 4 processes" in str(plan)


def test_unfused_uses_tiny_buckets():
    plan = make_plan(PlanInput(strategy(fuse_all_reduce_ops=False), WorldInfo(world_size=2)))
    assert "bucket 1e-06 MB" in str(plan)


def test_ps_mode_skips_data_parallel():
    plan = make_plan(PlanInput(strategy(), WorldInfo(world_size=2, mode=Mode.PS)))
    assert "data_parallel" not in plan.applied


def test_apply_installs_ddp_options():
    s = strategy(fuse_grad_size_in_MB=4, find_unused_parameters=True)
    ctx = api.TrainingContext(WorldInfo(world_size=2), s)
    registered("data_parallel")(s).apply(ctx)
    assert ctx.ddp_options == {"bucket_cap_mb": 4.0, "find_unused_parameters": True}
    assert len(ctx.model_wrappers) == 1


# Toy strategies (not registered: passed to make_plan explicitly) for requires/conflicts/warnings.
class _Alpha(Strategy):
    name, runs_after = "_alpha", (DataParallelStrategy,)

    def can_apply(self, p):
        if p.optimizer.class_name == "Adam":
            return Verdict.fail("needs a momentum optimizer, got Adam")
        if p.world.world_size == 1:
            return Verdict.skip("one process: nothing to compress", warn=True)
        return Verdict.ok("on")

    def apply(self, ctx):
        pass


class _Beta(Strategy):
    name, requires = "_beta", (_Alpha,)

    def can_apply(self, p):
        return Verdict.ok()

    def apply(self, ctx):
        pass


class _Gamma(Strategy):
    name, conflicts = "_gamma", (_Alpha,)

    def can_apply(self, p):
        return Verdict.ok()

    def apply(self, ctx):
        pass


TOYS = [DataParallelStrategy, _Alpha, _Beta, _Gamma]


def toy_plan(s, world, **kw):
    return make_plan(PlanInput(s, world, **kw), TOYS)


def toy(**on):
    # A stand-in strategy object carrying the toy switches (real ones are DistributedStrategy).
    return SimpleNamespace(fuse_all_reduce_ops=True, fuse_grad_size_in_MB=32,
                           find_unused_parameters=False, _alpha=on.get("a", False),
                           _beta=on.get("b", False), _gamma=on.get("g", False))


def test_order_follows_the_declared_relations():
    plan = toy_plan(toy(a=True, b=True), WorldInfo(world_size=2))
    assert plan.applied == ("data_parallel", "_alpha", "_beta")


def test_precondition_failure_names_strategy():
    with pytest.raises(StrategyError) as err:
        toy_plan(toy(a=True), WorldInfo(world_size=2), optimizer=OptimizerInfo("Adam"))
    assert "_alpha: needs a momentum optimizer, got Adam" in str(err.value)


def test_warned_skip_is_printed():
    plan = toy_plan(toy(a=True), WorldInfo())
    assert [e.name for e in plan.warnings] == ["_alpha"]
    assert "_alpha" in str(plan) and "WARNING skipped" in str(plan)


def test_missing_requirement():
    with pytest.raises(StrategyError) as err:
        toy_plan(toy(b=True), WorldInfo(world_size=2))
    assert "_beta: requires _alpha" in str(err.value)


def test_conflict():
    with pytest.raises(StrategyError) as err:
        toy_plan(toy(a=True, g=True), WorldInfo(world_size=2))
    assert "_gamma: cannot be combined with _alpha" in str(err.value)


def test_registry_refuses_duplicates_and_names_known():
    class Dup(Strategy):
        name = "data_parallel"

        def can_apply(self, p):
            return Verdict.ok()

        def apply(self, ctx):
            pass

    with pytest.raises(api.RegistryError, match="already registered"):
        register(Dup)
    with pytest.raises(api.RegistryError, match="unknown strategy 'nope'; known: "):
        registered("nope")


def test_unregister_refuses_a_class_that_is_not_registered():
    class Stray(Strategy):
        name = "data_parallel"

        def can_apply(self, p):
            return Verdict.ok()

        def apply(self, ctx):
            pass

    with pytest.raises(api.RegistryError, match="Stray is not registered"):
        api.unregister(Stray)


def test_a_model_type_is_claimed_once_and_found_for_its_subclasses():
    from fleetx.parallel.pipeline import PipelineLayer
    from fleetx.strategy.planner import load_strategies

    load_strategies()

    class MyStage(PipelineLayer):
        pass

    build = api.model_builder(MyStage.__new__(MyStage))
    assert build is not None and build.__module__ == "fleetx.strategy.algorithms.pipeline"
    assert api.model_builder(torch.nn.Linear(1, 1)) is None
    with pytest.raises(api.RegistryError, match="model type PipelineLayer is already claimed by "
                                                "fleetx.strategy.algorithms.pipeline"):
        api.register_model_type(PipelineLayer, build)


def test_plan_for_extracts_model_and_optimizer_facts():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Embedding(10, 2, sparse=True))
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    plan = plan_for(strategy(), WorldInfo(world_size=2), model, opt)
    assert plan.applied == ("data_parallel",)
    info = ModelInfo.of(model)
    assert info.param_names == ("0.weight", "0.bias", "1.weight") and info.numel == 12 + 4 + 20
    assert info.sparse_modules == ("1",)
    o = OptimizerInfo.of(opt)
    assert o.class_name == "SGD" and o.get("momentum") == 0.9 and o.get("lr") == 0.5


def test_switches_without_effect_are_named_in_the_plan():
    s = strategy(asp=True, fuse_grad_size_in_num=16)
    plan = make_plan(PlanInput(s, WorldInfo(world_size=2)))
    entry = next(e for e in plan.entries if e.name == "no_effect")
    assert entry.warn and not entry.applied
    assert "asp (not implemented)" in entry.reason
    assert "fuse_grad_size_in_num (buckets are sized in MB" in entry.reason
    quiet = make_plan(PlanInput(strategy(), WorldInfo(world_size=2)))
    assert not [e for e in quiet.entries if e.name == "no_effect" and e.warn]


def test_a_strategy_without_a_switch_is_refused():
    class Misnamed(Strategy):
        name = "no_such_switch"

        def can_apply(self, p):
            return Verdict.ok()

        def apply(self, ctx):
            pass

    with pytest.raises(api.RegistryError, match="has no switch of that name on DistributedStrategy"):
        make_plan(PlanInput(strategy(), WorldInfo()), [Misnamed])
