"""Table growth through the fleet API: a scripted id stream in a real ``fleetrun`` job (2
servers, 2 sync workers) and in one process taking both workers' ids of a step in one batch,
with ``fleet.shrink()`` after each pass. Rows created, updates dropped for ids not yet
admitted, rows evicted, ids pending and forgotten are exactly those of an independent model of
the rules, pass after pass, and the same for both (an id both workers saw in a step counts once,
as in the one batch)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "scripts" / "ps_growth_train.py"
sys.path.insert(0, str(SCRIPT.parent))
sys.path.insert(0, str(ROOT / "tests" / "launch"))
from ps_growth_train import STREAM  # noqa: E402  (the stream; importing runs nothing)
from test_fleetrun import fleetrun_cmd  # noqa: E402


def expected(stream, count=2, limit=1):
    """The counts after each pass, the same for 2 sync workers and for 1 worker taking both
    workers' ids of a step in one batch (the data-parallel contract): each step counts each id
    without a row once, however many workers saw it; an id seen ``count`` times gets its row
    at the update of the same step (a sync round merges the workers' updates); updates of
    other ids without a row are dropped; at a shrink, rows not updated for more than ``limit``
    passes go, and pending ids not seen in the pass are forgotten."""
    rows, pending, totals, out = {}, {}, dict(created=0, removed=0, forgotten=0, dropped=0), []
    for p, steps in enumerate(stream):
        for step in steps:
            batch = {i for w in step for i in w}
            for i in batch - set(rows):
                seen = pending.setdefault(i, [0, p])
                seen[0], seen[1] = min(seen[0] + 1, count), p
            for i in sorted(batch):
                if i not in rows and pending.get(i, [0])[0] < count:
                    totals["dropped"] += 1
                    continue
                if i not in rows:
                    del pending[i]
                    totals["created"] += 1
                rows[i] = p
        for i, last in list(rows.items()):
            if p - last > limit:
                del rows[i]
                totals["removed"] += 1
        for i, (_, last) in list(pending.items()):
            if last < p:
                del pending[i]
                totals["forgotten"] += 1
        out.append(dict(totals, rows=len(rows), pending=len(pending), ids=sorted(rows)))
    return out


def check(record):
    want = expected(STREAM)
    forgotten = 0
    for p, (got, exp) in enumerate(zip(record["passes"], want)):
        table = got["report"]["tables"]["emb"]
        forgotten += got["shrink"]["emb"]["forgotten"]
        assert (table["rows"], table["created"], table["removed"], table["pending"],
                table["dropped_updates"], forgotten) == \
            (exp["rows"], exp["created"], exp["removed"], exp["pending"], exp["dropped"],
             exp["forgotten"]), f"pass {p}: {table} != {exp}"
        assert got["shrink"]["emb"]["rows"] == exp["rows"] and table["passes"] == p + 1
    assert record["eval"] == 0.0  # ids never trained read zeros ...
    assert record["final"]["tables"]["emb"]["pending"] == want[-1]["pending"]  # ... uncounted
    return want


def test_a_two_server_fleetrun_job_grows_and_shrinks_exactly(tmp_path):
    res = subprocess.run(fleetrun_cmd("--server_num", "2", "--worker_num", "2", SCRIPT,
                                      "--out", tmp_path), cwd=tmp_path, capture_output=True,
                         text=True, timeout=240,
                         env=dict(os.environ, PYTHONPATH=str(ROOT), FLEETX_TIMEOUT="60"))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    record = json.loads((tmp_path / "growth.json").read_text())
    want = check(record)
    assert [s["server"] for s in record["final"]["tables"]["emb"]["servers"]] == [0, 1]
    assert want[-1]["ids"] == [1, 4, 7]  # the hand-made stream's end state
    assert "emb" in res.stdout and "pending" in res.stdout  # worker 0 printed the report


def test_one_process_grows_and_shrinks_exactly(tmp_path):
    res = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    check(json.loads((tmp_path / "growth.json").read_text()))
