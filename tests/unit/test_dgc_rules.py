"""DGC's pure parts: schedule, compression step, optimizer split, verdicts (no processes)."""
from __future__ import annotations

import pytest
import torch

from fleetx.comm.hooks import done
from fleetx.strategy.algorithms.dgc import (MIN_NUMEL, DGCCodec, DGCConfig, DGCMomentumOptimizer,
                                            DGCState, DGCStrategy, compressible, sparsity_at)
from fleetx.strategy.api import (Mode, ModelInfo, OptimizerInfo, PlanInput, StrategyError,
                                 TrainingContext, WorldInfo)
from fleetx.strategy.distributed_strategy import DistributedStrategy
from fleetx.strategy.planner import make_plan, plan_for


# -- schedule --------------------------------------------------------------------------------
def test_sparsity_schedule_walks_the_list_then_holds_the_last():
    cfg = DGCConfig(rampup_begin_step=3, rampup_step=4, sparsity=[0.5, 0.9])
    assert [sparsity_at(s, cfg) for s in range(9)] == [None, None, None, 0.5, 0.5, 0.9, 0.9,
                                                       0.9, 0.9]


def test_empty_sparsity_means_0999_from_the_first_step():
    assert sparsity_at(0, DGCConfig()) == 0.999


def test_list_longer_than_rampup_steps_skips_entries():
    cfg = DGCConfig(rampup_step=2, sparsity=[0.1, 0.2, 0.3, 0.4])
    assert [sparsity_at(s, cfg) for s in range(3)] == [0.1, 0.3, 0.4]


def test_only_large_float32_parameters_are_compressed():
    assert compressible(torch.zeros(MIN_NUMEL)) and not compressible(torch.zeros(MIN_NUMEL - 1))
    assert not compressible(torch.zeros(MIN_NUMEL, dtype=torch.float64))


# -- one compression step, by hand -----------------------------------------------------------
def state_for(p, world=2, **sgd):
    opt = torch.optim.SGD([p], **{"lr": 0.1, "momentum": 0.5, **sgd})
    return DGCState(DGCConfig(), opt, {id(p): "w"}, world), opt


def test_momentum_correction_residual_and_masking():
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0, 0.5]))
    st, _ = state_for(p, weight_decay=0.2)
    g1 = torch.tensor([0.4, -0.1, 0.05, 0.2])  # already divided by the world size (2)
    index, values = st.compress(p, g1, sparsity=0.5)  # k = 2
    local = g1 + 0.2 / 2 * p.detach()  # the rank's share of the weight decay
    assert local.tolist() == pytest.approx([0.5, -0.3, 0.35, 0.25])
    assert sorted(index.tolist()) == [0, 2]  # |v| = |u| = |local|: 0.5 and 0.35 are largest
    assert sorted(values.tolist()) == pytest.approx([0.35, 0.5])
    assert st.u[id(p)].tolist() == pytest.approx([0.0, -0.3, 0.0, 0.25])  # masked where sent
    assert st.v[id(p)].tolist() == pytest.approx([0.0, -0.3, 0.0, 0.25])
    g2 = torch.zeros(4)
    index, values = st.compress(p, g2, sparsity=0.75)  # k = 1
    # u = 0.5 * u + wd share; v = v + u
    u2 = 0.5 * torch.tensor([0.0, -0.3, 0.0, 0.25]) + 0.1 * p.detach()
    v2 = torch.tensor([0.0, -0.3, 0.0, 0.25]) + u2
    assert index.tolist() == [1] and values.tolist() == pytest.approx([v2[1].item()])
    assert st.v[id(p)].tolist() == pytest.approx([v2[0].item(), 0.0, v2[2].item(),
                                                   v2[3].item()])


def test_nesterov_adds_the_gradient_and_the_corrected_momentum():
    p = torch.nn.Parameter(torch.zeros(4))
    st, _ = state_for(p, nesterov=True)
    g = torch.tensor([1.0, 2.0, 3.0, 4.0])
    st.compress(p, g, sparsity=0.75)
    # u = g; v = g + m * u = 1.5 g; the largest entry (index 3) is sent
    assert st.v[id(p)].tolist() == pytest.approx([1.5, 3.0, 4.5, 0.0])


def test_momentum_carries_over_from_the_optimizer_split_between_ranks():
    p = torch.nn.Parameter(torch.zeros(4))
    st, opt = state_for(p, world=4)
    opt.state[p]["momentum_buffer"] = torch.tensor([4.0, 8.0, 12.0, 16.0])
    st.compress(p, torch.zeros(4), sparsity=0.75)
    # u0 = buffer / world; u = 0.5 * u0; v = u; the largest is sent and masked
    assert st.u[id(p)].tolist() == pytest.approx([0.5, 1.0, 1.5, 0.0])


