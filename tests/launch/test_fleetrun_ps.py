"""``fleetrun`` in parameter-server mode: the plan (pure), then the real launcher on tiny scripts.

``ps_launch_env.py`` imports no torch, so those runs take a second or two; one run of the real
fleet API (``ps_fleet_train.py``) checks that servers finish by themselves and that worker 0's
progress reaches the terminal, and one dry run prints the plan.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from fleetx.launch import ps
from fleetx.launch.api import ConfigError
from fleetx.launch.config import LaunchConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
import test_fleetrun  # noqa: E402
from test_fleetrun import fleetrun_cmd, job_pids, kill_all, wait_for  # noqa: E402

two_nodes = test_fleetrun.two_nodes  # the network-namespace fixture

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
ENV_SCRIPT = SCRIPTS / "ps_launch_env.py"


def config(**kw) -> LaunchConfig:
    return LaunchConfig(training_script="train.py", **kw)


def port_source():
    """A stand-in for free_ports: distinct ports from 7000 on."""
    taken = []

    def free_ports(n):
        taken.extend(range(7000 + len(taken), 7000 + len(taken) + n))
        return taken[-n:]
    return free_ports


# -- planning, no processes -----------------------------------------------------------------
def test_local_flags_start_everything_here_with_the_reference_environment():
    p = ps.plan(config(server_num=2, worker_num=2), free_ports=port_source(), user_omp=None)
    assert p.servers == ("127.0.0.1:7000", "127.0.0.1:7001")
    assert p.workers == ("127.0.0.1:7002", "127.0.0.1:7003") and p.single_node
    assert [(q.role, q.index) for q in p.local] == [("server", 0), ("server", 1),
                                                     ("worker", 0), ("worker", 1)]
    server, worker = p.local[1].env, p.local[3].env
    assert server["TRAINING_ROLE"] == "PSERVER" and "PADDLE_TRAINER_ID" not in server
    assert (server["POD_IP"], server["PADDLE_PORT"]) == ("127.0.0.1", "7001")
    assert worker["TRAINING_ROLE"] == "TRAINER" and worker["PADDLE_TRAINER_ID"] == "1"
    assert worker["PADDLE_PSERVERS_IP_PORT_LIST"] == ",".join(p.servers)
    assert worker["PADDLE_TRAINER_ENDPOINTS"] == ",".join(p.workers)
    assert worker["PADDLE_TRAINERS_NUM"] == "2" and worker["OMP_NUM_THREADS"] == "1"


def test_each_node_starts_its_own_endpoints_and_bare_worker_ips_get_paddles_ports():
    c = config(servers=("10.0.0.1:6000", "10.0.0.2:6000"), workers=("10.0.0.1", "10.0.0.2"))
    p = ps.plan(c, is_local=lambda ip: ip == "10.0.0.2", user_omp="4", user_secret=True)
    assert p.workers == ("10.0.0.1:6172", "10.0.0.2:6173")
    assert [q.name for q in p.local] == ["server 1 (10.0.0.2:6000)", "worker 1 (10.0.0.2:6173)"]
    assert "OMP_NUM_THREADS" not in p.local[0].env and not p.single_node


@pytest.mark.parametrize("kw, flag, message", [
    (dict(server_num=3, servers=("a:1", "b:1"), worker_num=1), "--server_num",
     "is 3 but --servers lists 2 endpoint(s)"),
    (dict(worker_num=2), "--server_num", "needs --server_num or --servers"),
    (dict(servers=("10.0.0.1",), worker_num=1), "--servers", "10.0.0.1 has no port"),
    (dict(servers=("10.9.9.9:1",), workers=("10.9.9.9:2",)), "--servers",
     "none of the servers (10.9.9.9:1) or workers (10.9.9.9:2) is an address of this host"),
    (dict(server_num=1, worker_num=1, nproc_per_node=2), "--nproc_per_node",
     "is a collective flag"),
])
def test_bad_combinations_name_the_flag(kw, flag, message):
    with pytest.raises(ConfigError) as err:
        ps.plan(config(**kw), is_local=lambda ip: ip == "127.0.0.1", free_ports=port_source())
    assert err.value.flag == flag and message in str(err.value)


# -- the real launcher --------------------------------------------------------------------------
def fleetrun(cwd, *args, timeout=120):
    return subprocess.run(fleetrun_cmd(*args), cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def test_a_job_runs_logs_every_role_and_stops_the_servers(tmp_path):
    token = f"fleetx-ps-test-{uuid.uuid4().hex}"
    try:
        res = fleetrun(tmp_path, "--server_num", "2", "--worker_num", "2", ENV_SCRIPT, token,
                       "finish")
        assert res.returncode == 0, res.stdout + res.stderr
        assert wait_for(lambda: not job_pids(token), 5), f"orphans: {job_pids(token)}"
    finally:
        kill_all(job_pids(token))
    out, log = res.stdout, tmp_path / "log"
    assert "Run parameter-server mode: 2 server(s)" in out and "Distributed Envs" in out
    assert "all workers exit, going to finish parameter server." in out
    assert out.rstrip().endswith("Local processes completed.")
    assert "stdout of worker 0" in out and "stderr of worker 0" in out  # live, from its log
    assert "of worker 1" not in out and "of server" not in out
    envs = {name: json.loads((log / f"env.{name}.json").read_text())
            for name in ("server.0", "server.1", "worker.0", "worker.1")}
    servers = envs["server.0"]["PADDLE_PSERVERS_IP_PORT_LIST"].split(",")
    workers = envs["worker.0"]["PADDLE_TRAINER_ENDPOINTS"].split(",")
    assert len(set(servers + workers)) == 4
    for role, eps in (("server", servers), ("worker", workers)):
        for i in range(2):
            e = envs[f"{role}.{i}"]
            assert e["TRAINING_ROLE"] == ("PSERVER" if role == "server" else "TRAINER")
            assert f"{e['POD_IP']}:{e['PADDLE_PORT']}" == eps[i]
            assert e["PADDLE_TRAINERS_NUM"] == "2" and e["FLEETX_LOG_DIR"] == str(log)
            assert e.get("PADDLE_TRAINER_ID") == (str(i) if role == "worker" else None)
            text = (log / f"{role}log.{i}").read_text()
            assert f"stdout of {role} {i}" in text and f"stderr of {role} {i}" in text


def test_a_failing_process_stops_the_job_and_is_named(tmp_path):
    token = f"fleetx-ps-test-{uuid.uuid4().hex}"
    start = time.monotonic()
    try:
        res = fleetrun(tmp_path, "--server_num", "1", "--worker_num", "2", ENV_SCRIPT, token,
                       "fail", timeout=90)
        assert wait_for(lambda: not job_pids(token), 5), f"orphans: {job_pids(token)}"
    finally:
        kill_all(job_pids(token))
    assert time.monotonic() - start < 60  # the others would sleep 300 s
    assert res.returncode == 1, res.stdout + res.stderr
    err = res.stderr
    assert "ABORT!!! Out of all 1 server(s) and 2 worker(s), worker 1 failed" in err
    assert "worker 1 (127.0.0.1:" in err and "exited with code 3" in err
    assert "worker 1 gives up: boom" in err  # the tail of its log
    assert "stopped the other process(es): server 0, worker 0" in err


def test_no_process_survives_a_sigkilled_fleetrun(tmp_path):
    token = f"fleetx-ps-test-{uuid.uuid4().hex}"
    proc = subprocess.Popen(fleetrun_cmd("--server_num", "1", "--worker_num", "2", ENV_SCRIPT,
                                         token, "sleep"),
                            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        names = ("server.0", "worker.0", "worker.1")
        assert wait_for(lambda: all((tmp_path / "log" / f"env.{n}.json").exists()
                                    for n in names), 60), proc.stderr.read1(4000)
        # fleetrun, 3 processes, their guardians and the children they started
        assert wait_for(lambda: len(job_pids(token)) == 10, 10), job_pids(token)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert wait_for(lambda: not job_pids(token), 5), f"orphans: {job_pids(token)}"
    finally:
        proc.kill()
        kill_all(job_pids(token))


def test_the_fleet_api_job_ends_when_its_workers_do(tmp_path):
    script = SCRIPTS / "ps_fleet_train.py"
    out = tmp_path / "out"
    out.mkdir()
    res = subprocess.run(fleetrun_cmd("--server_num", "1", "--worker_num", "2", script, "--out",
                                      out, "--steps", "30", "--mode", "async"),
                         cwd=tmp_path, capture_output=True, text=True, timeout=180,
                         env={**os.environ, "FLEETX_LOG_INTERVAL": "0.01"})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "all workers exit, going to finish parameter server." in res.stdout
    assert "fleetx ps worker 0: step " in res.stdout and " samples/s, loss " in res.stdout
    assert "worker 0 done" in res.stdout and "worker 1 done" not in res.stdout
    server_log = (tmp_path / "log" / "serverlog.0").read_text()
    assert "rows" in server_log and "requests/s" in server_log
    # each process's log names the kernel backend it runs on
    assert "server 0" in server_log and "parameter-server kernels: C kernels" in server_log
    for n in (0, 1):
        worker_log = (tmp_path / "log" / f"workerlog.{n}").read_text()
        assert f"worker {n}: parameter-server kernels: C kernels" in worker_log, worker_log[-2000:]


def test_dry_run_prints_the_plan_as_worker_0(tmp_path):
    res = fleetrun(tmp_path, "--dry-run", "--servers", "10.9.9.1:6000,10.9.9.2:6000",
                   "--workers", "10.9.9.1,10.9.9.2,10.9.9.3", SCRIPTS / "ps_fleet_train.py",
                   "--out", tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "as worker 0 of 3 worker(s) with 2 server(s)" in res.stdout
    assert "fleetx plan: mode=ps world_size=3" in res.stdout
    assert "parameter_server           applied   sync mode: 2 server(s), 3 worker(s); " \
           "sparse tables: emb, tags" in res.stdout
    assert not (tmp_path / "worker0.npz").exists()


# -- two nodes: network namespaces joined by a veth pair (fixture of test_fleetrun.py) ----------
def test_two_nodes_each_start_their_own_server_and_worker(tmp_path, two_nodes):
    addrs = [addr for _, _, addr in two_nodes]
    servers = ",".join(f"{a}:6000" for a in addrs)
    secret = tmp_path / "secret"
    secret.write_text(uuid.uuid4().hex)
    procs = []
    for node, (ns, _, _) in enumerate(two_nodes):
        cwd = tmp_path / f"node{node}"
        cwd.mkdir()
        cmd = ["ip", "netns", "exec", ns, *fleetrun_cmd(
            "--servers", servers, "--workers", ",".join(addrs), "--ps_secret_file", secret,
            SCRIPTS / "ps_fleet_train.py", "--out", cwd, "--steps", "3")]
        procs.append(subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=150)[0])
    finally:
        for proc in procs:
            proc.kill()
    for node, proc in enumerate(procs):
        assert proc.returncode == 0, outputs[node]
        assert f"this node starts server {node}, worker {node}" in outputs[node]
        env = (tmp_path / f"node{node}" / "log" / f"workerlog.{node}").read_text()
        assert f"worker {node} done" in env
        assert (tmp_path / f"node{node}" / f"worker{node}.npz").exists()
    assert "PADDLE_TRAINER_ENDPOINTS" in outputs[0] and f"{addrs[1]}:6173" in outputs[0]
