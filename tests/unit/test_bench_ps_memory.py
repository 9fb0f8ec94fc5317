"""benchmarks/ps_memory.py at a tiny size: one fresh process per rule, every figure reported,
and the table's bytes within 1.25x of the raw row and optimizer state for every rule (the
index costs at most 8 bytes of key and 6.7 bytes of slots per row)."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bytes_per_row_for_each_rule_in_fresh_processes():
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ps_memory.py"), "--rows",
                          "50000", "--dim", "16"], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert res.returncode == 0, res.stderr
    lines = [json.loads(line) for line in res.stdout.splitlines()]
    assert [r["rule"] for r in lines] == ["sgd", "adagrad", "adam"]
    assert [r["raw_bytes_per_row"] for r in lines] == [64, 128, 196]
    for r in lines:
        assert r["rows"] == 50000 and r["parts_per_row"]["values"] == r["raw_bytes_per_row"]
        assert 8 < r["parts_per_row"]["index"] <= 8 + 4 / 0.6 + 0.01, r
        assert r["nbytes_ratio"] <= 1.25, r
        assert r["rss_per_row"] > 0 and r["peak_rss_per_row"] >= r["rss_trimmed_per_row"] > 0
