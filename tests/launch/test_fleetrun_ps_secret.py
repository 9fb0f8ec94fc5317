"""fleetrun and the parameter server's shared secret: one per single-node job, in the processes'
environment only; the same file on every node of a multi-node job; a mismatch names the
endpoint that refused it."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
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


def config(**kw) -> LaunchConfig:
    return LaunchConfig(training_script="train.py", **kw)


_next_port = iter(range(7100, 8000))


def ports(n):
    """A stand-in for free_ports: distinct ports every call."""
    return [next(_next_port) for _ in range(n)]


def test_a_single_node_job_gets_a_fresh_secret_outside_the_processes_variables():
    made = iter(["a" * 64, "b" * 64])
    p = ps.plan(config(server_num=1, worker_num=2), free_ports=ports,
                make_secret=lambda: next(made))
    q = ps.plan(config(server_num=1, worker_num=2), free_ports=ports,
                make_secret=lambda: next(made))
    assert (p.secret, q.secret) == ("a" * 64, "b" * 64)  # one per job
    assert all("FLEETX_PS_SECRET" not in proc.env for proc in p.local)  # the banner shows env
    assert "a" * 64 not in repr(p) and "a" * 64 not in p.describe()


def test_a_secret_file_or_the_users_secret_is_passed_on_and_nothing_is_generated(tmp_path):
    p = ps.plan(config(server_num=1, worker_num=1, ps_secret_file="s.txt"), free_ports=ports)
    assert p.secret is None
    assert {proc.env["FLEETX_PS_SECRET_FILE"] for proc in p.local} == {os.path.abspath("s.txt")}
    q = ps.plan(config(server_num=1, worker_num=1), free_ports=ports, user_secret=True)
    assert q.secret is None and all("FLEETX_PS_SECRET_FILE" not in x.env for x in q.local)
    with pytest.raises(ConfigError, match="FLEETX_PS_SECRET or FLEETX_PS_SECRET_FILE is set as "
                                          "well; give the secret one way"):
        ps.plan(config(server_num=1, worker_num=1, ps_secret_file="s.txt"), free_ports=ports,
                user_secret=True)


def test_a_job_on_several_nodes_without_a_secret_is_refused():
    c = config(servers=("10.0.0.1:6000", "10.0.0.2:6000"), workers=("10.0.0.1", "10.0.0.2"))
    with pytest.raises(ConfigError) as err:
        ps.plan(c, is_local=lambda ip: ip == "10.0.0.2")
    assert err.value.flag == "--ps_secret_file"
    assert "a job on several nodes needs the same secret on every node" in str(err.value)
    assert ps.plan(c, is_local=lambda ip: ip == "10.0.0.2", user_secret=True).secret is None


def test_fleetrun_refuses_a_missing_secret_file_in_one_line(tmp_path):
    res = subprocess.run(fleetrun_cmd("--server_num", "1", "--worker_num", "1",
                                      "--ps_secret_file", tmp_path / "nope",
                                      SCRIPTS / "ps_launch_env.py", "x", "finish"),
                         cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert res.returncode != 0
    assert re.search(r"fleetrun: error: (argument )?--ps_secret_file: .*nope: no such file or not readable",
                     res.stderr), res.stderr


def test_every_process_of_a_job_gets_the_same_generated_secret_in_its_environment_only(
        tmp_path):
    token = f"fleetx-ps-secret-{uuid.uuid4().hex}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETX_PS_SECRET")}
    try:
        res = subprocess.run(fleetrun_cmd("--server_num", "1", "--worker_num", "2",
                                          SCRIPTS / "ps_launch_env.py", token, "finish"),
                             cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
        assert res.returncode == 0, res.stdout + res.stderr
        assert wait_for(lambda: not job_pids(token), 5)
    finally:
        kill_all(job_pids(token))
    log = tmp_path / "log"
    seen = {json.loads((log / f"env.{n}.json").read_text()).get("FLEETX_PS_SECRET")
            for n in ("server.0", "worker.0", "worker.1")}
    assert len(seen) == 1
    secret = seen.pop()
    assert secret and re.fullmatch(r"[0-9a-f]{64}", secret)
    assert secret not in res.stdout + res.stderr and "FLEETX_PS_SECRET" not in res.stdout
    for path in log.iterdir():
        if not path.name.startswith("env."):
            assert secret not in path.read_text(), path


def test_a_fleet_api_job_trains_with_its_generated_secret(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETX_PS_SECRET")}
    out = tmp_path / "out"
    out.mkdir()
    res = subprocess.run(fleetrun_cmd("--server_num", "2", "--worker_num", "2",
                                      SCRIPTS / "ps_fleet_train.py", "--out", out, "--steps",
                                      "5", "--mode", "async"),
                         cwd=tmp_path, capture_output=True, text=True, timeout=180, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert (out / "worker0.npz").exists() and (out / "worker1.npz").exists()
    for i in range(2):
        text = (tmp_path / "log" / f"serverlog.{i}").read_text()
        assert "no shared secret" not in text and "failed authentication" not in text


def test_two_nodes_with_different_secrets_fail_naming_the_endpoint(tmp_path, two_nodes):
    addrs = [addr for _, _, addr in two_nodes]
    servers = ",".join(f"{a}:6000" for a in addrs)
    procs = []
    for node, (ns, _, _) in enumerate(two_nodes):
        cwd = tmp_path / f"node{node}"
        cwd.mkdir()
        secret = cwd / "secret"
        secret.write_text(uuid.uuid4().hex)  # each node a different one
        cmd = ["ip", "netns", "exec", ns, "env", "FLEETX_TIMEOUT=60", *fleetrun_cmd(
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
    both = "\n".join(f"--- node {n} ---\n{out}" for n, out in enumerate(outputs))
    for proc in procs:
        assert proc.returncode == 1, both
    # A worker meets server 0, then server 1. The first node whose worker is refused stops,
    # taking its server with it, so the other node's worker may find that server refusing
    # or already gone: each node names the other node's server either way, and at least
    # one refusal is named with its endpoint and the fix.
    other = {0: 1, 1: 0}
    refused = {n: f"server {o} ({addrs[o]}:6000) rejected this process's secret" in outputs[n]
               for n, o in other.items()}
    assert any(refused.values()), both
    for n, o in other.items():
        assert refused[n] or f"server {o} ({addrs[o]}:6000) is not reachable" in outputs[n], both
        if refused[n]:
            assert "--ps_secret_file" in outputs[n]
            # The refusing server says who failed: this node's address.
            log = (tmp_path / f"node{o}" / "log" / f"serverlog.{o}").read_text()
            assert f"a connection from {addrs[n]}" in log and "failed authentication" in log
