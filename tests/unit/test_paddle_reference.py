"""fleetx's optimizers and rules against independent numpy implementations of Paddle's own
formulas, in float64, to 1e-9, on scripted gradients over several steps.

Each reference below is written from the Paddle source file it names (repository
PaddlePaddle/Paddle), not from fleetx's code:

* LARS: ``paddle/phi/kernels/cpu/lars_momentum_kernel.cc`` (the 2.2 ``lars_momentum`` op), with
  exclusion by substring from ``LarsMomentumOptimizer._append_optimize_op``;
* LAMB: ``paddle/phi/kernels/funcs/lamb_functors.h`` and ``paddle/phi/kernels/impl/
  lamb_kernel_impl.h`` (norms only when ``weight_decay > 0 || always_adapt``), with exclusion by
  suffix from ``python/paddle/distributed/fleet/meta_optimizers/lamb_optimizer.py``;
* dynamic loss scaling: ``Update`` in ``paddle/fluid/operators/amp/update_loss_scaling_op.h``;
* gradient merge: ``GradientMergeOptimizer`` in ``python/paddle/fluid/optimizer.py`` (merged
  gradient, divided by ``k_steps`` when ``avg``, applied when ``step % k_steps == 0``) with the
  ``momentum`` op's rule ``v = mu * v + g; w -= lr * v``;
* LocalSGD: the program ``LocalSGDOptimizer.minimize_impl`` builds in
  ``python/paddle/distributed/fleet/meta_optimizers/localsgd_optimizer.py``.

The gradients are scripted: each step's loss is ``sum(<p, G_p>)`` so that ``p.grad`` is exactly
the scripted ``G_p``.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from fleetx import DistributedStrategy
from fleetx.amp.scaler import LossScaler
from fleetx.fleet import Fleet
from fleetx.optim import Lamb, LarsMomentum
from fleetx.strategy.algorithms.localsgd import LocalSGDState

STEPS = 5
TOL = dict(rtol=1e-9, atol=1e-12)


pytestmark = pytest.mark.usefixtures("one_process")  # tests/conftest.py


class Net(nn.Module):
    """Named float64 tensors: two weights, two biases (one of them starting at zero)."""

    def __init__(self) -> None:
        super().__init__()
        rng = np.random.default_rng(7)
        self.fc = nn.Linear(4, 3).double()
        self.head = nn.Linear(3, 2).double()
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.from_numpy(rng.normal(size=tuple(p.shape))))
            self.head.bias.zero_()


def scripted_grads(steps: int = STEPS, seed: int = 11) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    shapes = {n: tuple(p.shape) for n, p in Net().named_parameters()}
    script = [{n: rng.normal(scale=0.1 * (1 + t), size=s) for n, s in shapes.items()}
              for t in range(steps)]
    script[1]["fc.bias"][:] = 0.0  # a zero gradient: Paddle's ratio falls back to 1
    return script


def run_fleet(switches: dict, make_opt, script) -> list[dict[str, np.ndarray]]:
    """Train Net through a one-process fleet on the scripted gradients; the weights after each
    optimizer call (the first entry: before any)."""
    s = DistributedStrategy()
    for key, value in switches.items():
        setattr(s, key, value)
    f = Fleet()
    f.init(is_collective=True, strategy=s)
    model = f.distributed_model(Net())
    opt = f.distributed_optimizer(make_opt(model.parameters()))
    net = model.module if hasattr(model, "module") else model
    history = [{n: p.detach().numpy().copy() for n, p in net.named_parameters()}]
    for grads in script:
        loss = sum((p * torch.from_numpy(grads[n])).sum() for n, p in net.named_parameters())
        opt.minimize(loss)
        history.append({n: p.detach().numpy().copy() for n, p in net.named_parameters()})
    return history


def step_alone(opt, params: dict, script: list) -> list:
    """The optimizer on its own (no fleet): the weights before and after each scripted step."""
    history = [{n: p.detach().numpy().copy() for n, p in params.items()}]
    for grads in script:
        for n, p in params.items():
            p.grad = torch.from_numpy(grads[n])
        opt.step()
        history.append({n: p.detach().numpy().copy() for n, p in params.items()})
    return history


def assert_history(history, expected):
    assert len(history) == len(expected)
    for got, want in zip(history, expected):
        for name in want:
            np.testing.assert_allclose(got[name], want[name], **TOL, err_msg=name)


# -- LARS ------------------------------------------------------------------------------------------
LR, MU, COEFF, WD, EPS = 0.3, 0.9, 0.02, 0.01, 1e-3


def lars_paddle(w0, script, excluded):
    """lars_momentum_kernel.cc: local_lr = lr * coeff * |p| / (|g| + wd |p| + eps) when wd > 0 and
    both norms are positive, else lr; v = mu v + local_lr (g + wd p); p -= v."""
    w = {n: a.copy() for n, a in w0.items()}
    v = {n: np.zeros_like(a) for n, a in w0.items()}
    out = [{n: a.copy() for n, a in w.items()}]
    for grads in script:
        for n, g in grads.items():
            wd = 0.0 if any(e in n for e in excluded) else WD
            pn, gn = np.sqrt(np.sum(w[n] ** 2)), np.sqrt(np.sum(g ** 2))
            local = LR * COEFF * pn / (gn + wd * pn + EPS) if wd > 0 and pn > 0 and gn > 0 else LR
            v[n] = MU * v[n] + local * (g + wd * w[n])
            w[n] = w[n] - v[n]
        out.append({n: a.copy() for n, a in w.items()})
    return out


@pytest.mark.parametrize("excluded", [[], ["bias"], ["ead"]])
def test_lars_matches_paddles_kernel(excluded):
    """Exclusion by substring, as Paddle's LARS: "ead" excludes both head tensors."""
    script = scripted_grads()
    history = run_fleet({"lars": True, "lars_configs": {
        "lars_coeff": COEFF, "lars_weight_decay": WD, "epsilon": EPS,
        "exclude_from_weight_decay": excluded}},
        lambda p: torch.optim.SGD(p, lr=LR, momentum=MU), script)
    assert_history(history, lars_paddle(history[0], script, excluded))


