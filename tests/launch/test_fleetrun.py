"""End to end: the real ``fleetrun`` on the tiny scripts in ``tests/scripts``.

Each run imports torch in the launcher and in every rank (~2.5 s each on an idle core), so the
file keeps to one run per behaviour; the whole file takes well under 90 s on two cores. The
scripts that only sleep or fail do not import torch.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
import netns_nodes  # noqa: E402

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
_CONSOLE = Path(sys.executable).with_name("fleetrun")


def fleetrun_cmd(*args) -> list[str]:
    """The installed console script when there is one, else ``python -m fleetx.launch``."""
    base = [str(_CONSOLE)] if _CONSOLE.exists() else [sys.executable, "-m", "fleetx.launch"]
    return base + [str(a) for a in args]


def run(args, cwd, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run(fleetrun_cmd(*args), cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def wait_for(predicate, timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def job_pids(token: str) -> list[int]:
    """Live processes whose command line carries ``token`` (zombies have an empty one)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if token.encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def kill_all(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


# -- a successful job ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def env_job(tmp_path_factory):
    """One 2-rank run of launch_env.py (fleet.init + all_reduce), shared by the checks below."""
    cwd = tmp_path_factory.mktemp("env_job")
    result = run(["--nproc_per_node", "2", SCRIPTS / "launch_env.py", "--flag", "x"], cwd)
    records = []
    for rank in range(2):
        path = cwd / "log" / f"env.{rank}.json"
        records.append(json.loads(path.read_text()) if path.exists() else None)
    return cwd, result, records


def test_success_exits_zero_and_prints_banner_and_table(env_job):
    _, result, _ = env_job
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "-----------  Configuration Arguments -----------" in out
    assert "nproc_per_node: 2" in out and "training_script_args: ['--flag', 'x']" in out
    assert "Distributed Envs" in out and "PADDLE_TRAINER_ENDPOINTS" in out
    assert "setting OMP_NUM_THREADS=1" in out
    assert out.rstrip().endswith("Local processes completed.")


def test_every_rank_has_consistent_paddle_and_torchrun_variables(env_job):
    cwd, result, records = env_job
    assert None not in records, result.stdout + result.stderr
    endpoints = records[0]["env"]["PADDLE_TRAINER_ENDPOINTS"].split(",")
    assert len(endpoints) == 2 and len(set(endpoints)) == 2
    for rank, record in enumerate(records):
        e = record["env"]
        assert e["RANK"] == e["PADDLE_TRAINER_ID"] == str(rank)
        assert e["WORLD_SIZE"] == e["PADDLE_TRAINERS_NUM"] == "2"
        assert e["LOCAL_RANK"] == e["PADDLE_RANK_IN_NODE"] == str(rank)
        assert (e["LOCAL_WORLD_SIZE"], e["GROUP_RANK"], e["MASTER_ADDR"]) == ("2", "0", "127.0.0.1")
        assert e["MASTER_PORT"].isdigit()
        assert e["PADDLE_TRAINER_ENDPOINTS"] == ",".join(endpoints)
        assert e["PADDLE_CURRENT_ENDPOINT"] == endpoints[rank]
        assert (e["PADDLE_LOCAL_DEVICE_IDS"], e["PADDLE_WORLD_DEVICE_IDS"]) == ("", "")
        assert "FLAGS_selected_gpus" not in e  # CPU job, as in Paddle
        assert (e["PADDLE_DISTRI_BACKEND"], e["PADDLE_TRAINING_ROLE"]) == ("gloo", "TRAINER")
        assert e["FLEETX_LOG_DIR"] == str(cwd / "log")
        assert e["OMP_NUM_THREADS"] == "1"
        assert e["FLEETX_TTY"] == "0"  # fleetrun's stdout is a pipe here
        assert record["fleet"] == {"worker_index": rank, "worker_num": 2, "local_rank": rank}
        assert record["all_reduce"] == 3.0
        assert record["argv"][1:] == ["--flag", "x"] and record["name"] == "__main__"
    lines = (cwd / "log" / "endpoints.log").read_text().splitlines()
    assert lines == ["PADDLE_TRAINER_ENDPOINTS: "] + endpoints


def test_logs_hold_each_ranks_stdout_and_stderr_and_rank0_is_shown(env_job):
    cwd, result, _ = env_job
    for rank in range(2):
        log = (cwd / "log" / f"workerlog.{rank}").read_text()
        assert f"stdout of rank {rank}" in log and f"stderr of rank {rank}" in log
    assert "stdout of rank 0" in result.stdout and "stderr of rank 0" in result.stdout
    assert "of rank 1" not in result.stdout + result.stderr


# -- failures and signals ---------------------------------------------------------------------
def test_a_failing_rank_stops_the_job_and_is_named(tmp_path):
    start = time.monotonic()
    result = run(["--nproc_per_node", "2", SCRIPTS / "launch_fail.py"], tmp_path, timeout=90)
    elapsed = time.monotonic() - start
    assert result.returncode == 1, result.stdout + result.stderr
    assert elapsed < 30  # rank 0 would sleep 60 s
    assert "the trainer process with rank=[1] was aborted" in result.stderr
    assert "rank 1 (local rank 1" in result.stderr and "exited with code 3" in result.stderr
    assert "rank 1 gives up: boom" in result.stderr  # the tail of its log
    assert "stopped the other process(es): rank=[0]" in result.stderr
    assert not list((tmp_path / "log").glob("survived.*"))


def _start_sleepers(tmp_path):
    token = f"fleetx-launch-test-{uuid.uuid4().hex}"
    proc = subprocess.Popen(
        fleetrun_cmd("--nproc_per_node", "2", SCRIPTS / "launch_sleep.py", token, tmp_path),
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    ready = wait_for(lambda: all((tmp_path / f"ready.{r}").exists() for r in range(2)), 90)
    if not ready:
        proc.kill()
        kill_all(job_pids(token))
        pytest.fail("the sleeping job did not start: " + proc.communicate()[1][-2000:])
    return token, proc


def test_no_process_survives_a_sigkilled_fleetrun(tmp_path):
    token, proc = _start_sleepers(tmp_path)
    try:
        # fleetrun, 2 workers, 2 guardians, 2 children of the script
        assert len(job_pids(token)) == 7, job_pids(token)
        proc.kill()
        proc.wait()
        assert wait_for(lambda: not job_pids(token), 5), f"orphans: {job_pids(token)}"
    finally:
        kill_all(job_pids(token))


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_stops_every_process_and_exits_nonzero(tmp_path, sig):
    token, proc = _start_sleepers(tmp_path)
    try:
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 128 + sig, err
        assert f"received {sig.name}, stopped all processes" in err
        assert wait_for(lambda: not job_pids(token), 5), f"orphans: {job_pids(token)}"
    finally:
        proc.kill()
        kill_all(job_pids(token))


# -- refusals -------------------------------------------------------------------------------
def test_bad_flag_value_exits_2_naming_the_flag(tmp_path):
    result = run(["--backend", "mpi", "train.py"], tmp_path, timeout=60)
    assert result.returncode == 2
    assert "argument --backend: invalid choice 'mpi' (choose from auto, gloo, nccl)" in result.stderr


# -- two nodes: network namespaces joined by a veth pair ------------------------------------
two_nodes = netns_nodes.two_nodes  # unique names per test, always removed with what runs there


def test_two_nodes_find_their_rank_from_their_addresses(tmp_path, two_nodes):
    ips = ",".join(addr for _, _, addr in two_nodes)
    procs = []
    for node, (ns, link, _) in enumerate(two_nodes):
        cwd = tmp_path / f"node{node}"
        cwd.mkdir()
        # The host name resolves to a loopback address here: gloo reaches the other node only
        # on the interface fleetrun finds for the node's address.
        cmd = ["ip", "netns", "exec", ns, "env", "-u", "GLOO_SOCKET_IFNAME",
               "-u", "NCCL_SOCKET_IFNAME",
               *fleetrun_cmd("--ips", ips, SCRIPTS / "launch_allreduce.py")]
        procs.append(subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=90)[0])
    finally:
        for proc in procs:
            proc.kill()
    for node, proc in enumerate(procs):
        assert proc.returncode == 0, outputs[node]
    addrs = [addr for _, _, addr in two_nodes]
    endpoints = f"{addrs[0]}:6071,{addrs[1]}:6071"
    for node in range(2):
        log = (tmp_path / f"node{node}" / "log" / f"workerlog.{node}").read_text()
        assert f"RESULT {node} {node} 3.0 {endpoints} {addrs[node]}:6071" in log
    assert "Run collective mode: node 0 of 2" in outputs[0]
    assert "Run collective mode: node 1 of 2" in outputs[1]
    for node, (_, link, addr) in enumerate(two_nodes):
        assert (f"fleetrun: setting GLOO_SOCKET_IFNAME={link} and NCCL_SOCKET_IFNAME={link} for "
                f"each process (the interface of {addr}, this node's address)") in outputs[node]
    assert "RESULT 0 0 3.0" in outputs[0]  # rank 0's output is shown on node 0
