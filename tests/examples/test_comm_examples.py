"""The communication-strategy examples run under the real fleetrun (short versions).

The slow test is the short version of the DGC convergence check of
``benchmarks/collective_comm.py --part accuracy``: DGC within 1.5 accuracy points of dense data
parallel after the same epochs.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def fleetrun(tmp_path: Path, nproc: int, script: str, *args: str) -> str:
    cmd = [sys.executable, "-m", "fleetx.launch", "--nproc_per_node", str(nproc),
           "--log_dir", str(tmp_path / "log"), str(ROOT / "examples/strategies" / script), *args]
    res = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout


SHORT = ("--epochs", "1", "--limit", "1280")


@pytest.mark.slow  # a whole example, 35-60 s: the slow stage keeps stage 1 in its budget
def test_fp16_allreduce_example(tmp_path):
    out = fleetrun(tmp_path, 2, "fp16_allreduce.py", *SHORT)
    assert "2. fp16_allreduce             applied" in out
    assert "2.0 bytes/parameter/step" in out


def test_dgc_example(tmp_path):
    out = fleetrun(tmp_path, 2, "dgc.py", *SHORT)
    assert "2. dgc                        applied   top-k exchange of 1 of 8 parameters" in out
    assert "gradient bytes/step" in out and "less than dense" in out


@pytest.mark.slow  # a whole example, 35-60 s: the slow stage keeps stage 1 in its budget
def test_hierarchical_example_on_two_pretend_nodes(tmp_path):
    out = fleetrun(tmp_path, 4, "hierarchical_allreduce.py", "--ranks_per_node", "2", *SHORT)
    assert "2 nodes of 2 ranks: reduce in node" in out and "epoch 1/1" in out


@pytest.mark.slow
def test_dgc_accuracy_within_1_5_points_of_dense(tmp_path):
    out_file = tmp_path / "result.json"
    cmd = [sys.executable, str(ROOT / "benchmarks/collective_comm.py"), "--part", "accuracy",
           "--epochs", "2", "--limit", "20000", "--out", str(out_file)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    summary = json.loads(res.stdout.strip().splitlines()[-1])["results"]
    assert summary["gap_points"] <= 1.5, summary
