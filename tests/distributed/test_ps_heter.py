"""Heter workers as real processes (slow stage).

* Through the real ``fleetrun --server_num 1 --worker_num 2 --heter_worker_num 1``: the
  lock-step (sync) job equals the same job without heter workers and one plain torch process
  (1e-5, losses and weights; ``tests/scripts/ps_heter_train.py``).
* Liveness, with the environment fleetrun would give each process but without fleetrun (which
  would stop the others as soon as one dies): a heter worker killed (SIGKILL) or frozen
  (SIGSTOP) mid-training is named by the trainers' errors, and a trainer killed or frozen is
  named by the heter worker, within ``FLEETX_PS_DEAD_AFTER`` (plus slack for a loaded machine).
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "launch"))
from ps_fleet_model import reference  # noqa: E402
from test_fleetrun import fleetrun_cmd  # noqa: E402

from fleetx.launch import ps  # noqa: E402
from fleetx.launch.config import LaunchConfig  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "scripts" / "ps_heter_train.py"
DEAD_AFTER = 3.0
SLACK = 12.0  # a loaded 2-core machine: process start-up, scheduling


def fleetrun(cwd: Path, *args: str) -> None:
    res = subprocess.run(fleetrun_cmd(*args), cwd=cwd, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


@pytest.mark.slow
def test_lock_step_heter_job_equals_the_job_without_heter_workers(tmp_path):
    runs = {}
    for name, heter in (("heter", ["--heter_worker_num", "1"]), ("plain", [])):
        out = tmp_path / name
        out.mkdir()
        fleetrun(out, "--server_num", "1", "--worker_num", "2", *heter, SCRIPT, "--out", out,
                 "--steps", "6")
        runs[name] = [np.load(out / f"worker{r}.npz") for r in range(2)]
    assert "every trainer stopped (6 pushes); done" in (
        tmp_path / "heter" / "log" / "heterlog.0").read_text()
    expected = reference(6)
    for heter, plain in zip(runs["heter"], runs["plain"]):
        np.testing.assert_allclose(heter["losses"], plain["losses"], rtol=1e-5, atol=1e-6)
        for key, value in expected.items():
            np.testing.assert_allclose(heter[key], plain[key], rtol=1e-5, atol=1e-6, err_msg=key)
            np.testing.assert_allclose(heter[key], value, rtol=1e-5, atol=1e-5, err_msg=key)


class Job:
    """Every process of a 1 server x 2 trainers x 1 heter worker job, started as fleetrun would
    start them, each writing its output to ``<dir>/<label>.out``."""

    def __init__(self, tmp_path: Path, mode: str) -> None:
        cfg = LaunchConfig(training_script=str(SCRIPT), server_num=1, worker_num=2,
                           heter_worker_num=1, log_dir=str(tmp_path / "log"))
        self.plan = ps.plan(cfg, user_omp="1")
        self.dir, self.procs = tmp_path, {}
        base = dict(os.environ, PYTHONPATH=str(ROOT), FLEETX_PS_SECRET="heter-test",
                    FLEETX_PS_DEAD_AFTER=str(DEAD_AFTER), FLEETX_PS_HEARTBEAT_INTERVAL="0.5",
                    FLEETX_TIMEOUT="60", FLEETX_LOG_INTERVAL="0.5")
        for proc in self.plan.local:
            out = open(tmp_path / f"{proc.label}.out", "w")
            self.procs[proc.label] = subprocess.Popen(
                [sys.executable, "-u", str(SCRIPT), "--out", str(tmp_path), "--mode", mode,
                 "--steps", "1000000"], env={**base, **proc.env}, stdout=out,
                stderr=subprocess.STDOUT, cwd=tmp_path)

    def output(self, label: str) -> str:
        return (self.dir / f"{label}.out").read_text()

    def wait_training(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while "fleetx ps worker 0: step" not in self.output("worker 0"):
            assert time.monotonic() < deadline, self.output("worker 0")[-2000:]
            assert all(p.poll() is None for p in self.procs.values()), {
                k: self.output(k)[-1500:] for k in self.procs}
            time.sleep(0.2)

    def ends(self, label: str, timeout: float) -> float:
        """Seconds until ``label`` exits (it must, within ``timeout``, and not with 0)."""
        began = time.monotonic()
        code = self.procs[label].wait(timeout)
        assert code != 0, self.output(label)[-2000:]
        return time.monotonic() - began

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
            p.wait()


@pytest.fixture
def job(tmp_path):
    made = []

    def start(mode: str = "sync") -> Job:
        made.append(Job(tmp_path, mode))
        made[-1].wait_training()
        return made[-1]
    yield start
    for j in made:
        j.stop()


@pytest.mark.slow
@pytest.mark.parametrize("sig, mode", [(signal.SIGKILL, "sync"), (signal.SIGSTOP, "async")],
                         ids=["killed-sync", "frozen-async"])
def test_a_lost_heter_worker_is_named_by_its_trainers(job, sig, mode):
    j = job(mode)
    heter = j.procs["heter worker 0"]
    os.kill(heter.pid, sig)
    for label in ("worker 0", "worker 1"):
        assert j.ends(label, DEAD_AFTER + SLACK) < DEAD_AFTER + SLACK
        text = j.output(label)
        # named by the trainer's own link to it, or (sync: the round fails first) by a server
        # that lost it: either way the heter worker, as its endpoint or its rank and pid
        own = f"PeerLostError: heter worker 0 ({j.plan.heters[0]}) lost"
        via_server = re.search(r"PeerLostError: heter worker 0, rank 2 \(pid \d+ on [^)]+\) "
                               r"lost: .*\(reported by server 0", text)
        assert own in text or via_server, text[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
def test_a_lost_trainer_is_named_by_the_heter_worker(job, sig):
    j = job("sync")
    trainer = j.procs["worker 1"]
    os.kill(trainer.pid, sig)
    assert j.ends("heter worker 0", DEAD_AFTER + SLACK) < DEAD_AFTER + SLACK
    text = j.output("heter worker 0")
    assert f"PeerLostError: trainer 1 (pid {trainer.pid} on " in text, text[-2000:]
    # the other trainer, waiting in the lock-step, stops too, naming the lost trainer or (a race:
    # the heter worker stops once it named trainer 1, and its link may close before its answer
    # to trainer 0 is read) the heter worker that stopped because of it
    j.ends("worker 0", DEAD_AFTER + SLACK)
    out = j.output("worker 0")
    assert "trainer 1 (pid" in out or "worker 1 (pid" in out \
        or "PeerLostError: heter worker 0 (" in out, out[-2000:]
