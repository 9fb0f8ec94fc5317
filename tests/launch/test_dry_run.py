"""fleetrun --dry-run: the script runs as rank 0 of the requested world, prints the plan and
stops before any communication."""
from __future__ import annotations

import os
import pty
import subprocess
import sys
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "dry_run_plan.py"


def fleetrun(tmp_path, *args):
    return subprocess.run([sys.executable, "-m", "fleetx.launch", "--dry-run", *args],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)


def test_prints_the_plan_of_the_requested_world_and_exits_zero(tmp_path):
    # The two nodes do not exist: a dry run needs no peers and plans as the first node.
    res = fleetrun(tmp_path, "--nproc_per_node", "4", "--ips", "10.9.9.1,10.9.9.2", str(SCRIPT))
    assert res.returncode == 0, res.stderr
    assert "fleetx plan: mode=collective world_size=8 nnodes=2" in res.stdout
    assert "DistributedDataParallel over 8 processes, bucket 16 MB" in res.stdout
    assert "TRAINING STARTED" not in res.stdout
    assert not (tmp_path / "log").exists() or not list((tmp_path / "log").glob("workerlog.*"))


def test_communication_before_the_plan_is_a_clear_error(tmp_path):
    res = fleetrun(tmp_path, "--nproc_per_node", "2", str(SCRIPT), "--communicate-first")
    assert res.returncode != 0
    assert "dry run: the script communicates" in res.stderr


def test_a_plain_torch_distributed_script_ends_at_its_init(tmp_path):
    """No store is served, so init_process_group fails at once instead of waiting as rank 0 for a
    peer that never starts; the user's own MASTER_ADDR/MASTER_PORT (a store nobody serves here)
    do not count either."""
    plain = SCRIPT.with_name("launch_allreduce.py")  # dist.init_process_group("gloo"), all_reduce
    environ = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT="9")
    start = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "fleetx.launch", "--dry-run", "--nproc_per_node",
                          "2", str(plain)], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120, env=environ)
    assert time.monotonic() - start < 60
    assert res.returncode == 1, res.stdout + res.stderr
    assert ("MASTER_ADDR and MASTER_PORT are unset, so a script that calls "
            "torch.distributed.init_process_group itself stops there with an error") in res.stdout
    assert "environment variable MASTER_ADDR expected, but not set" in res.stderr
    assert "RESULT" not in res.stdout



def test_the_script_becomes_fleetrun_on_its_terminal(tmp_path):
    """The script replaces fleetrun in its process (nothing to orphan): same pid, fleetrun's exit
    code is the script's, and FLEETX_TTY says fleetrun's stdout is a terminal."""
    script = tmp_path / "who.py"
    script.write_text("import os, sys\n"
                      "print('PID', os.getpid(), os.environ['FLEETX_TTY'], "
                      "os.environ['FLEETX_DRY_RUN'], sys.stdout.isatty())\n"
                      "sys.exit(3)\n")
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "fleetx.launch", "--dry-run", str(script)],
                            cwd=tmp_path, stdout=slave, stderr=subprocess.PIPE)
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # EIO: every writer of the terminal is gone
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    assert proc.wait(timeout=120) == 3, proc.stderr.read()
    assert f"PID {proc.pid} 1 1 True" in out.decode(), out
