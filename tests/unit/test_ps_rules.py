"""Server-side rules equal torch.optim on the same gradients (1e-6), in C and in numpy."""
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fleetx.ps import kernels
from fleetx.ps.api import PSConfigError, DenseTableSpec, RuleConfig, SparseTableSpec, InitConfig
from fleetx.ps.rules import make_rule
from fleetx.ps.table import DenseTable, SparseTable

sys.path.insert(0, str(Path(__file__).parent))
from ps_backends import backend, require_c_kernels  # noqa: E402,F401 (backend: a fixture)

CASES = [
    (torch.optim.SGD, {"lr": 0.1}),
    (torch.optim.SGD, {"lr": 0.05, "weight_decay": 0.1}),
    (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    (torch.optim.Adagrad, {"lr": 0.1}),
    (torch.optim.Adagrad, {"lr": 0.1, "initial_accumulator_value": 0.5, "weight_decay": 0.1,
                           "eps": 1e-6}),
    (torch.optim.Adam, {"lr": 0.01}),
    (torch.optim.Adam, {"lr": 0.01, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.1}),
    (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
]


def _torch_run(cls, kw, w0, grads):
    p = torch.nn.Parameter(torch.from_numpy(w0.copy()))
    opt = cls([p], **kw)
    for g in grads:
        p.grad = torch.from_numpy(g.copy())
        opt.step()
    return p.detach().numpy(), opt


@pytest.mark.parametrize("cls,kw", CASES, ids=lambda x: getattr(x, "__name__", str(x)))
def test_sparse_rule_equals_torch(backend, cls, kw):
    rng = np.random.default_rng(0)
    n, dim, steps = 7, 5, 6
    w0 = rng.standard_normal((n, dim)).astype(np.float32)
    grads = [rng.standard_normal((n, dim)).astype(np.float32) for _ in range(steps)]
    expected, opt = _torch_run(cls, kw, w0, grads)

    config = RuleConfig.from_optimizer(opt)
    spec = SparseTableSpec("t", dim, config)
    table = SparseTable(spec, make_rule(config))
    ids = np.array([40, -3, 2 ** 62, 0, 17, -(2 ** 63), 9], np.int64)
    table.assign(ids, w0)
    order = np.argsort(ids)  # push rows in another order than they were created
    for g in grads:
        table.push(ids[order], g[order])
    np.testing.assert_allclose(table.pull(ids), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("cls,kw", CASES, ids=lambda x: getattr(x, "__name__", str(x)))
def test_dense_rule_equals_torch(backend, cls, kw):
    rng = np.random.default_rng(1)
    w0 = rng.standard_normal(11).astype(np.float32)
    grads = [rng.standard_normal(11).astype(np.float32) for _ in range(5)]
    expected, opt = _torch_run(cls, kw, w0, grads)
    config = RuleConfig.from_optimizer(opt)
    table = DenseTable(DenseTableSpec("d", 11, config), make_rule(config), 0, 11)
    table.assign(w0)
    for g in grads:
        table.push(g)
    np.testing.assert_allclose(table.pull(), expected, rtol=1e-6, atol=1e-6)


def test_rows_touched_late_get_their_own_adam_step():
    """Adam's bias correction is per row: a row first updated at step 3 is corrected as a
    fresh parameter (what torch does for a tensor that starts getting gradients then)."""
    config = RuleConfig("adam", lr=0.1)
    table = SparseTable(SparseTableSpec("t", 2, config, InitConfig("constant")),
                        make_rule(config))
    g = np.ones((1, 2), np.float32)
    for _ in range(3):
        table.push(np.array([1]), g)
    table.push(np.array([2]), g)
    fresh, _ = _torch_run(torch.optim.Adam, {"lr": 0.1}, np.zeros(2, np.float32), [g[0]])
    np.testing.assert_allclose(table.pull(np.array([2]))[0], fresh, atol=1e-7)


def test_set_lr_changes_the_next_update():
    rule = make_rule(RuleConfig("sgd", lr=1.0))
    slab = np.zeros((1, 1), np.float32)
    rule.set_lr(0.25)
    rule.apply(slab, np.array([0]), np.ones((1, 1), np.float32), 1)
    assert slab[0, 0] == -0.25


@pytest.mark.parametrize("opt,group,message", [
    ("RMSprop", {}, "optimizer 'RMSprop' has no parameter-server rule"),
    ("Adam", {"amsgrad": True}, "Adam(amsgrad=True) is not supported"),
    ("Adagrad", {"lr_decay": 0.1}, "Adagrad(lr_decay=0.1) is not supported"),
    ("SGD", {"momentum": 0.9, "dampening": 0.1}, "SGD(dampening=0.1) is not supported"),
])
def test_unsupported_optimizer_options_are_refused(opt, group, message):
    with pytest.raises(PSConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        RuleConfig.from_param_group(opt, group)


def test_rule_config_validation_names_the_field():
    with pytest.raises(PSConfigError, match=r"RuleConfig.lr=-1: expected a finite number >= 0"):
        RuleConfig("sgd", lr=-1)
    with pytest.raises(PSConfigError, match="RuleConfig.name='lamb'"):
        RuleConfig("lamb")


def test_c_and_numpy_kernels_agree():
    require_c_kernels()  # names the reason; a failure under CI=true
    rng = np.random.default_rng(2)
    keys = rng.integers(-2 ** 63, 2 ** 63 - 1, 3000, dtype=np.int64)
    batches = [np.concatenate([keys[:i + 300], keys[:50]]) for i in range(0, 2700, 300)]
    results = {}
    for be in ("c", "numpy"):
        kernels.set_backend(be)
        config = RuleConfig("adam", lr=0.01, weight_decay=0.01)
        t = SparseTable(SparseTableSpec("t", 8, config, InitConfig("normal", seed=5)),
                        make_rule(config), capacity=16)
        for b in batches:
            u = np.unique(b)
            t.push(u, np.cos(u[:, None] % 7 + np.arange(8)).astype(np.float32))
        results[be] = (t.index.keys.copy(), t.slab.copy(), t.pull(keys[::7]))
    kernels.set_backend("c")
    np.testing.assert_array_equal(results["c"][0], results["numpy"][0])
    np.testing.assert_allclose(results["c"][1], results["numpy"][1], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(results["c"][2], results["numpy"][2], rtol=1e-6, atol=1e-6)
