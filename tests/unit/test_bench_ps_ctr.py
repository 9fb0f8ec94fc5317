"""benchmarks/ps_ctr.py compare: the headline cases put the same sparse rule on both sides, and
the summary reports those ratios beside the ones with fleetx's table on SGD. speedup: fleetx's
samples/s over twice one plain process's, per round, alternating the jobs."""
import argparse
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import anchors  # noqa: E402
import ps_ctr  # noqa: E402


def test_async_adam_cases_match_paddles_rule_and_the_sgd_ones_do_not():
    for case in ("async_adam_1x2", "async_adam_2x2"):
        c = ps_ctr.CASES[case]
        assert (c.mode, c.sparse_rule, c.paddle_mode) == ("async", "adam", "async")
        assert c.same_rule() and c.rules() == "adam/adam"
    for case in ("async_1x2", "async_2x2"):
        assert not ps_ctr.CASES[case].same_rule()
        assert ps_ctr.CASES[case].rules() == "sgd/adam"
    assert ps_ctr.CASES["sync_1x2"].rules() == "sgd"   # no Paddle side


def test_adam_case_runs_fleetx_with_adam_against_paddles_async(tmp_path, monkeypatch):
    for name in ("harness.py", *anchors.PADDLE_PS):
        (tmp_path / name).write_text("")
    monkeypatch.setenv("FLEETX_ANCHORS", str(tmp_path))
    args = argparse.Namespace(data="/d", epochs=1, paddle_py="/venv/bin/python")
    (side_a, ours), (side_b, theirs) = ps_ctr._commands("async_adam_2x2", args)
    ours, theirs = [str(x) for x in ours], [str(x) for x in theirs]
    assert (side_a, side_b) == ("fleetx", "paddle")
    assert ours[ours.index("--sparse-rule") + 1] == "adam"
    assert ours[ours.index("--servers") + 1] == "2"
    assert theirs[:2] == ["/venv/bin/python", str(tmp_path / "paddle_ps_run.py")]
    assert theirs[theirs.index("--mode") + 1] == "async"
    assert theirs[theirs.index("--servers") + 1] == "2"


def _runs(case: str, ours: list, theirs: list) -> list:
    return ([{"case": case, "side": "fleetx", "kept": k, "samples_per_s": v, "auc": 0.7}
             for v, k in ours] +
            [{"case": case, "side": "paddle", "kept": k, "samples_per_s": v, "auc": 0.6}
             for v, k in theirs])


def test_summary_prints_both_ratios_kept_and_all_runs(capsys):
    runs = (_runs("async_adam_1x2", [(300, True), (320, True)], [(100, True), (200, False)]) +
            _runs("async_1x2", [(400, True)], [(100, False)]))
    ps_ctr._summary(runs, ["async_adam_1x2", "async_1x2"])
    out = capsys.readouterr().out.splitlines()
    row = next(line.split() for line in out if line.startswith("async_adam_1x2 "))
    # rule, ours (median of kept 300, 320), Paddle (kept: 100), kept ratio, all-runs ratio 310/150
    assert row[1:6] == ["adam/adam", "310", "100", "3.10", "2.07"]
    assert ("async, fleetx / Paddle, same sparse rule on both sides (Adam), the headline: "
            "async_adam_1x2 3.10 (all runs 2.07)") in out
    # no Paddle run kept: the kept ratio is '-', the all-runs one is still shown
    assert "async, fleetx / Paddle, fleetx's table on SGD, Paddle's on Adam: async_1x2 - " \
           "(all runs 4.00)" in out


def test_importing_the_benchmarks_leaves_the_environment_alone():
    # Run as scripts they pin one thread per process; imported (by these tests, at collection)
    # they must not, or every fleetrun test after them inherits OMP_NUM_THREADS.
    import os
    import subprocess
    code = ("import os, sys; sys.path.insert(0, 'benchmarks'); "
            "[os.environ.pop(v, None) for v in ('OMP_NUM_THREADS', 'MKL_NUM_THREADS')]; "
            "import ps_ctr, ps_table; print(os.environ.get('OMP_NUM_THREADS'))")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env={k: v for k, v in os.environ.items()
                                           if k != "OMP_NUM_THREADS"})
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "None"


# -- speedup: fleetx 1 x 2 against two plain processes --------------------------------------------
def _speedup_runs(rows: list) -> list:
    return [{"round": r, "case": c, "samples_per_s": v, "auc": a, "foreign_cores": f}
            for r, c, v, a, f in rows]


def test_speedup_ratio_is_fleetx_over_twice_plain_per_round(capsys):
    import ps_speedup
    runs = _speedup_runs([(1, "local", 100, 0.60, 0.0), (1, "async_1x2", 170, 0.61, 0.0),
                          (1, "geo_1x2", 180, 0.55, 0.0),
                          (2, "local", 200, 0.60, 0.5), (2, "async_1x2", 360, 0.62, 0.0),
                          (2, "geo_1x2", None, None, 0.0)])
    medians = ps_speedup.summary(runs, ["async_1x2", "geo_1x2"], max_foreign=0.1)
    assert medians == pytest.approx({"async_1x2": 0.875, "geo_1x2": 0.9})
    out = capsys.readouterr().out.splitlines()
    first = next(line.split() for line in out if line.lstrip().startswith("1 "))
    assert first == ["1", "100", "0.6000", "0.850", "0.6100", "0.900", "0.5500", "yes"]
    second = next(line.split() for line in out if line.lstrip().startswith("2 "))
    assert second[-1] == "no" and second[5] == "-"  # a foreign load; GEO did not finish
    assert any(line.startswith("async_1x2: fleetx / (2 x plain) median 0.875") for line in out)


def test_speedup_alternates_plain_and_fleetx_jobs_and_refuses_local_as_a_case(tmp_path):
    import ps_speedup
    order = []
    runs = ps_speedup.rounds(["async_1x2", "geo_1x2"], 2, lambda c: (
        order.append(c) or ({"warm_samples_per_s": 1, "last_auc": 0.5}, {})),
        out=str(tmp_path / "runs.jsonl"), say=lambda s: None)
    assert order == ["local", "async_1x2", "geo_1x2"] * 2 and len(runs) == 6
    assert len((tmp_path / "runs.jsonl").read_text().splitlines()) == 6
    args = argparse.Namespace(cases="local,async_1x2", prefetch=True)
    with pytest.raises(SystemExit, match="name fleetx cases"):
        ps_speedup.cmd_speedup(args, None, str(ROOT), lambda a: None)


@pytest.mark.slow  # a plain job and two fleetrun jobs of 2,000 lines: 30-60 s on 2 busy cores
def test_speedup_runs_end_to_end_at_a_tiny_size(tmp_path):
    import os
    import subprocess
    env = dict(os.environ, PYTHONPATH=str(ROOT), FLEETX_ANCHORS=str(tmp_path / "none"))
    res = subprocess.run([sys.executable, "benchmarks/ps_ctr.py", "speedup", "--rounds", "1",
                          "--epochs", "2", "--lines", "2000", "--data", str(tmp_path / "data")],
                         cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.splitlines()
    row = next(line.split() for line in lines if line.lstrip().startswith("1 "))
    assert float(row[3]) > 0 and float(row[5]) > 0  # both ratios measured
    assert any(line.startswith("async_1x2: fleetx / (2 x plain) median") for line in lines)
