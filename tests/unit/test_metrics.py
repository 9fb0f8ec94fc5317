"""fleetx.metrics: exact values of every metric, the AUC bucket walk, its 0.5 edge cases, inputs."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fleetx import metrics
from fleetx.metrics import MetricError


class PeerUtil:
    """A reducer for one worker whose peers contributed fixed values, one per call, in order."""

    def __init__(self, *peer_values):
        self.peer_values = list(peer_values)
        self.modes = []

    def all_reduce(self, input, mode="sum"):
        self.modes.append(mode)
        op = {"sum": np.add, "max": np.maximum, "min": np.minimum}[mode]
        return op(np.asarray(input), np.asarray(self.peer_values.pop(0)))


class Alone:
    def all_reduce(self, input, mode="sum"):
        return input


def walk(pos, neg):
    """Fleet's AUC loop, literally: buckets from the highest score down."""
    area = p = n = total = 0.0
    for i in reversed(range(len(pos))):
        new_p, new_n = p + pos[i], n + neg[i]
        total += pos[i] + neg[i]
        area += (new_n - n) * (p + new_p) / 2
        p, n = new_p, new_n
    return 0.5 if p * n == 0 or total == 0 else area / (p * n)


# -- sum / max / min ---------------------------------------------------------------------------
def test_sum_max_min_reduce_elementwise_and_keep_shape():
    x = np.array([[1, 5], [7, 2]])
    peer = np.array([[3, 4], [0, 9]])
    assert metrics.sum(x, util=PeerUtil(peer)).tolist() == [[4, 9], [7, 11]]
    assert metrics.max(x, util=PeerUtil(peer)).tolist() == [[3, 5], [7, 9]]
    assert metrics.min(x, util=PeerUtil(peer)).tolist() == [[1, 4], [0, 2]]


def test_modes_passed_to_util():
    util = PeerUtil(1, 1, 1)
    metrics.sum(np.array(1), util=util)
    metrics.max(np.array(1), util=util)
    metrics.min(np.array(1), util=util)
    assert util.modes == ["sum", "max", "min"]


def test_tensor_and_number_inputs_give_numpy():
    out = metrics.sum(torch.tensor([1.5, 2.0], requires_grad=True) * 1, util=PeerUtil([1.0, 1.0]))
    assert isinstance(out, np.ndarray) and out.tolist() == [2.5, 3.0]
    scalar = metrics.sum(3, util=PeerUtil(4))
    assert scalar.shape == () and int(scalar) == 7


def test_input_by_name_from_scope():
    scope = {"clicks": np.array([2, 3])}
    assert metrics.sum("clicks", scope=scope, util=PeerUtil([1, 1])).tolist() == [3, 4]
    with pytest.raises(MetricError, match=r"input names 'shows', but it is not in scope"):
        metrics.sum("shows", scope=scope, util=Alone())
    with pytest.raises(MetricError, match=r"input names 'shows', but no scope was given"):
        metrics.sum("shows", util=Alone())


# -- ratio metrics -----------------------------------------------------------------------------
def test_ratios_use_global_first_elements():
    # worker: abserr 3 over 4 instances; peer: abserr 5 over 12 -> 8 / 16
    assert metrics.mae(np.array([3.0, 99.0]), np.array([4, 99]),
                       util=PeerUtil([5.0, 1.0], [12, 1])) == 0.5
    assert metrics.mse(np.array([6.0]), np.array([3]), util=PeerUtil([10.0], [5])) == 2.0
    assert metrics.rmse(np.array([6.0]), np.array([3]), util=PeerUtil([10.0], [5])) == \
        math.sqrt(2.0)
    assert metrics.acc(np.array([7]), np.array([10]), util=PeerUtil([3], [10])) == 0.5


def test_ratio_accepts_number_total_and_returns_float():
    value = metrics.acc(np.array([1]), 4, util=PeerUtil([2], 4))
    assert value == 0.375 and type(value) is float


def test_ratio_with_no_instances_names_the_metric():
    with pytest.raises(ZeroDivisionError,
                       match="mse: the instance count sums to 0 over all workers"):
        metrics.mse(np.array([0.0]), np.array([0]), util=PeerUtil([0.0], [0]))


