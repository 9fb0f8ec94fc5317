"""Parameter-server failover through the real ``fleetrun`` with a real SIGKILL (slow: each job
imports torch in four processes and trains for tens of seconds).

``--max_restarts 1``: server 0 of 2 is killed mid-training; fleetrun restarts it, it loads its
latest snapshot, both workers reconnect and train on, the job exits 0; a killed worker is
restarted and rejoins. Without ``--max_restarts`` either kill stops the job, naming the
process.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_fleetrun import fleetrun_cmd, job_pids, kill_all, wait_for  # noqa: E402

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "ps_failover_train.py"
QUEUE = 16  # the async worker's send_queue_size: steps it can take with a server away


class Job:
    def __init__(self, tmp_path: Path, *flags: str, mode: str = "async") -> None:
        self.token = f"fleetx-failover-{uuid.uuid4().hex}"
        self.out, self.log = tmp_path / "out", tmp_path / "log"
        self.out.mkdir()
        self.stdout, self.stderr = tmp_path / "stdout", tmp_path / "stderr"
        self.proc = subprocess.Popen(
            fleetrun_cmd("--server_num", "2", "--worker_num", "2", "--log_dir", self.log, *flags,
                         SCRIPT, "--out", self.out, "--max-seconds", "240", "--tag", self.token,
                         "--mode", mode),
            cwd=tmp_path, stdout=self.stdout.open("w"), stderr=self.stderr.open("w"))

    def pid(self, role: str, index: int) -> int:
        m = re.search(rf"launch {role} proc_id:(\d+) idx:{index}\b", self.stdout.read_text())
        return int(m[1])

    def steps(self, rank: int) -> list[tuple[int, float]]:
        path = self.out / f"progress{rank}"
        lines = path.read_text().splitlines() if path.exists() else []
        return [(int(a), float(b)) for a, b, *_ in (l.split() for l in lines if l.count(" ") == 2)]

    def losses(self, rank: int) -> list[str]:
        path = self.out / f"progress{rank}"
        lines = path.read_text().splitlines() if path.exists() else []
        return [l.split()[2] for l in lines if l.count(" ") == 2]

    def log_text(self, name: str) -> str:
        path = self.log / name
        return path.read_text(errors="replace") if path.exists() else ""

    def training(self, steps: int = 50, snapshot: bool = True) -> None:
        """Both workers took ``steps`` steps (and server 0 wrote a snapshot after that)."""
        assert wait_for(lambda: all(len(self.steps(r)) >= steps for r in (0, 1)), 180), \
            self.stderr.read_text()[-3000:]
        if not snapshot:
            return
        count = self.log_text("serverlog.0").count("snapshot ")
        assert wait_for(lambda: self.log_text("serverlog.0").count("snapshot ") > count, 30)

    def finish(self, timeout: float = 90) -> int:
        (self.out / "stop").touch()
        try:
            return self.proc.wait(timeout)
        finally:
            assert wait_for(lambda: not job_pids(self.token), 10), job_pids(self.token)

    def close(self) -> None:
        self.proc.kill()
        kill_all(job_pids(self.token))


@pytest.fixture
def job(tmp_path):
    jobs = []
    yield lambda *flags, **kw: jobs.append(Job(tmp_path, *flags, **kw)) or jobs[-1]
    for j in jobs:
        j.close()


@pytest.mark.parametrize("mode", ["async", "sync", "geo"])
def test_a_killed_server_is_restarted_from_its_snapshot_and_training_goes_on(job, mode):
    j = job("--max_restarts", "1", "--checkpoint_interval", "1s", mode=mode)
    j.training()
    os.kill(j.pid("server", 0), signal.SIGKILL)
    killed = time.time()
    for rank in (0, 1):
        assert wait_for(lambda: "is back after" in j.log_text(f"workerlog.{rank}"), 60), \
            j.log_text(f"workerlog.{rank}")[-3000:]
    # training again within 30 s of the kill: more steps than the send queue holds, so the
    # restarted server answered pushes (every push carries part of the dense table to it)
    assert wait_for(lambda: min(sum(killed < t <= killed + 30 for _, t in j.steps(r))
                                for r in (0, 1)) > QUEUE + 20, 35), \
        [len([t for _, t in j.steps(r) if t > killed]) for r in (0, 1)]
    code = j.finish()
    err, server0 = j.stderr.read_text(), j.log_text("serverlog.0")
    assert code == 0, err[-3000:]
    assert re.search(r"server 0 \(127\.0\.0\.1:\d+\) was killed by signal SIGKILL; restarting "
                     r"it \(restart 1 of 1\)", err), err
    assert "restarted (restart 1): loaded snapshot" in server0
    assert "listening on" in server0.split("restarted (restart 1)")[0]  # the log continued
    for rank in (0, 1):
        text = j.log_text(f"workerlog.{rank}")
        back = re.search(r"is back after ([\d.]+) s \(restart 1\) with its snapshot \S+ "
                         r"\(written [^)]+\): (\d+) push\(es\) of this worker it had applied "
                         r"after that are lost", text)
        assert back and float(back[1]) < 30, text[-3000:]
        print(f"{mode}: server 0 killed; worker {rank} says it was back after {back[1]} s")
    # the secret a single-node job gets stays in the environment, the same after the restart
    assert "FLEETX_PS_SECRET" not in j.stdout.read_text()


def test_without_max_restarts_a_killed_server_stops_the_job_naming_it(job):
    j = job()
    j.training(steps=20, snapshot=False)
    os.kill(j.pid("server", 0), signal.SIGKILL)
    killed = time.monotonic()
    code = j.proc.wait(60)
    assert time.monotonic() - killed < 15
    err = j.stderr.read_text()
    assert code == 1, err
    assert "server 0 failed" in err and "killed by signal SIGKILL" in err, err


@pytest.mark.parametrize("mode", ["async", "sync", "geo"])
def test_a_killed_worker_is_restarted_and_rejoins_with_the_trained_tables(job, mode):
    """Worker 0 (the one whose INIT assigned the initial values) is killed: fleetrun restarts
    it, the unchanged script's init_worker rejoins, its INIT changes nothing, and its first
    loss is that of the trained model; worker 1 trains on throughout (sync: its rounds wait for
    the restarted worker, then go on); the job exits 0."""
    j = job("--max_restarts", "1", "--checkpoint_interval", "1s", mode=mode)
    j.training(steps=50, snapshot=False)
    first_loss = float(j.losses(0)[0])
    os.kill(j.pid("worker", 0), signal.SIGKILL)
    killed = time.time()
    before = len(j.steps(0))
    # the restarted worker appends to the same progress file, counting from step 1 again
    assert wait_for(lambda: len(j.steps(0)) > before + 20, 60), \
        j.stderr.read_text()[-3000:] + j.log_text("workerlog.0")[-3000:]
    again = j.steps(0)[before:]
    assert again[0][0] == 1
    back_after = again[0][1] - killed
    print(f"worker 0 killed: training again after {back_after:.1f} s")
    assert back_after < 45
    if mode == "sync":  # worker 1's rounds waited (its step in flight at most), then go on
        assert sum(killed < t < again[0][1] for _, t in j.steps(1)) <= 1, j.steps(1)[-20:]
        assert wait_for(lambda: sum(t > again[0][1] for _, t in j.steps(1)) > 20, 60)
    else:  # worker 1 never stopped: it took steps while worker 0 was away
        assert any(killed < t < again[0][1] for _, t in j.steps(1))
    # the restarted worker starts from the servers' trained values, not the initial ones:
    # the same batch (step 1's) costs much less than at the job's start
    assert float(j.losses(0)[before]) < 0.8 * first_loss, (first_loss, j.losses(0)[before])
    code = j.finish()
    err, log0 = j.stderr.read_text(), j.log_text("workerlog.0")
    assert code == 0, err[-3000:]
    assert re.search(r"worker 0 \(127\.0\.0\.1:\d+\) was killed by signal SIGKILL; restarting "
                     r"it \(restart 1 of 1\): it runs the script from the top and rejoins", err), err
    assert "worker 0: rejoined the job under way (restart 1)" in log0, log0[-3000:]
    for s in (0, 1):
        assert re.search(r"worker 0 \(pid \d+ on \S+\) rejoined after [\d.]+ s away",
                         j.log_text(f"serverlog.{s}")), j.log_text(f"serverlog.{s}")[-3000:]
    # the single-node job's secret is in the environment, the same for the restarted worker
    # (it authenticated), and never printed
    assert "FLEETX_PS_SECRET" not in j.stdout.read_text()


def test_without_max_restarts_a_killed_worker_stops_the_job_naming_it(job):
    j = job()
    j.training(steps=20, snapshot=False)
    os.kill(j.pid("worker", 1), signal.SIGKILL)
    code = j.proc.wait(60)
    err = j.stderr.read_text()
    assert code == 1, err
    assert "worker 1 failed" in err and "killed by signal SIGKILL" in err, err
