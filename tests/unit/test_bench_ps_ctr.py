"""benchmarks/ps_ctr.py compare: the headline cases put the same sparse rule on both sides, and
the summary reports those ratios beside the ones with fleetx's table on SGD."""
import argparse
import sys
from pathlib import Path

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
