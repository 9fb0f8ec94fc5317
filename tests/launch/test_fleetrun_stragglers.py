"""Stragglers named, for real, under fleetrun (3 ranks, one job): a rank that sleeps 60 ms more
than the others every step for 40 steps, then another frozen again and again by the test
(SIGSTOP for 0.1 s, SIGCONT for 0.02 s) for the last 40. Rank 0's log names each with a ratio
of at least 1.5, never the fast rank;
the end-of-job table has a step-time row per rank."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_fleetrun import fleetrun_cmd  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "straggler_train.py"
NAMED = re.compile(r"fleetx: rank (\d) is a straggler: busy ([0-9.e-]+) s per step, "
                   r"([0-9.]+)x the median of the others \(([0-9.e-]+) s; "
                   r"window steps (\d+)-(\d+)\)")


def _freeze_until_done(log_dir: Path, job: subprocess.Popen, deadline: float) -> int:
    """SIGSTOP / SIGCONT the pid in frozen.pid until it exits; the number of freezes."""
    pid_file = log_dir / "frozen.pid"
    while not pid_file.exists():
        assert job.poll() is None and time.monotonic() < deadline, "the job never reached HALF"
        time.sleep(0.05)
    pid, freezes = int(pid_file.read_text()), 0
    while time.monotonic() < deadline:
        try:
            os.kill(pid, signal.SIGSTOP)
        except ProcessLookupError:
            break
        try:
            time.sleep(0.1)
        finally:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                break
        freezes += 1
        time.sleep(0.02)
    return freezes


@pytest.mark.slow  # ~32 s: a real fleetrun job of 3 ranks and 80 steps
def test_a_slow_rank_and_a_frozen_rank_are_named_with_their_ratio(tmp_path):
    log_dir = tmp_path / "log"
    env = dict(os.environ, STRAGGLER_SLOW_RANK="2", STRAGGLER_FROZEN_RANK="1",
               FLEETX_STRAGGLER_WINDOW="10", FLEETX_TIMEOUT="60")
    job = subprocess.Popen(fleetrun_cmd("--nproc_per_node", "3", "--log_dir", log_dir, SCRIPT),
                           cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        freezes = _freeze_until_done(log_dir, job, time.monotonic() + 120)
        _, stderr = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, stderr[-3000:]
    assert freezes >= 10
    named = [NAMED.search(line) for line in (log_dir / "workerlog.0").read_text().splitlines()]
    named = [(int(m[1]), float(m[3]), int(m[6])) for m in named if m]
    ranks = {r for r, _, _ in named}
    assert ranks >= {1, 2} and 0 not in ranks, named
    assert all(ratio >= 1.5 for _, ratio, _ in named)
    # the slow rank in the windows of the first half, the frozen one only in the second
    assert any(r == 2 and end <= 40 for r, _, end in named), named
    assert all(end > 40 for r, _, end in named if r == 1), named
    for other in (1, 2):  # only rank 0 names them
        assert "is a straggler" not in (log_dir / f"workerlog.{other}").read_text()
    table = stderr[stderr.index("fleetrun: job summary"):].splitlines()
    assert table[1].split()[-6:] == ["step", "p50", "step", "p99", "busy", "p50"]
    rows = {int(line.split()[1]): line.split() for line in table[2:5]}
    assert sorted(rows) == [0, 1, 2]
    for cells in rows.values():
        assert "-" not in cells[-6:] and cells[-1] in ("ms", "s"), cells  # three times each
