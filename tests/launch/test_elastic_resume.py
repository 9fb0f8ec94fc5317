"""Elastic resume of collective jobs, for real: under ``fleetrun --max_restarts 1`` a rank
SIGKILLs itself in the middle of training, the worker group is restarted, the script resumes
from its last checkpoint (``fleet.save_checkpoint`` every k steps, or ``fleet.auto_checkpoint``)
and ends with exactly the parameters of a run that was never interrupted.

Every run is the same script (``tests/scripts/elastic_resume.py``: data-parallel SGD with
momentum on gloo, batches chosen by step and rank); the uninterrupted one is run once.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_fleetrun import run  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "elastic_resume.py"
STEPS, EVERY = 12, 4


def train(folder: Path, *args) -> tuple[dict, str, str]:
    """Run the script under fleetrun (2 processes, 1 restart allowed) in ``folder``; returns
    rank 0's final parameters, stdout and stderr."""
    folder.mkdir()
    res = run(["--nproc_per_node", "2", "--max_restarts", "1", SCRIPT, "--ckpt", "ckpt",
               "--out", "final.pt", "--steps", STEPS, "--every", EVERY, *args], folder,
              timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    return torch.load(folder / "final.pt"), res.stdout, res.stderr


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    params, out, err = train(tmp_path_factory.mktemp("ref") / "run")
    assert "restart" not in err and "work lost" not in err, err
    return params


def starts(folder: Path) -> list[tuple[int, int, int]]:
    """(rank, restart count, first step) of every worker group, from the ranks' logs."""
    found = []
    for log in sorted((folder / "log").glob("workerlog.*")):
        found += [tuple(map(int, m)) for m in re.findall(
            r"rank (\d+) restart (\d+) starts at step (\d+) of 2", log.read_text())]
    return sorted(found)


def assert_equal(params: dict, reference: dict) -> None:
    assert params.keys() == reference.keys()
    for name, value in params.items():
        assert torch.equal(value, reference[name]), (name, (value - reference[name]).abs().max())


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["manual", "auto"])
def test_a_rank_killed_mid_training_resumes_from_its_checkpoint_to_the_same_parameters(
        tmp_path, uninterrupted, mode):
    """Rank 1 is killed (SIGKILL) after step 7; the last checkpoint is at step 4: 3 steps lost.
    The restarted ranks see TORCHELASTIC_RESTART_COUNT=1 and start at step 4."""
    params, out, err = train(tmp_path / mode, "--mode", mode, "--kill-at", 7)
    assert_equal(params, uninterrupted)
    assert starts(tmp_path / mode) == [(0, 0, 0), (0, 1, 4), (1, 0, 0), (1, 1, 4)]
    announced = [line for line in err.splitlines() if line.startswith("fleetrun: ")]
    assert announced[0].startswith("fleetrun: restart 1 of 1: rank 1 (local rank 1, pid "), err
    assert announced[0].endswith(") was killed by signal SIGKILL (log: "
                                 f"{tmp_path / mode}/log/workerlog.1); restarting the worker "
                                 f"group"), err
    assert announced[1] == ("fleetrun: work lost: 3 step(s) since the last checkpoint (rank 1 "
                            "at step 7, checkpoint at step 4)"), err


@pytest.mark.slow
def test_a_rank_killed_before_any_checkpoint_starts_over_to_the_same_parameters(
        tmp_path, uninterrupted):
    params, out, err = train(tmp_path / "early", "--kill-at", 3)
    assert_equal(params, uninterrupted)
    assert starts(tmp_path / "early") == [(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)]
    assert ("fleetrun: work lost: all 3 step(s), no checkpoint was saved (rank 1 at step 3): "
            "the processes start over") in err.splitlines(), err
