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


# -- --nnodes MIN:MAX: a node leaves ----------------------------------------------------------------
def serving(port: int) -> bool:
    import socket

    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


@pytest.mark.slow
def test_a_node_that_leaves_an_elastic_job_lets_it_go_on_at_the_smaller_size(tmp_path):
    """Two fleetrun agents on one machine play two nodes (``--nnodes 1:2``, one process each,
    a checkpoint folder both reach, as a shared filesystem would be); A starts first and serves
    the rendezvous store, as the node at --master does. Node B is killed whole
    (SIGKILL of its agent and its worker) after step 12; node A's worker fails at its next
    all-reduce, A restarts its worker group, the rendezvous closes with A alone, and the job
    resumes at world size 1 from the last checkpoint (step 10) and ends with exit 0."""
    import os
    import signal
    import subprocess
    import time

    from fleetx.launch import hosts
    from test_fleetrun import fleetrun_cmd, wait_for

    port = hosts.free_ports(1)[0]
    args = ["--nnodes", "1:2", "--master", f"127.0.0.1:{port}", "--max_restarts", "1", SCRIPT,
            "--ckpt", tmp_path / "ckpt", "--out", "final.pt", "--steps", 30, "--every", 5,
            "--sleep", 0.5]
    environ = dict(os.environ, FLEETX_TIMEOUT="120")
    nodes = {}
    for name in ("A", "B"):
        (tmp_path / name).mkdir()
        nodes[name] = subprocess.Popen(fleetrun_cmd(*args), cwd=tmp_path / name, env=environ,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True, start_new_session=True)
        if name == "A":  # A serves the rendezvous store (the node at --master must stay)
            assert wait_for(lambda: serving(port), 120)
    log_b = tmp_path / "B" / "log" / "workerlog.1"
    try:
        assert wait_for(lambda: log_b.exists() and "took step 12" in log_b.read_text(), 240)
        os.killpg(nodes["B"].pid, signal.SIGKILL)  # the node is gone, agent and worker
        killed = time.monotonic()
        out, err = nodes["A"].communicate(timeout=300)
        ended = time.monotonic()
    finally:
        for proc in nodes.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert nodes["A"].returncode == 0, out + err
    log_a = (tmp_path / "A" / "log" / "workerlog.0").read_text()
    assert "rank 0 restart 0 starts at step 0 of 2" in log_a, log_a
    resumed = re.findall(r"rank 0 restart 1 starts at step (\d+) of 1", log_a)
    assert resumed in (["10"], ["15"]), log_a  # B may have reached step 15 before it died
    assert "rank 0 of 1 took step 30" in log_a
    assert "fleetrun: restart 1 of 1: rank 0 (local rank 0, pid " in err, err
    lost = [line for line in err.splitlines() if line.startswith("fleetrun: work lost: ")]
    assert lost and f"checkpoint at step {resumed[0]})" in lost[0], err
    assert ("fleetrun: the worker group runs on 1 node(s) now (was 2): 1 process(es) in all"
            in err.splitlines()), err
    # Indicative (docs/reliability.md): from the kill to the end of the job, 15 steps of 0.5 s
    # at world size 1 included; torch's rendezvous waits 30 s for more nodes before it closes.
    print(f"node B killed; node A ended {ended - killed:.0f} s later")