def test_lars_optimizer_on_its_own_matches_paddles_kernel():
    script = scripted_grads()
    params = {n: nn.Parameter(torch.from_numpy(a.copy()))
              for n, a in run_fleet({}, lambda p: torch.optim.SGD(p, lr=0.0), [])[0].items()}
    opt = LarsMomentum(
        [{"params": [params["fc.weight"], params["head.weight"]]},
         {"params": [params["fc.bias"], params["head.bias"]], "lars_weight_decay": 0.0}],
        lr=LR, momentum=MU, lars_coeff=COEFF, lars_weight_decay=WD, epsilon=EPS)
    w0 = {n: p.detach().numpy().copy() for n, p in params.items()}
    assert_history(step_alone(opt, params, script), lars_paddle(w0, script, ["bias"]))


# -- LAMB ------------------------------------------------------------------------------------------
B1, B2, ADAM_EPS, LAMB_WD, LAMB_LR = 0.8, 0.95, 1e-6, 0.05, 0.02


def lamb_paddle(w0, script, excluded, weight_decay=LAMB_WD, always_adapt=False):
    """lamb_functors.h: m, v moments; r = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) + wd w;
    lamb_kernel_impl.h: the squared norms stay 0 (so the ratio is 1) unless wd > 0 or
    always_adapt; ratio = |w| / |r| when both are positive; w -= lr * ratio * r."""
    w = {n: a.copy() for n, a in w0.items()}
    m = {n: np.zeros_like(a) for n, a in w0.items()}
    v = {n: np.zeros_like(a) for n, a in w0.items()}
    b1_pow, b2_pow = B1, B2  # Paddle's Beta1Pow starts at beta1: the pow of step t is beta^t
    out = [{n: a.copy() for n, a in w.items()}]
    for grads in script:
        for n, g in grads.items():
            wd = 0.0 if any(n.endswith(e) for e in excluded) else weight_decay
            m[n] = B1 * m[n] + (1 - B1) * g
            v[n] = B2 * v[n] + (1 - B2) * g * g
            r = (m[n] / (1 - b1_pow)) / (np.sqrt(v[n] / (1 - b2_pow)) + ADAM_EPS) + wd * w[n]
            pn = tn = 0.0
            if wd > 0 or always_adapt:
                pn, tn = np.sqrt(np.sum(w[n] ** 2)), np.sqrt(np.sum(r ** 2))
            ratio = pn / tn if pn > 0 and tn > 0 else 1.0
            w[n] = w[n] - LAMB_LR * ratio * r
        b1_pow, b2_pow = b1_pow * B1, b2_pow * B2
        out.append({n: a.copy() for n, a in w.items()})
    return out


@pytest.mark.parametrize("excluded, always_adapt", [
    ([], False), ([".bias"], False), ([".bias"], True), (["head.weight", "fc.bias"], False)])