# -- auc ---------------------------------------------------------------------------------------
def test_auc_walk_exact_value():
    # positives in buckets 1, 2; negatives in 0, 1: 3 ordered pairs + 1 tie -> 3.5 / 4
    assert metrics.auc(np.array([[0, 1, 1]]), np.array([[1, 1, 0]]), util=Alone()) == 0.875
    assert walk([0, 1, 1], [1, 1, 0]) == 0.875


def test_auc_sums_histograms_over_workers():
    util = PeerUtil([[0, 0, 2]], [[1, 0, 0]])
    # global: pos [0, 1, 3], neg [2, 1, 0]: 2*1 + 3*3 + 0.5*1 = 11.5 of 12 pairs
    assert metrics.auc(np.array([[0, 1, 1]]), np.array([[1, 1, 0]]), util=util) == 11.5 / 12


@pytest.mark.parametrize("seed", range(5))
def test_auc_equals_the_literal_walk(seed):
    rng = np.random.default_rng(seed)
    pos, neg = rng.integers(0, 50, (2, 1, 64))
    assert metrics.auc(pos, neg, util=Alone()) == walk(pos[0].tolist(), neg[0].tolist())


@pytest.mark.parametrize("pos,neg", [
    ([[0, 0, 0]], [[0, 0, 0]]),     # no instances
    ([[1, 2, 3]], [[0, 0, 0]]),     # no negatives
    ([[0, 0, 0]], [[4, 0, 1]]),     # no positives
])
def test_auc_undefined_is_half(pos, neg):
    assert metrics.auc(np.array(pos), np.array(neg), util=Alone()) == 0.5
    assert walk(pos[0], neg[0]) == 0.5


def test_auc_perfect_reversed_and_all_ties():
    assert metrics.auc(np.array([[0, 0, 5]]), np.array([[3, 0, 0]]), util=Alone()) == 1.0
    assert metrics.auc(np.array([[5, 0, 0]]), np.array([[0, 0, 3]]), util=Alone()) == 0.0
    assert metrics.auc(np.array([[0, 4, 0]]), np.array([[0, 7, 0]]), util=Alone()) == 0.5


def test_auc_uses_row_zero_and_accepts_flat():
    two_rows = np.array([[0, 0, 1], [1, 0, 0]])
    assert metrics.auc(two_rows, np.array([[1, 0, 0], [0, 0, 1]]), util=Alone()) == 1.0
    assert metrics.auc(np.array([0, 1]), np.array([1, 0]), util=Alone()) == 1.0


def test_auc_shape_errors():
    with pytest.raises(MetricError, match=r"stat_pos must be a bucket histogram of shape \[1, B\]; "
                                          r"got shape \[1, 2, 2\]"):
        metrics.auc(np.zeros((1, 2, 2)), np.zeros((1, 4)), util=Alone())
    with pytest.raises(MetricError, match="stat_pos and stat_neg differ in length: 3 and 4"):
        metrics.auc(np.zeros((1, 3)), np.zeros((1, 4)), util=Alone())


# -- the default util is fleet.util, looked up at call time ------------------------------------
def test_default_util_is_fleet_util(monkeypatch):
    from fleetx import fleet
    monkeypatch.setattr(fleet, "util", PeerUtil([[1, 1]]))
    assert metrics.sum(np.array([[1, 2]])).tolist() == [[2, 3]]


def test_no_default_util_until_the_fleet_is_loaded():
    # metrics never import the fleet (no import cycle): the fleet hands its util over on import
    import subprocess
    import sys
    code = ("import numpy as np\nfrom fleetx import metrics\n"
            "try:\n    metrics.sum(np.array([1.0]))\n"
            "except metrics.MetricError as e:\n    print(e)\n"
            "from fleetx import fleet\n"
            "fleet.util = type('U', (), {'all_reduce': lambda s, x, mode='sum': x * 2})()\n"
            "print(metrics.sum(np.array([1.0])).tolist())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "util=None means fleet.util, but fleetx.fleet is not loaded: `from fleetx import fleet` "
        "and call fleet.init() first, or pass util=", "[2.0]"]


def test_one_process_fleet_reduces_to_itself():
    from fleetx.fleet import Fleet
    from fleetx.role_maker import UserDefinedRoleMaker
    f = Fleet()
    f.init(UserDefinedRoleMaker(is_collective=True, current_id=0,
                                worker_endpoints=["127.0.0.1:1"]))
    assert metrics.sum(np.array([2.5]), util=f.util).tolist() == [2.5]
    assert metrics.auc(np.array([[0, 1]]), np.array([[1, 0]]), util=f.util) == 1.0


