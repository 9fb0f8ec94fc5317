"""fleetrun when things go wrong, for real: a node that never comes, ports that are taken, a log
folder that cannot be written, a rank that fails (once, or with a traceback); and where the
rendezvous store listens while a job runs.

Nodes are loopback addresses (127.0.0.1 and 127.0.0.2, both on ``lo``), so no namespace is
needed. ``FLEETX_TIMEOUT=8`` keeps the waits short; the bounds on how long fleetrun takes to
give up are generous, for a loaded machine.
"""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fleetx.launch import hosts

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_fleetrun import fleetrun_cmd, run, wait_for  # noqa: E402

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
_TIMEOUT = "8"


def run_env(args, cwd, timeout=120, **variables) -> subprocess.CompletedProcess:
    environ = dict(os.environ, **variables)
    return subprocess.run(fleetrun_cmd(*args), cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=environ)


def listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket process ``pid`` listens on, from /proc/net/tcp."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)
            for line in f:
                cols = line.split()
                local, state, inode = cols[1], cols[3], cols[9]
                if state == "0A" and inode in inodes:  # 0A: LISTEN
                    addr, port = local.split(":")
                    raw = bytes.fromhex(addr)
                    if len(raw) == 4:
                        ip = socket.inet_ntop(socket.AF_INET, raw[::-1])
                    else:  # four little-endian 32-bit words
                        words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
                        ip = socket.inet_ntop(socket.AF_INET6, words)
                    found.add((ip, int(port, 16)))
    return found


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("fleetrun: error:")]


# -- a node that never comes ---------------------------------------------------------------------
@pytest.mark.parametrize("host,missing,awaited", [
    ("127.0.0.1", "127.0.0.2", "waiting for node(s) 127.0.0.2 to join the rendezvous at"),
    ("127.0.0.2", "127.0.0.1", "waiting for node 0 (127.0.0.1) to serve the rendezvous store at"),
], ids=["node0-waits-for-node1", "node1-waits-for-node0"])
def test_a_node_that_never_comes_is_reported_and_named_at_the_timeout(tmp_path, host, missing,
                                                                      awaited):
    port = hosts.free_ports(1)[0]
    start = time.monotonic()
    res = run_env(["--ips", "127.0.0.1,127.0.0.2", "--host", host, "--master",
                   f"127.0.0.1:{port}", SCRIPTS / "launch_fail.py"], tmp_path,
                  FLEETX_TIMEOUT=_TIMEOUT)
    elapsed = time.monotonic() - start
    assert res.returncode == 1, res.stdout + res.stderr
    assert elapsed < 60
    assert re.search(rf"fleetrun: {re.escape(awaited)} 127\.0\.0\.1:{port} \(\d s of 8 s\)",
                     res.stderr), res.stderr
    errors = error_lines(res.stderr)
    assert len(errors) == 1 and missing in errors[0] and "within 8 s (FLEETX_TIMEOUT)" in errors[0]
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "log" / "workerlog.0").exists()  # no process started


def test_an_elastic_job_says_how_many_nodes_joined_and_gives_up_at_the_timeout(tmp_path):
    port = hosts.free_ports(1)[0]
    start = time.monotonic()
    res = run_env(["--nnodes", "2:3", "--master", f"127.0.0.1:{port}",
                   SCRIPTS / "launch_fail.py"], tmp_path, FLEETX_TIMEOUT=_TIMEOUT)
    assert res.returncode == 1, res.stdout + res.stderr
    assert time.monotonic() - start < 60
    assert (f"fleetrun: waiting for node(s) to join the rendezvous at 127.0.0.1:{port}: 1 of at "
            f"least 2 joined (") in res.stderr
    assert error_lines(res.stderr) == [
        f"fleetrun: error: only 1 of at least 2 node(s) joined the rendezvous at "
        f"127.0.0.1:{port} within 8 s (FLEETX_TIMEOUT): 1 node(s) missing; start fleetrun there "
        f"with the same --nnodes and --master, or set FLEETX_TIMEOUT to wait longer"]