def test_lamb_matches_paddles_kernel(excluded, always_adapt):
    """Exclusion by suffix, as Paddle's LAMB; no trust ratio where there is no weight decay
    unless always_adapt."""
    script = scripted_grads()
    history = run_fleet({"lamb": True, "lamb_configs": {
        "lamb_weight_decay": LAMB_WD, "exclude_from_weight_decay": excluded,
        "always_adapt": always_adapt}},
        lambda p: torch.optim.Adam(p, lr=LAMB_LR, betas=(B1, B2), eps=ADAM_EPS), script)
    assert_history(history, lamb_paddle(history[0], script, excluded, always_adapt=always_adapt))


@pytest.mark.parametrize("always_adapt", [False, True])
def test_lamb_without_weight_decay_matches_paddles_kernel(always_adapt):
    """lamb_weight_decay = 0: Paddle's kernel is bias-corrected Adam unless always_adapt."""
    script = scripted_grads()
    history = run_fleet({"lamb": True, "lamb_configs": {
        "lamb_weight_decay": 0.0, "always_adapt": always_adapt}},
        lambda p: torch.optim.Adam(p, lr=LAMB_LR, betas=(B1, B2), eps=ADAM_EPS), script)
    expected = lamb_paddle(history[0], script, [], weight_decay=0.0, always_adapt=always_adapt)
    assert_history(history, expected)
    plain = lamb_paddle(history[0], script, [], weight_decay=0.0, always_adapt=not always_adapt)
    assert not np.allclose(history[-1]["fc.weight"], plain[-1]["fc.weight"], rtol=1e-6)


def test_lamb_optimizer_on_its_own_matches_paddles_kernel():
    script = scripted_grads()
    w0 = run_fleet({}, lambda p: torch.optim.SGD(p, lr=0.0), [])[0]
    params = {n: nn.Parameter(torch.from_numpy(a.copy())) for n, a in w0.items()}
    opt = Lamb([{"params": [params["fc.weight"], params["head.weight"]]},
                {"params": [params["fc.bias"], params["head.bias"]], "lamb_weight_decay": 0.0}],
               lr=LAMB_LR, betas=(B1, B2), eps=ADAM_EPS, lamb_weight_decay=LAMB_WD)
    assert_history(step_alone(opt, params, script), lamb_paddle(w0, script, [".bias"]))


# -- dynamic loss scaling --------------------------------------------------------------------------
def loss_scaling_paddle(found_infs, scale, incr_n, decr_n, incr_ratio, decr_ratio):
    """update_loss_scaling_op.h ``Update``: (scale, good, bad) after each step."""
    good = bad = 0
    out = []
    for found_inf in found_infs:
        if found_inf:
            good, bad = 0, bad + 1
            if bad == decr_n:
                scale = max(scale * decr_ratio, 1.0)
                bad = 0
        else:
            good, bad = good + 1, 0
            if good == incr_n:
                grown = scale * incr_ratio
                with np.errstate(over="ignore"):  # Paddle's scale is float32: inf is not taken
                    scale = grown if np.isfinite(np.float32(grown)) else scale
                good = 0
        out.append((scale, good, bad))
    return out


@pytest.mark.parametrize("init, incr_n, decr_n, incr_ratio, decr_ratio", [
    (8.0, 3, 2, 2.0, 0.5),    # reaches the floor at 1 and stays there
    (1000.0, 2, 1, 3.0, 0.8), # every bad step shrinks; ratios that are not powers of two
    (2.0 ** 120, 1, 3, 2.0 ** 5, 0.25),  # growth past float32's range is not taken
])
def test_loss_scale_sequence_matches_paddles_op(init, incr_n, decr_n, incr_ratio, decr_ratio):
    rng = np.random.default_rng(int(init) % 1000 + incr_n)
    found_infs = [bool(x) for x in rng.random(60) < 0.45]
    found_infs[:8] = [True] * 8  # a long bad run: the floor at 1 for the first case
    scaler = LossScaler(init, incr_every_n_steps=incr_n, decr_every_n_nan_or_inf=decr_n,
                        incr_ratio=incr_ratio, decr_ratio=decr_ratio)
    got = []
    for found_inf in found_infs:
        scaler.update(found_inf)
        got.append((scaler.scale, scaler.good_steps, scaler.bad_steps))
    want = loss_scaling_paddle(found_infs, init, incr_n, decr_n, incr_ratio, decr_ratio)
    np.testing.assert_allclose([g[0] for g in got], [w[0] for w in want], **TOL)
    assert [g[1:] for g in got] == [w[1:] for w in want]
    assert scaler.skipped_steps == sum(found_infs)
    if init == 8.0:
        assert min(w[0] for w in want) == 1.0


