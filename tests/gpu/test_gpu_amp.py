"""``strategy.amp`` on CUDA (float16 autocast, Paddle's dynamic loss scaling):

* with ``decr_every_n_nan_or_inf = 1`` Paddle's rule is ``torch.amp.GradScaler``'s, so the
  training (momentum SGD, infs injected into the gradients of some steps) equals a hand-written
  ``torch.autocast(float16)`` + ``GradScaler`` loop with the strategy's settings as its
  ``init_scale`` / ``growth_factor`` / ``backoff_factor`` / ``growth_interval``, parameter for
  parameter (1e-6), the same steps are skipped, and the loss-scale sequence is GradScaler's;
* with ``decr_every_n_nan_or_inf = 2`` (where GradScaler's rule differs) the scale sequence equals
  an independent implementation of Paddle's ``update_loss_scaling`` rule, and the training equals
  GradScaler's loop with its scale set from that rule after every step;
* the Linear layers really run in float16 and the model's output reaches the loss in float32.

Neither ``bfloat16`` on CUDA nor ``use_pure_fp16`` is offered by the strategy (Paddle 2.2's amp
is float16; ``use_pure_fp16`` is refused), so neither is trained here.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuda_jobs import batches, mlp, needs_cuda, state_diff  # noqa: E402

pytestmark = needs_cuda
STEPS = 10


def paddle_scales(found_inf: list, init: float, incr_every: int, decr_every: int,
                  incr_ratio: float, decr_ratio: float) -> list:
    """The loss scale after each step by Paddle's rule (``update_loss_scaling``:
    paddle/fluid/operators/amp/update_loss_scaling_op.h in Paddle 2.2), written from its
    description: bad steps in a row shrink the scale (never below 1) after ``decr_every`` of
    them, good steps in a row grow it after ``incr_every``; each kind resets the other count."""
    scale, good, bad, out = float(init), 0, 0, []
    for inf in found_inf:
        if inf:
            good, bad = 0, bad + 1
            if bad == decr_every:
                scale, bad = max(1.0, scale * decr_ratio), 0
        else:
            good, bad = good + 1, 0
            if good == incr_every:
                scale, good = scale * incr_ratio, 0
        out.append(scale)
    return out


def _fleet_run(configs: dict, inject: set, seen: list) -> dict:
    """Train through fleet with ``strategy.amp``; inf in one gradient on the ``inject`` steps."""
    from fleetx import DistributedStrategy
    from fleetx.fleet import Fleet
    s = DistributedStrategy()
    s.amp = True
    s.amp_configs = configs
    fleet = Fleet()
    fleet.init(is_collective=True, strategy=s)
    plain = mlp().cuda()
    plain[0].register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    model = fleet.distributed_model(plain)
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    scales, taken, out_dtypes = [], [], []
    for step, (x, y) in enumerate(batches(STEPS, 16)):
        out = model(x.cuda())
        out_dtypes.append(out.dtype)
        opt.backward(nn.functional.mse_loss(out, y.cuda()))
        if step in inject:
            plain[2].weight.grad[0, 0] = math.inf
        taken.append(bool(opt.step()))
        opt.zero_grad()
        scales.append(opt.get_loss_scaling())
    return {"state": model.state_dict(), "scales": scales, "taken": taken,
            "plan": fleet.applied_strategies(), "out_dtypes": out_dtypes}


def _grad_scaler_run(configs: dict, inject: set, new_scales=None) -> dict:
    """The hand-written loop: autocast(float16) forward, GradScaler around backward and step.
    With ``new_scales`` the scale after step i is set to ``new_scales[i]``."""
    model = mlp().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler(
        "cuda", init_scale=configs["init_loss_scaling"], growth_factor=configs["incr_ratio"],
        backoff_factor=configs["decr_ratio"], growth_interval=configs["incr_every_n_steps"])
    scales, taken = [], []
    for step, (x, y) in enumerate(batches(STEPS, 16)):
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(x.cuda())
        loss = nn.functional.mse_loss(out.float(), y.cuda())
        scaler.scale(loss).backward()
        if step in inject:
            model[2].weight.grad[0, 0] = math.inf
        before = model[0].weight.detach().clone()
        scaler.step(opt)
        scaler.update(None if new_scales is None else new_scales[step])
        opt.zero_grad()
        taken.append(not torch.equal(before, model[0].weight))
        scales.append(scaler.get_scale())
    return {"state": model.state_dict(), "scales": scales, "taken": taken}


def test_fp16_training_equals_autocast_and_grad_scaler(one_process):
    configs = {"init_loss_scaling": 1024.0, "incr_every_n_steps": 3, "decr_every_n_nan_or_inf": 1,
               "incr_ratio": 2.0, "decr_ratio": 0.5}
    inject = {1, 2, 6}
    seen: list = []
    got = _fleet_run(configs, inject, seen)
    want = _grad_scaler_run(configs, inject)
    assert got["plan"] == ("amp",)
    assert set(seen) == {torch.float16} and set(got["out_dtypes"]) == {torch.float32}
    assert got["taken"] == want["taken"] == [s not in inject for s in range(STEPS)]
    assert got["scales"] == want["scales"] == paddle_scales(
        [s in inject for s in range(STEPS)], 1024.0, 3, 1, 2.0, 0.5)
    assert state_diff(want["state"], mlp().state_dict()) > 1e-3  # the steps moved the weights
    assert state_diff(got["state"], want["state"]) <= 1e-6


def test_paddle_rule_with_two_bad_steps_in_a_row(one_process):
    configs = {"init_loss_scaling": 4096.0, "incr_every_n_steps": 2, "decr_every_n_nan_or_inf": 2,
               "incr_ratio": 2.0, "decr_ratio": 0.25}
    inject = {1, 2, 4, 6, 7}
    rule = paddle_scales([s in inject for s in range(STEPS)], 4096.0, 2, 2, 2.0, 0.25)
    # the rule waits for a second bad step (GradScaler would shrink at step 1 and 4)
    assert rule == [4096, 4096, 1024, 1024, 1024, 1024, 1024, 256, 256, 512]
    got = _fleet_run(configs, inject, [])
    want = _grad_scaler_run(configs, inject, new_scales=rule)
    assert got["scales"] == want["scales"] == rule
    assert got["taken"] == want["taken"] == [s not in inject for s in range(STEPS)]
    assert state_diff(got["state"], want["state"]) <= 1e-6


def test_use_pure_fp16_is_refused_on_cuda(one_process):
    from fleetx import DistributedStrategy
    from fleetx.fleet import Fleet
    from fleetx.strategy.api import StrategyError
    s = DistributedStrategy()
    s.amp = True
    s.amp_configs = {"use_pure_fp16": True}
    fleet = Fleet()
    fleet.init(is_collective=True, strategy=s)
    model = fleet.distributed_model(mlp().cuda())
    with pytest.raises(StrategyError, match="use_pure_fp16 is not supported"):
        fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
