"""Async mode through the fleet API on 2 servers x 2 workers (ps_fleet_train.py on every role).

The communicator's knobs from ``a_sync_configs`` are honoured: with ``max_merge_var_num=4`` and
a long ``send_wait_times`` the queued steps of a worker travel merged, in far fewer pushes than
steps; with a bounded ``send_queue_size`` and two pushes in flight the job still converges. With
``fleet.prefetch`` (rows read one step early) it converges too, every lookup served by its
prefetch.
"""
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from ps_fleet_model import run_job  # noqa: E402

KNOBS = {"send_queue_size": 4, "max_merge_var_num": 4, "thread_pool_size": 2,
         "send_wait_times": 200}


def test_async_converges_and_merges_queued_steps(tmp_path):
    run_job(tmp_path, 2, 2, "--mode", "async", "--steps", "160", "--lr", "0.1",
            "--a-sync-configs", json.dumps(KNOBS))
    for rank in range(2):
        got = np.load(tmp_path / f"worker{rank}.npz")
        assert len(got["losses"]) == 160
        assert float(got["eval_after"]) < 0.2 * float(got["eval_before"]), \
            (float(got["eval_before"]), float(got["eval_after"]))
        assert 1 <= int(got["pushes"]) <= 80  # 160 steps, up to 4 per push


def test_async_with_prefetch_converges(tmp_path):
    run_job(tmp_path, 1, 2, "--mode", "async", "--steps", "100", "--lr", "0.1", "--prefetch")
    for rank in range(2):
        got = np.load(tmp_path / f"worker{rank}.npz")
        assert float(got["eval_after"]) < 0.2 * float(got["eval_before"]), \
            (float(got["eval_before"]), float(got["eval_after"]))
        assert (int(got["prefetch_hits"]), int(got["prefetch_misses"])) == (100, 0)


def test_fleet_observe_logs_the_workers_ps_latency_and_traffic(tmp_path):
    """fleet.observe's scalars of a parameter-server worker: its PULL/PUSH latency quantiles
    and the bytes it sent to and received from the servers (whole frames, growing with the
    steps), one CSV row a step."""
    import csv
    run_job(tmp_path, 1, 2, "--mode", "async", "--steps", "12", "--lr", "0.1",
            "--observe", str(tmp_path / "scalars"))
    for rank in range(2):
        with open(tmp_path / "scalars" / f"scalars.{rank}.csv") as f:
            rows = list(csv.DictReader(f))
        assert len(rows) == 12, rows
        for name in ("ps_pull_p50_ms", "ps_pull_p99_ms", "ps_push_p50_ms", "ps_push_p99_ms"):
            assert float(rows[-1][name]) > 0, (name, rows[-1])
        sent = [float(r["ps_sent_mb"]) for r in rows]
        received = [float(r["ps_received_mb"]) for r in rows]
        assert sent == sorted(sent) and received == sorted(received)
        # every step pulls its rows and the dense weights back: more than 12 frame headers
        assert received[-1] > received[0] > 0 and sent[-1] > sent[0] > 0
