"""The anomaly guard's verdict (a pure function of the ranks' reports): NaN/inf first, then
gradients, then spikes against the float64 median of the accepted losses."""
import pytest

from fleetx.strategy.algorithms.anomaly_guard import AnomalyGuardConfig, RankReport, judge

CFG = AnomalyGuardConfig(spike_factor=10.0, min_history=3)


def test_a_nan_loss_on_one_rank_names_the_rank_and_batch():
    finding, loss = judge([RankReport(1.0), RankReport(None, bad_loss_batch=7)], [1.0] * 5, CFG)
    assert (finding.what, finding.rank, finding.batch, loss) == (
        "the loss is NaN or inf", 1, 7, None)


def test_bad_gradients_skip_without_a_loss():
    finding, _ = judge([RankReport(None, bad_gradients=True), RankReport(None)], [], CFG)
    assert (finding.what, finding.rank) == ("the gradients hold NaN or inf", 0)
    assert judge([RankReport(None), RankReport(None)], [], CFG) == (None, None)


def test_spikes_are_judged_after_min_history_only():
    assert judge([RankReport(100.0)], [1.0, 1.0], CFG) == (None, 100.0)
    finding, loss = judge([RankReport(100.0)], [1.0, 1.0, 1.0], CFG)
    assert loss == 100.0 and finding.what.startswith("the loss 100 is 100x the median 1 ")


def test_threshold_and_median_in_float64():
    # 1e8 + 1 and friends are not float32 numbers: a float32 median (1e8) would put the
    # threshold at 1e9 and call 1e9 + 8 a spike; in float64 the threshold is 1e9 + 10.
    history = [1e8, 1e8 + 1, 1e8 + 2]
    assert judge([RankReport(1e9 + 8)], history, CFG) == (None, 1e9 + 8)
    finding, _ = judge([RankReport(1e9 + 12)], history, CFG)
    assert finding is not None


def test_a_median_at_or_below_zero_makes_no_spike():
    assert judge([RankReport(5.0)], [-1.0, 0.0, -2.0], CFG)[0] is None


def test_the_report_survives_its_float64_encoding():
    report = RankReport(0.1 + 0.2, 12, True)
    assert RankReport.decode(report.encode()) == report
    assert RankReport.decode(RankReport(None).encode()) == RankReport(None)


def test_a_wrong_rollback_names_the_choices():
    with pytest.raises(ValueError, match="'memory', 'disk', 'none', got 'tape'"):
        AnomalyGuardConfig(rollback="tape")