# -- gradient merge --------------------------------------------------------------------------------
GM_LR, GM_MU, GM_K = 0.1, 0.9, 3


def gradient_merge_paddle(w0, script, avg):
    """GradientMergeOptimizer: accumulate; on step % k == 0 apply (merged / k if avg) with the
    momentum op (v = mu v + g; w -= lr v) and clear the accumulator."""
    w = {n: a.copy() for n, a in w0.items()}
    v = {n: np.zeros_like(a) for n, a in w0.items()}
    acc = {n: np.zeros_like(a) for n, a in w0.items()}
    out = [{n: a.copy() for n, a in w.items()}]
    for step, grads in enumerate(script, start=1):
        for n, g in grads.items():
            acc[n] = acc[n] + g
        if step % GM_K == 0:
            for n in w:
                g = acc[n] / GM_K if avg else acc[n]
                v[n] = GM_MU * v[n] + g
                w[n] = w[n] - GM_LR * v[n]
                acc[n] = np.zeros_like(acc[n])
        out.append({n: a.copy() for n, a in w.items()})
    return out


@pytest.mark.parametrize("avg", [True, False])
def test_gradient_merge_matches_paddles_program(avg):
    script = scripted_grads(steps=3 * GM_K + 1)  # three merges and one pending micro-step
    history = run_fleet({"gradient_merge": True,
                         "gradient_merge_configs": {"k_steps": GM_K, "avg": avg}},
                        lambda p: torch.optim.SGD(p, lr=GM_LR, momentum=GM_MU), script)
    assert_history(history, gradient_merge_paddle(history[0], script, avg))


# -- LocalSGD schedule -----------------------------------------------------------------------------
def localsgd_paddle(k_steps, begin_step, steps):
    """The steps after which LocalSGDOptimizer's program averages the parameters: a step counter
    from 1, last_step = begin_step; cond(step > begin_step, cond(step - last_step == k_steps,
    communicate), communicate), communicate setting last_step = step."""
    last_step, averaged = begin_step, []
    for step in range(1, steps + 1):
        if step > begin_step:
            if step - last_step == k_steps:
                averaged.append(step)
                last_step = step
        else:
            averaged.append(step)
            last_step = step
    return averaged


@pytest.mark.parametrize("k_steps", [1, 2, 3, 5])
@pytest.mark.parametrize("begin_step", [1, 2, 4, 7])
def test_localsgd_schedule_matches_paddles_program(k_steps, begin_step):
    """fleetx synchronises steps 1..begin_step through the gradient all-reduce (in_warmup before
    the step) and averages parameters after the steps ``advance`` marks; together they are the
    steps Paddle's program communicates on."""
    state, synced = LocalSGDState(k_steps, begin_step), []
    for step in range(1, 31):
        warm = state.in_warmup()
        if state.advance() or warm:
            synced.append(step)
    assert synced == localsgd_paddle(k_steps, begin_step, 30)


def test_localsgd_warmup_gradient_average_equals_paddles_parameter_average_for_weights_only():
    """What docs/differences.md says of the warm-up: averaging gradients with one shared velocity
    (fleetx) and averaging parameters with per-rank velocities (Paddle) give the same parameters
    through the warm-up, but different velocities, so the local steps after it differ."""
    rng = np.random.default_rng(5)
    begin_step, ranks, lr, mu = 3, 2, 0.1, 0.9
    grads = rng.normal(size=(6, ranks, 4))
    w_shared, v_shared = np.ones(4), np.zeros(4)
    w_ranks, v_ranks = np.ones((ranks, 4)), np.zeros((ranks, 4))
    for step in range(1, 7):
        g = grads[step - 1]
        if step <= begin_step:
            v_shared = mu * v_shared + g.mean(axis=0)
            w_shared = w_shared - lr * v_shared
            w_fleetx = np.tile(w_shared, (ranks, 1))
            v_ranks = mu * v_ranks + g
            w_ranks = (w_ranks - lr * v_ranks).mean(axis=0, keepdims=True).repeat(ranks, axis=0)
            np.testing.assert_allclose(w_ranks, w_fleetx, **TOL)
            assert not np.allclose(v_ranks[0], v_shared)
            np.testing.assert_allclose(v_ranks.mean(axis=0), v_shared, **TOL)
            v_fleetx = np.tile(v_shared, (ranks, 1))
        else:
            v_fleetx = mu * v_fleetx + g
            w_fleetx = w_fleetx - lr * v_fleetx
            v_ranks = mu * v_ranks + g
            w_ranks = w_ranks - lr * v_ranks
    assert not np.allclose(w_ranks, w_fleetx, rtol=1e-6)
