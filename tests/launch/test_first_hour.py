"""A Paddle user's first hour with the real ``fleetrun``: the script of ``first_hour.py`` under a
2-process collective launch, a collective script under a parameter-server launch, and where the
parameter-server launcher writes its closing line."""
from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_fleetrun import SCRIPTS, job_pids, kill_all, run, wait_for  # noqa: E402


@pytest.fixture(scope="module")
def first_hour(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("first_hour")
    result = run(["--nproc_per_node", "2", SCRIPTS / "first_hour.py"], cwd, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    return [json.loads((cwd / "log" / f"first_hour.{r}.json").read_text()) for r in range(2)]


def test_init_without_is_collective_joins_the_collective_job(first_hour):
    # fleet.init(strategy=s) alone: two ranks of one job, not two one-process jobs.
    assert [(r["worker_index"], r["worker_num"]) for r in first_hour] == [(0, 2), (1, 2)]


def test_a_util_subclass_serves_the_job(first_hour):
    for r in first_hour:
        assert r["user_id"] == 10 and r["all_reduce"] == 1 + 2


def test_runtime_calls_raise_before_the_optimizer_and_log_to_stderr_after(first_hour):
    for r in first_hour:
        for call in ("init_worker", "stop_worker"):
            assert r[f"{call}_before"].startswith("Fleet can not find suitable runtime handler")
            assert r[f"{call}_after"] == f"You should not call '{call}' method for collective " \
                                         f"mode.\n"


def test_what_the_plan_applied_in_paddles_words(first_hour):
    for r in first_hour:
        assert r["meta_before"] == []
        assert r["meta"] == ["AMPOptimizer"] and r["graph"] == ["GraphExecutionOptimizer"]
        assert r["final"] == {"amp": True, "recompute": False, "type": "DistributedStrategy"}
        assert r["updated"] is True


def test_a_collective_script_under_a_ps_launch_is_told_what_is_wrong(tmp_path):
    result = run(["--server_num", "1", "--worker_num", "1", SCRIPTS / "launch_env.py"], tmp_path)
    assert result.returncode != 0
    # The first process to fail ends the job, so the other may be stopped before it says why.
    failed = []
    for log, role in (("serverlog.0", "PSERVER"), ("workerlog.0", "TRAINER")):
        text = (tmp_path / "log" / log).read_text()
        if "Traceback" in text:
            failed.append(role)
            assert f"fleet.init(is_collective=True) in a process of a parameter-server launch " \
                   f"(TRAINING_ROLE={role}, PADDLE_PSERVERS_IP_PORT_LIST=" in text
            assert "fleetrun --nproc_per_node N script.py" in text
            assert "PADDLE_TRAINER_ID" not in text
    assert failed, result.stdout + result.stderr


def test_ps_launcher_says_servers_are_killed_on_stderr(tmp_path):
    token = f"fleetx-first-hour-{uuid.uuid4().hex}"
    try:
        result = run(["--server_num", "1", "--worker_num", "1", SCRIPTS / "ps_launch_env.py",
                      token, "finish"], tmp_path)
        assert result.returncode == 0, result.stdout + result.stderr
        assert wait_for(lambda: not job_pids(token), 5), f"orphans: {job_pids(token)}"
    finally:
        kill_all(job_pids(token))
    # Paddle's launcher tests grep stderr for it.
    assert "all parameter server are killed" in result.stderr
    assert "all parameter server are killed" not in result.stdout