def test_at_least_one_entry_is_sent():
    p = torch.nn.Parameter(torch.zeros(10))
    st, _ = state_for(p)
    index, _ = st.compress(p, torch.arange(10.0), sparsity=0.999)
    assert index.tolist() == [9]


def test_state_dict_is_keyed_by_parameter_name():
    p = torch.nn.Parameter(torch.zeros(4))
    st, opt = state_for(p)
    st.compress(p, torch.tensor([1.0, 0.0, 0.0, 2.0]), sparsity=0.75)
    st.step = 7
    saved = st.state_dict()
    assert saved["step"] == 7 and list(saved["u"]) == ["w"]
    fresh = DGCState(DGCConfig(), opt, {id(p): "w"}, 2)
    fresh.load_state_dict(saved)
    assert fresh.step == 7 and torch.equal(fresh.v[id(p)], st.v[id(p)])


# -- the codec on a bucket, with a one-rank link ---------------------------------------------
class OneRankLink:
    world_size = 1

    def __init__(self):
        self.reduced, self.gathered = [], []

    def all_reduce(self, tensor):
        self.reduced.append(tensor.clone())
        return done(tensor)

    def all_gather(self, tensor):
        self.gathered.append(tensor.clone())
        return done([tensor])


class Bucket:
    def __init__(self, params, last=True):
        self.params, self.last = params, last

    def parameters(self):
        return self.params

    def index(self):
        return 0

    def is_last(self):
        return self.last


def test_codec_sends_topk_pairs_and_the_small_rest_dense():
    big = torch.nn.Parameter(torch.zeros(MIN_NUMEL))
    small = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([big, small], lr=0.1, momentum=0.9)
    cfg = DGCConfig(rampup_begin_step=1, sparsity=[0.999])
    st = DGCState(cfg, opt, {id(big): "big", id(small): "small"}, 1)
    codec, link = DGCCodec(st), OneRankLink()
    grad = torch.cat([torch.linspace(-1, 1, MIN_NUMEL), torch.tensor([5.0, 6.0, 7.0])])

    dense = codec.run(Bucket([big, small]), grad.clone(), link).wait()
    assert torch.equal(dense, grad) and len(link.gathered) == 0  # step 0: before ramp-up
    assert st.finish_step() == {} and st.step == 1

    out = codec.run(Bucket([big, small]), grad.clone(), link).wait()
    k = int(MIN_NUMEL * (1 - 0.999))  # 16
    packet = link.gathered[0]
    assert packet.numel() == 2 * k  # k int32 indices (bit-cast) + k float32 values
    sent = packet[:k].view(torch.int32).long()
    assert sorted(sent.tolist()) == list(range(8)) + list(range(MIN_NUMEL - 8, MIN_NUMEL))
    assert link.reduced[-1].tolist() == [5.0, 6.0, 7.0]  # the small parameter, dense
    assert out[MIN_NUMEL:].tolist() == [5.0, 6.0, 7.0]
    assert torch.equal(out[sent], grad[sent]) and (out[:MIN_NUMEL] != 0).sum() == k
    assert list(st.finish_step()) == [id(big)]


def test_codec_refuses_a_bucket_with_an_unexpected_layout():
    p = torch.nn.Parameter(torch.zeros(MIN_NUMEL))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    st = DGCState(DGCConfig(), opt, {id(p): "p"}, 1)
    with pytest.raises(RuntimeError, match="DGC expected a bucket of 16384 gradient elements"):
        DGCCodec(st).run(Bucket([p]), torch.zeros(MIN_NUMEL + 4), OneRankLink())


# -- the optimizer split ---------------------------------------------------------------------
def test_compressed_parameters_take_a_plain_step_the_rest_momentum_sgd():
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    inner = torch.optim.SGD([a, b], lr=0.5, momentum=0.9, weight_decay=0.1)
    st = DGCState(DGCConfig(), inner, {id(a): "a", id(b): "b"}, 2)
    opt = DGCMomentumOptimizer(inner, st)
    for _ in range(2):
        a.grad, b.grad = torch.full((2,), 0.2), torch.full((2,), 0.2)
        st.pending = {id(a): a}
        opt.step()
        assert torch.equal(a.grad, torch.full((2,), 0.2))  # gradients are given back
    # a: two plain steps of lr * update (momentum and decay were applied before sparsifying)
    assert a.tolist() == pytest.approx([1 - 2 * 0.5 * 0.2] * 2)
    # b: torch's momentum SGD with weight decay
    d1 = 0.2 + 0.1 * 1.0
    b1 = 1.0 - 0.5 * d1
    d2 = 0.2 + 0.1 * b1
    assert b.tolist() == pytest.approx([b1 - 0.5 * (0.9 * d1 + d2)] * 2)
    assert "momentum_buffer" not in inner.state[a]
    assert opt.param_groups is inner.param_groups and opt.state is inner.state
    opt.zero_grad()
    assert a.grad is None and b.grad is None