# -- the streaming accumulator -----------------------------------------------------------------
def exact_auc(p, y):
    """Mann-Whitney: fraction of (positive, negative) pairs ordered right, ties half."""
    pos, neg = p[y == 1], p[y == 0]
    diff = pos[:, None] - neg[None, :]
    return float(((diff > 0) + 0.5 * (diff == 0)).mean())


def test_streaming_buckets_and_counts():
    m = metrics.AUC(num_buckets=4)
    m.update(np.array([0.0, 0.3, 0.5, 0.99, 1.0]), np.array([0, 1, 0, 1, 1]))
    assert m.stat_pos.tolist() == [[0, 1, 0, 2]]
    assert m.stat_neg.tolist() == [[1, 0, 1, 0]]
    assert m.count == 5 and m.stat_pos.shape == (1, 4)
    assert m.accumulate() == metrics.auc(m.stat_pos, m.stat_neg, util=Alone()) == 5 / 6


def test_streaming_close_to_exact_auc():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 3000)
    p = 1 / (1 + np.exp(-(rng.normal(size=3000) + y)))
    m = metrics.AUC()
    for lo in range(0, 3000, 512):                   # batches
        m.update(torch.tensor(p[lo:lo + 512]), torch.tensor(y[lo:lo + 512]))
    assert abs(m.accumulate() - exact_auc(p, y)) < 1e-3


def test_streaming_two_column_preds_reset_and_errors():
    m = metrics.AUC(num_buckets=8)
    m.update(np.array([[0.9, 0.1], [0.2, 0.8]]), np.array([[0], [1]]))
    assert m.accumulate() == 1.0
    m.reset()
    assert m.count == 0 and m.accumulate() == 0.5
    with pytest.raises(MetricError, match="preds and labels hold 2 and 3 values"):
        m.update(np.array([0.1, 0.2]), np.array([0, 1, 1]))
    with pytest.raises(MetricError, match="num_buckets must be a positive int, got 0"):
        metrics.AUC(num_buckets=0)


def test_streaming_global_auc_sums_workers():
    mine, peer = metrics.AUC(num_buckets=16), metrics.AUC(num_buckets=16)
    both = metrics.AUC(num_buckets=16)
    rng = np.random.default_rng(1)
    for m in (mine, peer):
        p, y = rng.random(200), rng.integers(0, 2, 200)
        m.update(p, y)
        both.update(p, y)
    util = PeerUtil(peer.stat_pos, peer.stat_neg)
    assert mine.global_auc(util=util) == both.accumulate()


# -- non-finite inputs are errors, not silently bucketed -----------------------------------------
def test_streaming_rejects_nan_and_inf_predictions_and_nan_labels():
    m = metrics.AUC(num_buckets=4)
    with pytest.raises(MetricError, match=r"AUC.update: preds holds 1 NaN and 1 inf value\(s\), "
                                          r"the first at index 1; nothing of this batch"):
        m.update(np.array([0.2, np.nan, np.inf]), np.array([0, 1, 1]))
    with pytest.raises(MetricError, match=r"AUC.update: labels holds 1 NaN value\(s\), the first "
                                          r"at index 2"):
        m.update(torch.tensor([0.2, 0.4, 0.9]), torch.tensor([0.0, 1.0, float("nan")]))
    assert m.count == 0                          # neither batch was counted


def test_ratio_and_auc_reject_non_finite_statistics():
    with pytest.raises(MetricError, match=r"mae: abserr is not finite \(it holds NaN\)"):
        metrics.mae(np.array([np.nan]), np.array([4]), util=Alone())
    with pytest.raises(MetricError, match=r"auc: stat_neg is not finite \(it holds NaN and inf\)"):
        metrics.auc(np.array([[1.0, 2.0]]), np.array([[np.nan, np.inf]]), util=Alone())


def test_sum_max_min_pass_non_finite_values_through():
    assert metrics.max(np.array([-np.inf, 1.0]), util=Alone()).tolist() == [-np.inf, 1.0]
    assert np.isnan(metrics.sum(np.array([np.nan]), util=Alone())[0])
