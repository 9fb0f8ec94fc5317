"""The planner orders strategies by their declared relations (runs_after / runs_before /
requires), never by numbers: the applied order of representative strategy sets is pinned, a
cycle is an error naming it, and conflicts are judged the same at every world size."""
from __future__ import annotations

import warnings

import pytest

from fleetx.strategy import api
from fleetx.strategy.api import (Mode, ModelInfo, OptimizerInfo, OrderError, PlanInput, Strategy,
                                 StrategyError, Verdict, WorldInfo, registered, sort_strategies)
from fleetx.strategy.distributed_strategy import DistributedStrategy
from fleetx.strategy.planner import load_strategies, make_plan

SGDM = OptimizerInfo("SGD", (("lr", 0.1), ("momentum", 0.9), ("foreach", None)))
ADAM = OptimizerInfo("Adam", (("lr", 0.1), ("betas", (0.9, 0.999)), ("foreach", None)))
BIG = ModelInfo(("w",), (20000,))  # large enough for DGC to compress
W2 = WorldInfo(world_size=2, local_world_size=1, nnodes=2)
W4 = WorldInfo(world_size=4, local_world_size=2, nnodes=2)


def strategy(**fields):
    s = DistributedStrategy()
    for name, value in fields.items():
        setattr(s, name, value)
    return s


GM2 = {"gradient_merge": True, "gradient_merge_configs": {"k_steps": 2}}

# The applied order each set had when strategies were ordered by integers (amp 30, lars 40...):
# the relations must keep it.
PINNED = [
    (dict(amp=True, **GM2), W2, SGDM, ("data_parallel", "gradient_merge", "amp")),
    (dict(amp=True, lars=True), W2, SGDM, ("data_parallel", "amp", "lars")),
    (dict(amp=True, lamb=True, build_strategy={"fuse_all_optimizer_ops": True}), W2, ADAM,
     ("data_parallel", "amp", "lamb", "build_strategy")),
    (dict(localsgd=True, localsgd_configs={"k_steps": 2}, amp=True, lars=True), W2, SGDM,
     ("data_parallel", "localsgd", "amp", "lars")),
    (dict(adaptive_localsgd=True, amp=True, fp16_allreduce=True), W2, SGDM,
     ("data_parallel", "adaptive_localsgd", "amp", "fp16_allreduce")),
    (dict(fp16_allreduce=True, use_hierarchical_allreduce=True, nccl_comm_num=2, **GM2), W4,
     SGDM, ("data_parallel", "gradient_merge", "fp16_allreduce", "use_hierarchical_allreduce",
            "nccl_comm_num")),
    (dict(dgc=True, fp16_allreduce=True, **GM2), W2, SGDM,
     ("data_parallel", "dgc", "gradient_merge", "fp16_allreduce")),
    (dict(sync_batch_norm=True, lars=True, execution_strategy={"num_threads": 2}),
     WorldInfo(world_size=2, device="cuda"), SGDM,
     ("sync_batch_norm", "data_parallel", "lars", "execution_strategy")),
    (dict(build_strategy={"fuse_all_optimizer_ops": True}, execution_strategy={"num_threads": 2}),
     WorldInfo(world_size=2, mode=Mode.PS), SGDM,
     ("parameter_server", "build_strategy", "execution_strategy")),
    (dict(amp=True, lamb=True, **GM2), WorldInfo(), ADAM, ("gradient_merge", "amp", "lamb")),
]


@pytest.mark.parametrize("fields,world,opt,expected", PINNED,
                         ids=["+".join(sorted(p[0])) for p in PINNED])
def test_applied_order_is_pinned(fields, world, opt, expected):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = make_plan(PlanInput(strategy(**fields), world, BIG, opt))
    assert plan.applied == expected


def test_no_strategy_declares_an_order_number():
    load_strategies()
    for cls in registered():
        assert "order" not in vars(cls), f"{cls.__name__} still declares an order number"