@pytest.mark.slow
def test_an_elastic_job_says_it_waits_for_more_nodes_and_binds_its_stores_to_master(tmp_path):
    """torch waits 30 s for more nodes once the minimum joined: fleetrun says so. Then both of
    its stores (the rendezvous one and the workers' one) listen on 127.0.0.1 only."""
    port = hosts.free_ports(1)[0]
    token = f"fleetx-elastic-bind-{os.getpid()}"
    proc = subprocess.Popen(
        fleetrun_cmd("--nnodes", "1:2", "--master", f"127.0.0.1:{port}",
                     SCRIPTS / "launch_sleep.py", token, tmp_path),
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready = wait_for(lambda: (tmp_path / "ready.0").exists(), 120)
        sockets = listening(proc.pid)
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    assert ready, err
    assert (f"fleetrun: 1 of 1..2 node(s) joined the rendezvous at 127.0.0.1:{port}; starting "
            f"in ") in err
    assert ("127.0.0.1", port) in sockets and len(sockets) == 2, sockets
    assert {addr for addr, _ in sockets} == {"127.0.0.1"}, sockets


# -- two loopback nodes; where the store listens --------------------------------------------------
def test_two_nodes_meet_and_node0s_store_listens_on_its_own_address_only(tmp_path):
    """Node 0 is 127.0.0.2 here: its store must listen there, and not on 127.0.0.1 or 0.0.0.0.
    Node 1 starts only once node 0 has said it waits for it."""
    port = hosts.free_ports(1)[0]
    ips = "127.0.0.2,127.0.0.1"
    procs = {}
    for node, host in ((0, "127.0.0.2"), (1, "127.0.0.1")):
        cwd = tmp_path / f"node{node}"
        cwd.mkdir()
        procs[node] = subprocess.Popen(
            fleetrun_cmd("--ips", ips, "--host", host, "--master", f"127.0.0.2:{port}",
                         SCRIPTS / "launch_allreduce.py"),
            cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=dict(os.environ, FLEETX_TIMEOUT="120"))
        if node == 0:
            seen = wait_for(lambda: ("127.0.0.2", port) in listening(procs[0].pid), 60)
            sockets = listening(procs[0].pid)
    try:
        outputs = {node: proc.communicate(timeout=120) for node, proc in procs.items()}
    finally:
        for proc in procs.values():
            proc.kill()
    assert seen, outputs[0]
    assert sockets == {("127.0.0.2", port)}, sockets  # nothing on 127.0.0.1 or any interface
    for node, proc in procs.items():
        assert proc.returncode == 0, outputs[node]
    endpoints = f"127.0.0.2:{port + 1},127.0.0.1:{port + 1}"
    assert f"RESULT 0 0 3.0 {endpoints} 127.0.0.2:{port + 1}" in outputs[0][0]
    log1 = (tmp_path / "node1" / "log" / "workerlog.1").read_text()
    assert f"RESULT 1 1 3.0 {endpoints} 127.0.0.1:{port + 1}" in log1


def test_a_single_node_store_listens_on_127_0_0_1_only(tmp_path):
    port = hosts.free_ports(1)[0]
    token = f"fleetx-store-bind-{os.getpid()}"
    proc = subprocess.Popen(
        fleetrun_cmd("--master", f"127.0.0.1:{port}", "--nproc_per_node", "2",
                     SCRIPTS / "launch_sleep.py", token, tmp_path),
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready = wait_for(lambda: all((tmp_path / f"ready.{r}").exists() for r in range(2)), 90)
        sockets = listening(proc.pid)
        banner_line = f"rendezvous at 127.0.0.1:{port}."
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=60)
    assert ready, err
    assert banner_line in out
    assert sockets == {("127.0.0.1", port)}, sockets


# -- one line, not a traceback --------------------------------------------------------------------
def test_a_busy_master_port_is_one_line(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = run(["--master", f"127.0.0.1:{port}", SCRIPTS / "launch_fail.py"], tmp_path)
    assert res.returncode == 1
    assert res.stderr.strip().splitlines() == [
        f"fleetrun: error: cannot serve the rendezvous store at 127.0.0.1:{port}: port {port} "
        f"is already in use on 127.0.0.1; choose a free one with --master HOST:PORT (the same "
        f"on every node)"]


@pytest.mark.parametrize("mode", [[], ["--server_num", "1", "--worker_num", "1"]],
                         ids=["collective", "ps"])
def test_a_log_dir_that_cannot_be_written_is_one_line(tmp_path, mode):
    (tmp_path / "a_file").write_text("")
    res = run([*mode, "--log_dir", tmp_path / "a_file" / "log", SCRIPTS / "launch_fail.py"],
              tmp_path)
    assert res.returncode == 1
    assert res.stderr.strip().splitlines() == [
        f"fleetrun: error: --log_dir {tmp_path}/a_file/log: cannot write the logs there: "
        f"Not a directory"]


def test_a_busy_parameter_server_port_is_named_before_any_process_starts(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = run(["--servers", f"127.0.0.1:{port}", "--workers", "127.0.0.1",
                   SCRIPTS / "ps_launch_env.py"], tmp_path)
    assert res.returncode == 1
    assert res.stderr.strip().splitlines() == [
        f"fleetrun: error: server 0 (127.0.0.1:{port}) cannot listen on port {port} of "
        f"127.0.0.1: Address already in use; free it or give that server another port in "
        f"--servers"]
    assert "proc_id" not in res.stdout  # nothing was started


# -- failures of a rank ---------------------------------------------------------------------------
def test_a_restart_is_announced_with_its_cause(tmp_path):
    res = run(["--nproc_per_node", "2", "--max_restarts", "2", SCRIPTS / "launch_flaky.py"],
              tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    announced = [line for line in res.stderr.splitlines() if "restart" in line]
    assert len(announced) == 1, res.stderr
    assert announced[0].startswith("fleetrun: restart 1 of 2: rank 1 (local rank 1, pid ")
    assert announced[0].endswith(f") exited with code 7 (log: {tmp_path}/log/workerlog.1); "
                                 f"restarting the worker group")
    assert "attempt 1 of rank 0" in res.stdout


@pytest.mark.parametrize("rank", [0, 1])
def test_a_failing_ranks_traceback_is_printed_once(tmp_path, rank):
    res = run(["--nproc_per_node", "2", SCRIPTS / "launch_raise.py", rank], tmp_path)
    assert res.returncode == 1, res.stdout + res.stderr
    both = res.stdout + res.stderr
    assert both.count("Traceback (most recent call last)") == 1, both
    assert both.count("in train_step") == 1, both
    assert f"RuntimeError: rank {rank} cannot train: broken batch" in res.stderr  # the report
    assert f"the trainer process with rank=[{rank}] was aborted" in res.stderr
