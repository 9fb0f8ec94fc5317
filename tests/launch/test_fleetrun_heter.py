"""``fleetrun`` with heter workers: the plan (pure), the real launcher on the torch-free
``ps_launch_env.py`` (every role's environment and log, no process left behind when any role
dies), and ``--dry-run`` listing the heter processes."""
from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from fleetx.launch import ps
from fleetx.launch.api import ConfigError
from fleetx.launch.cli import parse_config
from fleetx.launch.config import LaunchConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_fleetrun import fleetrun_cmd, job_pids, kill_all, wait_for  # noqa: E402
from test_fleetrun_ps import port_source  # noqa: E402

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
ENV_SCRIPT = SCRIPTS / "ps_launch_env.py"


def config(**kw) -> LaunchConfig:
    return LaunchConfig(training_script="train.py", **kw)


def test_heter_flags_select_ps_mode_and_give_the_reference_environment():
    assert parse_config(["--heter_worker_num", "1", "--server_num", "1", "--worker_num", "2",
                         "t.py"]).resolved_mode().value == "ps"
    p = ps.plan(config(server_num=1, worker_num=2, heter_worker_num=1), free_ports=port_source())
    assert p.heters == ("127.0.0.1:7003",) and p.single_node
    assert [q.label for q in p.local] == ["server 0", "worker 0", "worker 1", "heter worker 0"]
    heter = p.local[3]
    assert heter.log_path("/l") == "/l/heterlog.0"
    assert heter.env["TRAINING_ROLE"] == "HETER_TRAINER" and "PADDLE_TRAINER_ID" not in heter.env
    assert (heter.env["POD_IP"], heter.env["PADDLE_PORT"]) == ("127.0.0.1", "7003")
    for q in p.local:  # every role knows where the heter workers are, under both names
        assert q.env["PADDLE_ALL_HETER_TRAINER_IP_PORT_LIST"] == "127.0.0.1:7003"
        assert q.env["PADDLE_HETER_TRAINER_IP_PORT_LIST"] == "127.0.0.1:7003"
    assert "1 heter worker(s) 127.0.0.1:7003; this node starts server 0, worker 0, worker 1, " \
           "heter worker 0" in p.describe()
    assert "/heterlog.*" in p.describe()
    plain = ps.plan(config(server_num=1, worker_num=1), free_ports=port_source())
    assert "PADDLE_ALL_HETER_TRAINER_IP_PORT_LIST" not in plain.local[0].env


def test_each_node_starts_its_own_heter_workers():
    c = config(servers=("10.0.0.1:6000",), workers=("10.0.0.1", "10.0.0.2"),
               heter_workers=("10.0.0.1:7000", "10.0.0.2:7000"))
    p = ps.plan(c, is_local=lambda ip: ip == "10.0.0.2", user_secret=True)
    assert [q.name for q in p.local] == ["worker 1 (10.0.0.2:6172)",
                                         "heter worker 1 (10.0.0.2:7000)"]


@pytest.mark.parametrize("kw, flag, message", [
    (dict(heter_workers=("10.0.0.1",)), "--heter_workers", "10.0.0.1 has no port"),
    (dict(heter_workers=("127.0.0.1:9",), heter_worker_num=2), "--heter_worker_num",
     "is 2 but --heter_workers lists 1 endpoint(s)"),
    (dict(heter_workers=("127.0.0.1:7000",)), "--servers",
     "127.0.0.1:7000 listed more than once among servers, workers and heter workers"),
])
def test_bad_heter_flags_name_the_flag(kw, flag, message):
    base = dict(servers=("127.0.0.1:7000",), worker_num=1)
    with pytest.raises(ConfigError) as err:
        ps.plan(config(**{**base, **kw}), free_ports=port_source())
    assert err.value.flag == flag and message in str(err.value)


def fleetrun(cwd, *args, timeout=120):
    return subprocess.run(fleetrun_cmd(*args), cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def test_a_heter_job_runs_logs_every_role_and_stops_what_lingers(tmp_path):
    token = f"fleetx-heter-test-{uuid.uuid4().hex}"
    try:
        res = fleetrun(tmp_path, "--server_num", "1", "--worker_num", "2",
                       "--heter_worker_num", "1", ENV_SCRIPT, token, "finish")
        assert res.returncode == 0, res.stdout + res.stderr
        assert wait_for(lambda: not job_pids(token), 5), f"orphans: {job_pids(token)}"
    finally:
        kill_all(job_pids(token))
    log = tmp_path / "log"
    assert sorted(p.name for p in log.glob("*log.*")) == [
        "heterlog.0", "serverlog.0", "workerlog.0", "workerlog.1"]
    assert "stdout of heter 0" in (log / "heterlog.0").read_text()
    e = json.loads((log / "env.heter.0.json").read_text())
    assert e["TRAINING_ROLE"] == "HETER_TRAINER"
    assert e["PADDLE_ALL_HETER_TRAINER_IP_PORT_LIST"] == f"{e['POD_IP']}:{e['PADDLE_PORT']}"
    assert "launch heter proc_id:" in res.stdout
    assert "all heter_worker are killed" in res.stderr


@pytest.mark.parametrize("mode, failed", [("fail-heter", "heter worker 0"),
                                          ("fail", "worker 1"), ("fail-server", "server 0")])
def test_when_any_role_dies_the_job_stops_and_leaves_nothing_behind(tmp_path, mode, failed):
    token = f"fleetx-heter-test-{uuid.uuid4().hex}"
    try:
        res = fleetrun(tmp_path, "--server_num", "1", "--worker_num", "2",
                       "--heter_worker_num", "1", ENV_SCRIPT, token, mode, timeout=90)
        assert wait_for(lambda: not job_pids(token), 5), f"orphans: {job_pids(token)}"
    finally:
        kill_all(job_pids(token))
    assert res.returncode == 1, res.stdout + res.stderr
    assert (f"ABORT!!! Out of all 1 server(s), 1 heter worker(s) and 2 worker(s), {failed} "
            "failed") in res.stderr
    assert f"{failed} gives up: boom" in res.stderr


def test_dry_run_lists_the_heter_processes(tmp_path):
    res = fleetrun(tmp_path, "--dry-run", "--server_num", "1", "--worker_num", "2",
                   "--heter_worker_num", "1", SCRIPTS / "ps_heter_train.py", "--out", tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    assert "heter worker 0 (127.0.0.1:" in out and "/log/heterlog.0" in out
    assert "as worker 0 of 2 worker(s) with 1 server(s) and 1 heter worker(s)" in out
    assert "sync mode: 1 server(s), 2 worker(s), 1 heter worker(s) on cpu (lock-step)" in out
    assert not (tmp_path / "worker0.npz").exists()