def test_the_registry_order_is_deterministic_and_keeps_every_relation():
    load_strategies()
    order = [c.name for c in registered()]
    assert order == [c.name for c in sort_strategies(reversed(registered()))]
    pos = {name: i for i, name in enumerate(order)}
    for cls in registered():
        for other in cls.runs_after:
            assert pos[other.name] < pos[cls.name], (cls.name, other.name)
        for other in cls.runs_before:
            assert pos[cls.name] < pos[other.name], (cls.name, other.name)


def test_codecs_follow_the_plan_dgc_outermost():
    load_strategies()
    order = [c.name for c in registered()]
    assert order.index("dgc") < order.index("fp16_allreduce")


def _toy(name, **relations):
    def can_apply(self, p):
        return Verdict.ok()
    return type(f"T_{name}", (Strategy,), {"name": name, "can_apply": can_apply,
                                          "apply": lambda self, ctx: None, **relations})


def test_unrelated_strategies_are_taken_by_name():
    c, b, a = _toy("c"), _toy("b"), _toy("a")
    assert [x.name for x in sort_strategies([c, b, a])] == ["a", "b", "c"]
    later = _toy("a_later", runs_after=(b,))
    assert [x.name for x in sort_strategies([later, b, c])] == ["b", "a_later", "c"]


def test_requires_implies_runs_after_unless_runs_before_says_otherwise():
    base = _toy("z_base")
    user = _toy("a_user", requires=(base,))
    pre = _toy("b_pre", requires=(base,), runs_before=(base,))
    assert [x.name for x in sort_strategies([user, pre, base])] == ["b_pre", "z_base", "a_user"]


def test_runs_last_comes_after_every_strategy_that_does_not():
    last, other_last = _toy("a_last", runs_last=True), _toy("b_last", runs_last=True)
    early, late = _toy("y"), _toy("z", runs_after=(_toy("x"),))
    assert [x.name for x in sort_strategies([other_last, late, last, early])] == [
        "y", "z", "a_last", "b_last"]
    # the option bags apply to the final optimizer, after sharding rebuilt it
    load_strategies()
    bags = [registered(n) for n in ("sharding", "recompute", "build_strategy",
                                    "execution_strategy")]
    assert [x.name for x in sort_strategies(bags)] == [
        "recompute", "sharding", "build_strategy", "execution_strategy"]
    before_last = _toy("c", runs_after=(last,))
    with pytest.raises(OrderError, match="form a cycle: a_last -> c -> a_last"):
        sort_strategies([last, before_last])


def test_a_cycle_is_an_error_naming_it():
    a = _toy("a")
    b = _toy("b", runs_after=(a,))
    c = _toy("c", runs_after=(b,))
    a.runs_after = (c,)
    with pytest.raises(OrderError) as err:
        sort_strategies([a, b, c, _toy("d")])
    assert "form a cycle: a -> b -> c -> a" in str(err.value)
    assert isinstance(err.value, api.RegistryError)


CONFLICTS = [
    (dict(dgc=True, amp=True), "dgc: cannot be combined with amp"),
    (dict(localsgd=True, **GM2), "gradient_merge: cannot be combined with localsgd"),
    (dict(localsgd=True, adaptive_localsgd=True),
     "adaptive_localsgd: cannot be combined with localsgd"),
    (dict(dgc=True, lars=True), "dgc: cannot be combined with lars"),
]


@pytest.mark.parametrize("fields,message", CONFLICTS, ids=[m for _, m in CONFLICTS])
@pytest.mark.parametrize("world", [WorldInfo(), W2], ids=["1 process", "2 processes"])
def test_conflicts_fail_the_same_at_every_world_size(fields, message, world):
    with pytest.raises(StrategyError) as err:
        make_plan(PlanInput(strategy(**fields), world, BIG, SGDM))
    text = str(err.value)
    assert message in text and "(at any number of processes)" in text
    first, second = message.split(":")[0], message.rsplit(" ", 1)[1]
    assert f"strategy.{first} = False or strategy.{second} = False" in text
