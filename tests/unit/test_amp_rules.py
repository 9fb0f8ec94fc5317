"""AMP on one process: Paddle's loss-scaling rule, the precision lists, and the strategy through
the fleet API (inf steps skipped, the scale adapting, convergence, amp + lars / lamb)."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fleetx import DistributedStrategy
from fleetx.amp import PADDLE_OPS, LossScaler, PrecisionHooks, resolve
from fleetx.fleet import Fleet
from fleetx.optim import Lamb, LarsMomentum
from fleetx.strategy.api import StrategyError


@pytest.fixture
def make_fleet(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PADDLE_TRAINER_ENDPOINTS",
                 "PADDLE_TRAINER_ID", "PADDLE_PSERVERS_IP_PORT_LIST", "FLEETX_DRY_RUN"):
        monkeypatch.delenv(name, raising=False)

    def make(**amp_configs) -> Fleet:
        s = DistributedStrategy()
        s.amp = True
        if amp_configs:
            s.amp_configs = amp_configs
        f = Fleet()
        f.init(is_collective=True, strategy=s)
        return f
    return make


# -- the scaler ------------------------------------------------------------------------------------
def test_scaler_follows_paddles_rule():
    s = LossScaler(1000.0, incr_every_n_steps=3, decr_every_n_nan_or_inf=2, incr_ratio=2.0,
                   decr_ratio=0.5)
    seen = []
    for bad in (True, False, True, True, True, False, False, False, True, True):
        s.update(bad)
        seen.append((s.scale, s.good_steps, s.bad_steps))
    assert seen == [
        (1000, 0, 1),  # one bad step: no change yet
        (1000, 1, 0),  # a good step resets the bad count
        (1000, 0, 1), (500, 0, 0),  # two bad in a row: x0.5, count restarts
        (500, 0, 1),
        (500, 1, 0), (500, 2, 0), (1000, 0, 0),  # three good in a row: x2
        (1000, 0, 1), (500, 0, 0)]
    assert s.skipped_steps == 6


def test_scaler_bounds_and_fixed_mode():
    s = LossScaler(1.5, decr_every_n_nan_or_inf=1, decr_ratio=0.5)
    s.update(True)
    assert s.scale == 1.0  # never below 1
    big = LossScaler(3e38, incr_every_n_steps=1, incr_ratio=2.0)
    big.update(False)
    assert big.scale == 3e38  # growth that overflows is not taken
    fixed = LossScaler(64.0, incr_every_n_steps=1, decr_every_n_nan_or_inf=1, dynamic=False)
    for bad in (True, False, False):
        fixed.update(bad)
    assert fixed.scale == 64.0 and fixed.skipped_steps == 1


def test_scaler_unscales_and_finds_inf_and_nan():
    s = LossScaler(4.0)
    w = nn.Parameter(torch.ones(3))
    w.grad = torch.tensor([4.0, 8.0, 12.0])
    assert s.unscale_([w]) is False
    assert w.grad.tolist() == [1.0, 2.0, 3.0]
    for bad in (math.inf, math.nan):
        w.grad = torch.tensor([1.0, bad, 1.0])
        assert s.unscale_([w]) is True
    state = LossScaler(2.0)
    state.load_state_dict(s.state_dict())
    assert state.state_dict() == s.state_dict()


# -- the lists -------------------------------------------------------------------------------------
def test_resolve_names_paddle_ops_and_torch_classes():
    assert resolve("softmax") == (nn.Softmax,)
    assert resolve("layer_norm") == (nn.LayerNorm,)
    assert resolve("matmul") == resolve("mul") == (nn.Linear, nn.Bilinear)
    assert resolve("conv2d") == (nn.Conv2d,)
    assert resolve("LayerNorm") == resolve("nn.LayerNorm") == resolve("torch.nn.LayerNorm")
    with pytest.raises(ValueError) as err:
        resolve("exp")
    assert str(err.value).startswith("unknown op or module 'exp': name a torch.nn module class "
                                     "(e.g. 'LayerNorm') or one of the Paddle ops ")
    assert ", ".join(sorted(PADDLE_OPS)) in str(err.value)
    with pytest.raises(ValueError):
        resolve("functional")  # a torch.nn attribute, but not a module class


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(8, 8), nn.Softmax(-1), nn.Linear(8, 4)
        self.norm = nn.LayerNorm(4)

    def forward(self, x):
        return self.norm(self.fc2(self.act(self.fc1(x))))


def dtypes_of(model, hooks, x):
    """Output dtype of every submodule, recorded by hooks that run after the precision hooks."""
    seen = {}
    handles = [m.register_forward_hook(lambda m, a, out, n=name: seen.__setitem__(n, out.dtype))
               for name, m in model.named_modules() if name]
    with hooks.region():
        out = model(x)
    for h in handles:
        h.remove()
    return seen, out.dtype


def test_black_list_runs_float32_white_list_low_precision():
    torch.manual_seed(0)
    model, x = Block(), torch.randn(2, 8)
    plain = PrecisionHooks("cpu", torch.bfloat16)
    plain.install(model, black=(), white=())
    seen, out = dtypes_of(model, plain, x)
    assert seen == {"fc1": torch.bfloat16, "act": torch.bfloat16, "fc2": torch.bfloat16,
                    "norm": torch.bfloat16}
    assert out == torch.float32  # model outputs come back as float32
    plain.remove()

    hooks = PrecisionHooks("cpu", torch.bfloat16)
    hooks.install(model, black=resolve("mul"), white=resolve("softmax"))
    seen, _ = dtypes_of(model, hooks, x)
    # fc2 receives softmax's bfloat16 output: its pre-hook casts it back to float32. LayerNorm
    # is on neither list and follows its (float32) input, as autocast runs it on CPU.
    assert seen == {"fc1": torch.float32, "act": torch.bfloat16, "fc2": torch.float32,
                    "norm": torch.float32}
    hooks.remove()


def test_white_list_inside_a_black_listed_module_and_names():
    torch.manual_seed(0)
    model, x = Block(), torch.randn(2, 8)
    hooks = PrecisionHooks("cpu", torch.bfloat16)
    hooks.install(model, black=(Block,), white=resolve("layer_norm"), black_names=["fc1"])
    seen, _ = dtypes_of(model, hooks, x)
    assert seen == {"fc1": torch.float32, "act": torch.float32, "fc2": torch.float32,
                    "norm": torch.bfloat16}
    with pytest.raises(ValueError, match=r"custom_black_varnames \['nope'\] name no module"):
        PrecisionHooks("cpu", torch.bfloat16).install(model, (), (), black_names=["nope"])


def test_hooks_are_inert_outside_the_region():
    model = Block()
    hooks = PrecisionHooks("cpu", torch.bfloat16)
    hooks.install(model, black=resolve("mul"), white=resolve("softmax"))
    assert model(torch.randn(2, 8)).dtype == torch.float32
    assert not hooks._entered  # every pre-hook was matched by its post-hook


# -- the strategy through the fleet ---------------------------------------------------------------
def test_plan_and_get_loss_scaling(make_fleet):
    f = make_fleet(init_loss_scaling=1024.0)
    model = f.distributed_model(Block())
    opt = f.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    assert f.applied_strategies() == ("amp",)
    assert "autocast bfloat16 on cpu, dynamic loss scale from 1024" in str(f.plan)
    assert opt.get_loss_scaling() == 1024.0
    assert opt.state_dict()["fleetx"]["amp"]["scale"] == 1024.0
    with pytest.raises(AttributeError, match="no attribute 'get_nothing'"):
        opt.get_nothing()


@pytest.mark.parametrize("configs, message", [
    ({"use_pure_fp16": True}, "amp: use_pure_fp16 is not supported"),
    ({"custom_white_list": ["softmax"], "custom_black_list": ["nn.Softmax"]},
     "amp: amp_configs: Softmax is on both custom_white_list and custom_black_list"),
    ({"custom_black_list": ["exp"]}, "amp: amp_configs: unknown op or module 'exp'"),
])
def test_unmet_preconditions_raise_at_distributed_optimizer(make_fleet, configs, message):
    f = make_fleet(**configs)
    model = f.distributed_model(Block())
    with pytest.raises(StrategyError, match=message):
        f.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))


def test_unknown_black_varname_raises(make_fleet):
    f = make_fleet(custom_black_varnames=["fc9"])
    model = f.distributed_model(Block())
    with pytest.raises(StrategyError, match=r"amp: custom_black_varnames \['fc9'\]"):
        f.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))


def _step(opt, model, x, y, inject=False):
    opt.backward(nn.functional.mse_loss(model(x), y))
    if inject:
        next(model.parameters()).grad[0, 0] = math.inf
    opt.step()
    opt.zero_grad()


def test_inf_steps_are_skipped_and_scale_adapts(make_fleet):
    f = make_fleet(init_loss_scaling=256.0, decr_every_n_nan_or_inf=2, decr_ratio=0.5,
                   incr_every_n_steps=2, incr_ratio=4.0)
    model = f.distributed_model(Block())
    opt = f.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    scales = []
    for inject in (False, True, True, False, False, True):
        before = [p.detach().clone() for p in model.parameters()]
        momentum = {k: v["momentum_buffer"].clone() for k, v in enumerate(opt.state.values())}
        _step(opt, model, x, y, inject)
        changed = any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
        assert changed is not inject
        if inject:  # a skipped step leaves the optimizer state alone too
            after = {k: v["momentum_buffer"] for k, v in enumerate(opt.state.values())}
            assert all(torch.equal(momentum[k], after[k]) for k in momentum)
        scales.append(opt.get_loss_scaling())
    assert scales == [256.0, 256.0, 128.0, 128.0, 512.0, 512.0]


def test_a_backward_outside_the_optimizer_is_refused(make_fleet):
    f = make_fleet()
    model = f.distributed_model(Block())
    opt = f.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    model(torch.randn(2, 8)).sum().backward()
    with pytest.raises(RuntimeError, match="amp: the gradients did not come from the scaled loss"):
        opt.step()


def test_training_converges():
    torch.manual_seed(0)
    f = Fleet()
    s = DistributedStrategy()
    s.amp = True
    f.init(is_collective=True, strategy=s)
    model = f.distributed_model(nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3)))
    opt = f.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 10, generator=g)
    y = (x[:, :3] * 2).argmax(1)
    losses = []
    for _ in range(60):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.minimize(loss)
        losses.append(loss.item())
    assert losses[-1] < 0.25 * losses[0]
    assert opt.get_loss_scaling() == 32768.0  # bfloat16 never overflows here


@pytest.mark.parametrize("switch, make_opt, inner", [
    ("lars", lambda p: torch.optim.SGD(p, lr=1.0, momentum=0.9), LarsMomentum),
    ("lamb", lambda p: torch.optim.Adam(p, lr=0.02), Lamb),
])
def test_amp_composes_with_lars_and_lamb(monkeypatch, switch, make_opt, inner):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    torch.manual_seed(0)
    s = DistributedStrategy()
    s.amp = True
    s.amp_configs = {"init_loss_scaling": 128.0, "decr_every_n_nan_or_inf": 1}
    setattr(s, switch, True)
    if switch == "lars":
        s.lars_configs = {"lars_coeff": 0.02}
    f = Fleet()
    f.init(is_collective=True, strategy=s)
    model = f.distributed_model(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4)))
    opt = f.distributed_optimizer(make_opt(model.parameters()))
    assert f.applied_strategies() == ("amp", switch) and isinstance(opt.inner, inner)
    x = torch.randn(64, 8)
    y = x[:, :4] - x[:, 4:]
    first = nn.functional.mse_loss(model(x), y).item()
    _step(opt, model, x, y, inject=True)
    assert opt.get_loss_scaling() == 128.0 * 0.8 and not opt.inner.state  # skipped: no state
    for _ in range(30):
        _step(opt, model, x, y)
    assert nn.functional.mse_loss(model(x), y).item() < 0.7 * first
