"""LARS and LAMB on one process: the updates equal the formulas (computed here independently, in
float64, element by element) to 1e-6; exclusions by parameter name; the strategies' preconditions.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fleetx import DistributedStrategy
from fleetx.fleet import Fleet
from fleetx.optim import Lamb, LarsMomentum
from fleetx.strategy.api import StrategyError

STEPS = 4


pytestmark = pytest.mark.usefixtures("one_process")  # tests/conftest.py


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.fc = nn.Linear(5, 4)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.norm(self.fc(x))))


def data():
    g = torch.Generator().manual_seed(4)
    return [(torch.randn(16, 5, generator=g), torch.randn(16, 2, generator=g))
            for _ in range(STEPS)]


def train_with_fleet(switch, configs, make_opt):
    """Train Net through the fleet; return the parameters and the gradients of every step."""
    s = DistributedStrategy()
    setattr(s, switch, True)
    setattr(s, f"{switch}_configs", configs)
    f = Fleet()
    f.init(is_collective=True, strategy=s)
    model = f.distributed_model(Net())
    opt = f.distributed_optimizer(make_opt(model.parameters()))
    history = [{n: p.detach().double().clone() for n, p in model.module.named_parameters()}]
    grads = []
    for x, y in data():
        opt.backward(nn.functional.mse_loss(model(x), y))
        grads.append({n: p.grad.double().clone() for n, p in model.module.named_parameters()})
        opt.step()
        opt.zero_grad()
        history.append({n: p.detach().double().clone() for n, p in model.module.named_parameters()})
    return opt, history, grads


def norm(t):
    return math.sqrt(sum(v * v for v in t.flatten().tolist()))


# -- LARS ------------------------------------------------------------------------------------------
LR, MU, COEFF, WD, EPS = 0.5, 0.9, 0.01, 0.001, 1e-4


def lars_reference(w, g, v, wd):
    """Paddle's lars_momentum rule for one tensor, element by element in float64."""
    wn, gn = norm(w), norm(g)
    local_lr = LR * COEFF * wn / (gn + wd * wn + EPS) if wd > 0 and wn > 0 and gn > 0 else LR
    v_new = [MU * vi + local_lr * (gi + wd * wi)
             for vi, gi, wi in zip(v.flatten().tolist(), g.flatten().tolist(),
                                   w.flatten().tolist())]
    v_new = torch.tensor(v_new, dtype=torch.float64).view_as(w)
    return w - v_new, v_new


def test_lars_matches_the_formula_with_exclusions():
    configs = {"lars_coeff": COEFF, "lars_weight_decay": WD, "epsilon": EPS,
               "exclude_from_weight_decay": ["bias", "norm."]}
    opt, history, grads = train_with_fleet(
        "lars", configs, lambda p: torch.optim.SGD(p, lr=LR, momentum=MU))
    assert isinstance(opt.inner, LarsMomentum)
    excluded = {"fc.bias", "norm.weight", "norm.bias", "head.bias"}
    assert [sorted(len(g["params"]) for g in opt.param_groups)] == [[2, 4]]
    velocity = {n: torch.zeros_like(w) for n, w in history[0].items()}
    for step in range(STEPS):
        for name, w in history[step].items():
            wd = 0.0 if name in excluded else WD
            expected, velocity[name] = lars_reference(w, grads[step][name], velocity[name], wd)
            torch.testing.assert_close(history[step + 1][name], expected, rtol=0, atol=1e-6)


def test_lars_optimizer_state_round_trips():
    w = nn.Parameter(torch.ones(3))
    opt = LarsMomentum([w], lr=0.1)
    w.grad = torch.ones(3)
    opt.step()
    other = LarsMomentum([nn.Parameter(torch.ones(3))], lr=0.1)
    other.load_state_dict(opt.state_dict())
    assert torch.equal(next(iter(other.state.values()))["velocity"],
                       opt.state[w]["velocity"])
    with pytest.raises(ValueError, match="LarsMomentum lars_coeff must be >= 0, got -1"):
        LarsMomentum([w], lr=0.1, lars_coeff=-1)


