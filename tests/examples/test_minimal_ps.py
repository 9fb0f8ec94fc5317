"""examples/minimal_ps.py under the real fleetrun with 1 server and 2 workers (one epoch)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from fleetx.checkpoint import Checkpoint

ROOT = Path(__file__).resolve().parents[2]


def test_minimal_ps_trains_and_saves_on_one_server_and_two_workers(tmp_path):
    cmd = [sys.executable, "-m", "fleetx.launch", "--server_num", "1", "--worker_num", "2",
           "--log_dir", str(tmp_path / "log"), str(ROOT / "examples/minimal_ps.py"),
           "--epochs", "1", "--save", str(tmp_path / "model")]
    res = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    found = re.search(r"held-out AUC (\d\.\d+) \(async mode, 2 worker\(s\), 1 server\(s\)\)",
                      res.stdout)
    assert found and float(found.group(1)) > 0.85, res.stdout[-2000:]
    saved = Checkpoint(tmp_path / "model")  # committed, every file present
    assert "server-0-of-1/meta.json" in saved and "dense.json" in saved
