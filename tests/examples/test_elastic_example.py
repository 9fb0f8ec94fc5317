"""examples/elastic_collective.py: fleet.auto_checkpoint resumes a job where its last automatic
checkpoint left it, in one process (default run) and under fleetrun with a rank killed (slow)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = str(ROOT / "examples" / "elastic_collective.py")


@pytest.mark.usefixtures("one_process")
def test_a_second_run_resumes_from_the_last_automatic_checkpoint(tmp_path, monkeypatch, capsys):
    """In this process (runpy), twice: the second run finds the checkpoints of the first."""
    import runpy

    monkeypatch.chdir(tmp_path)

    def run(steps: int) -> str:
        monkeypatch.setattr(sys, "argv", [EXAMPLE, "--ckpt", "ckpt", "--steps", str(steps),
                                          "--every", "20"])
        runpy.run_path(EXAMPLE, run_name="__main__")
        return capsys.readouterr().out
    assert "restart 0: starting at step 0 of 50 with 1 process(es)" in run(50)
    out = run(100)  # saved at steps 20 and 40: resumes at 40
    assert "restart 0: starting at step 40 of 100 with 1 process(es)" in out
    assert "step 50: loss" in out and "step 100: loss" in out


@pytest.mark.slow
def test_a_killed_rank_is_restarted_and_resumes_from_the_checkpoint(tmp_path):
    res = subprocess.run(
        [sys.executable, "-m", "fleetx.launch", "--nproc_per_node", "2", "--max_restarts", "1",
         EXAMPLE, "--ckpt", "ckpt", "--steps", "60", "--every", "20", "--kill-at", "30"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "restart 1: starting at step 20 of 60 with 2 process(es)" in res.stdout
    assert ("fleetrun: work lost: 10 step(s) since the last checkpoint (rank 1 at step 30, "
            "checkpoint at step 20)") in res.stderr.splitlines(), res.stderr