@pytest.mark.parametrize("make_opt, configs, message", [
    (lambda p: torch.optim.Adam(p), {}, "lars: needs the inner optimizer to be Momentum "
                                        r"\(torch.optim.SGD with momentum > 0\), got Adam"),
    (lambda p: torch.optim.SGD(p, lr=0.1), {}, r"lars: needs torch.optim.SGD with momentum > 0"),
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True), {}, "nesterov=False"),
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-4), {},
     r"weight_decay=0 \(LARS applies lars_weight_decay itself\)"),
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
     {"exclude_from_weight_decay": ["batch_norm", ".b_0"]},
     r"lars: exclude_from_weight_decay entries \['batch_norm', '.b_0'\] match no parameter name "
     r"\(an entry matches a name that contains it; names look like "
     r"\['fc.weight', 'fc.bias', 'norm.weight'\]\)"),
])
def test_lars_preconditions(make_opt, configs, message):
    with pytest.raises(StrategyError, match=message):
        train_with_fleet("lars", configs, make_opt)


# -- LAMB ------------------------------------------------------------------------------------------
B1, B2, ADAM_EPS, LAMB_WD, LAMB_LR = 0.8, 0.95, 1e-6, 0.02, 0.05


def lamb_reference(w, g, m, v, t, wd):
    """Paddle's lamb rule for one tensor, element by element: no trust ratio without weight
    decay (paddle/phi/kernels/impl/lamb_kernel_impl.h)."""
    m = [B1 * mi + (1 - B1) * gi for mi, gi in zip(m, g.flatten().tolist())]
    v = [B2 * vi + (1 - B2) * gi * gi for vi, gi in zip(v, g.flatten().tolist())]
    r = [(mi / (1 - B1 ** t)) / (math.sqrt(vi / (1 - B2 ** t)) + ADAM_EPS) + wd * wi
         for mi, vi, wi in zip(m, v, w.flatten().tolist())]
    r_t = torch.tensor(r, dtype=torch.float64).view_as(w)
    wn, rn = norm(w), norm(r_t)
    trust = wn / rn if wd > 0 and wn > 0 and rn > 0 else 1.0
    return w - LAMB_LR * trust * r_t, m, v


@pytest.mark.parametrize("adam", [torch.optim.Adam, torch.optim.AdamW])
def test_lamb_matches_the_formula_with_exclusions(adam):
    # Suffixes, as Paddle's LAMB matches them: every bias and the norm's weight.
    configs = {"lamb_weight_decay": LAMB_WD, "exclude_from_weight_decay": [".bias", "norm.weight"]}
    opt, history, grads = train_with_fleet(
        "lamb", configs,
        lambda p: adam(p, lr=LAMB_LR, betas=(B1, B2), eps=ADAM_EPS, weight_decay=0.0))
    assert isinstance(opt.inner, Lamb)
    moments = {n: ([0.0] * w.numel(), [0.0] * w.numel()) for n, w in history[0].items()}
    for step in range(STEPS):
        for name, w in history[step].items():
            wd = 0.0 if name.endswith((".bias", "norm.weight")) else LAMB_WD
            expected, m, v = lamb_reference(w, grads[step][name], *moments[name], step + 1, wd)
            moments[name] = (m, v)
            torch.testing.assert_close(history[step + 1][name], expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("make_opt, message", [
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
     r"lamb: needs the inner optimizer to be Adam \(torch.optim.Adam or AdamW\), got SGD"),
    (lambda p: torch.optim.AdamW(p), r"lamb: needs torch.optim.AdamW with weight_decay=0 "
                                      r"\(got 0.01; LAMB applies lamb_weight_decay itself"),
    (lambda p: torch.optim.Adam(p, amsgrad=True), "amsgrad=False"),
])
def test_lamb_preconditions(make_opt, message):
    with pytest.raises(StrategyError, match=message):
        train_with_fleet("lamb", {}, make_opt)


def test_lamb_exclusions_are_suffixes():
    """"norm" is inside "norm.weight" but ends no name: LAMB refuses it where LARS accepts it."""
    with pytest.raises(StrategyError, match=r"lamb: exclude_from_weight_decay entries \['norm'\] "
                                            r"match no parameter name \(an entry matches a name "
                                            r"that ends with it"):
        train_with_fleet("lamb", {"exclude_from_weight_decay": ["norm"]},
                         lambda p: torch.optim.Adam(p, lr=0.01))
    train_with_fleet("lars", {"exclude_from_weight_decay": ["norm"]},
                     lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9))


def test_lars_and_lamb_keep_the_learning_rate_schedule():
    s = DistributedStrategy()
    s.lars = True
    f = Fleet()
    f.init(is_collective=True, strategy=s)
    model = f.distributed_model(Net())
    opt = f.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for x, y in data()[:2]:
        opt.minimize(nn.functional.mse_loss(model(x), y))
        sched.step()
    assert opt.get_lr() == pytest.approx(0.25) and opt.inner.param_groups[0]["lr"] == 0.25