# -- verdicts and plans ----------------------------------------------------------------------
def dgc_strategy(**configs):
    s = DistributedStrategy()
    s.dgc = True
    if configs:
        s.dgc_configs = configs
    return s


SGD = OptimizerInfo("SGD", (("lr", 0.1), ("momentum", 0.9), ("dampening", 0),
                            ("nesterov", False), ("maximize", False)))
BIG_MODEL = ModelInfo(("w", "b"), (MIN_NUMEL, 10))


def verdict(world=WorldInfo(world_size=2), model=BIG_MODEL, optimizer=SGD, **configs):
    s = dgc_strategy(**configs)
    return DGCStrategy(s).can_apply(PlanInput(s, world, model, optimizer))


@pytest.mark.parametrize("optimizer,message", [
    (OptimizerInfo("Adam", (("lr", 0.1),)),
     "needs a momentum optimizer (torch.optim.SGD with momentum > 0), got Adam"),
    (OptimizerInfo("SGD", (("lr", 0.1), ("momentum", 0))),
     "needs a momentum optimizer (torch.optim.SGD with momentum > 0), got SGD with momentum=0"),
    (OptimizerInfo("SGD", (("momentum", 0.9), ("dampening", 0.1))),
     "momentum correction assumes SGD dampening=0, got dampening=0.1"),
    (OptimizerInfo("SGD", (("momentum", 0.9), ("maximize", True))),
     "SGD with maximize=True is not supported"),
])
def test_unmet_preconditions_fail(optimizer, message):
    v = verdict(optimizer=optimizer)
    assert v.error and v.reason == message


def test_parameter_server_mode_fails():
    v = verdict(world=WorldInfo(world_size=2, mode=Mode.PS))
    assert v.error and "collective mode only" in v.reason


def test_one_process_is_a_warned_skip():
    v = verdict(world=WorldInfo(world_size=1))
    assert (v.apply, v.warn, v.error) == (False, True, False)
    assert v.reason == "one process: no gradient is communicated"


def test_no_large_parameter_trains_densely_with_a_warning():
    v = verdict(model=ModelInfo(("w",), (MIN_NUMEL - 1,)))
    assert (v.apply, v.warn) == (False, True)
    assert v.reason == ("no parameter has 16384 elements or more, so every gradient would go "
                        "dense: plain data parallel")


def test_unknown_optimizer_waits_for_distributed_optimizer():
    v = verdict(optimizer=OptimizerInfo())
    assert (v.apply, v.warn, v.error) == (False, False, False)


def test_ok_reason_names_the_schedule():
    v = verdict(rampup_begin_step=5, rampup_step=10, sparsity=[0.9, 0.99])
    assert v.apply and v.reason == ("top-k exchange of 1 of 2 parameters (>= 16384 elements), "
                                    "the rest dense; sparsity [0.9, 0.99] over 10 steps from "
                                    "step 5")


def test_plan_raises_at_distributed_optimizer_naming_dgc():
    model = torch.nn.Linear(200, 100)
    with pytest.raises(StrategyError, match=r"dgc: needs a momentum optimizer \(torch.optim.SGD "
                                            r"with momentum > 0\), got Adam"):
        plan_for(dgc_strategy(), WorldInfo(world_size=2), model,
                 torch.optim.Adam(model.parameters()))


def test_plan_order_and_apply_installs_codec_and_optimizer():
    model = torch.nn.Linear(200, 100)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    s = dgc_strategy()
    s.fp16_allreduce = True
    plan = make_plan(PlanInput(s, WorldInfo(world_size=2), ModelInfo.of(model),
                               OptimizerInfo.of(opt)))
    assert plan.applied == ("data_parallel", "dgc", "fp16_allreduce")
    ctx = TrainingContext(WorldInfo(world_size=2), s, opt, model)
    DGCStrategy(s).apply(ctx)
    assert isinstance(ctx.optimizer, DGCMomentumOptimizer) and ctx.optimizer.inner is opt
    assert isinstance(ctx.comm_hooks[0][1], DGCCodec)
    assert ctx.state["dgc"].names[id(model.weight)] == "weight"


@pytest.mark.parametrize("other", ["amp", "lars", "localsgd", "adaptive_localsgd"])
def test_conflicts_are_named(other):
    model = torch.nn.Linear(200, 100)
    s = dgc_strategy()
    setattr(s, other, True)
    with pytest.raises(StrategyError, match=f"dgc: cannot be combined with {other}"):
        plan_for(s, WorldInfo(world_size=2), model,
                 torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
