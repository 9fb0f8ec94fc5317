"""``clip_grad_norm_`` under ``strategy.amp`` on one process: the gradients are unscaled first,
once per step, so the norm and the clipped gradients equal clipping in a plain float32 loop on
the same (bfloat16-autocast) gradients, step after step; clipping twice, or from a step pre-hook
(after the guard unscaled), divides nothing a second time; an inf gradient gives an inf norm
and the step is skipped as before.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from fleetx import DistributedStrategy
from fleetx.fleet import Fleet

MAX_NORM = 0.05  # well below the gradients' norm (~1): the clipping acts on every step


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _amp_fleet(one_process, **amp_configs) -> Fleet:
    s = DistributedStrategy()
    s.amp = True
    s.amp_configs = dict(init_loss_scaling=1024.0, **amp_configs)
    f = Fleet()
    f.init(is_collective=True, strategy=s)
    return f


def _data(step: int) -> tuple:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def _plain_step(model, opt, x, y) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    loss.backward()
    norm = nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    opt.step()
    opt.zero_grad()
    return norm


def test_clip_under_amp_equals_plain_clipping(one_process):
    f = _amp_fleet(one_process)
    ref = _net()
    model = f.distributed_model(copy.deepcopy(ref))
    opt = f.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        x, y = _data(step)
        opt.backward(nn.functional.mse_loss(model(x).float(), y))
        norm = opt.clip_grad_norm_(MAX_NORM)
        again = opt.clip_grad_norm_(MAX_NORM)  # already unscaled and clipped: about MAX_NORM
        assert opt.step() is True
        opt.zero_grad()
        want = _plain_step(ref, ref_opt, x, y)
        assert want > 10 * MAX_NORM
        assert torch.allclose(norm, want, rtol=1e-5, atol=0), (step, norm, want)
        assert again == pytest.approx(MAX_NORM, rel=1e-4)
        for a, b in zip(ref.parameters(), model.module.parameters()):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-7), step


def test_clip_from_a_step_pre_hook_does_not_unscale_twice(one_process):
    f = _amp_fleet(one_process)
    ref = _net()
    model = f.distributed_model(copy.deepcopy(ref))
    opt = f.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    norms = []
    opt.register_step_pre_hook(lambda *_: norms.append(opt.clip_grad_norm_(MAX_NORM)))
    x, y = _data(0)
    opt.minimize(nn.functional.mse_loss(model(x).float(), y))
    want = _plain_step(ref, torch.optim.SGD(ref.parameters(), lr=0.1), x, y)
    assert torch.allclose(norms[0], want, rtol=1e-5, atol=0)
    for a, b in zip(ref.parameters(), model.module.parameters()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)


def test_an_inf_gradient_gives_an_inf_norm_and_skips_the_step(one_process):
    f = _amp_fleet(one_process, decr_every_n_nan_or_inf=1, decr_ratio=0.5)
    model = f.distributed_model(_net())
    opt = f.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    before = [p.detach().clone() for p in model.parameters()]
    x, y = _data(0)
    opt.backward(nn.functional.mse_loss(model(x).float(), y))
    model.module[0].weight.grad[0, 0] = math.inf
    assert not math.isfinite(opt.clip_grad_norm_(MAX_NORM))
    assert opt.step() is False
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert opt.get_loss_scaling() == 512.0
    opt.zero_grad()
    opt.backward(nn.functional.mse_loss(model(x).float(), y))  # the next step is clean
    assert math.isfinite(opt.clip_grad_norm_(MAX_NORM)) and opt.step() is True
