"""GEO mode through the fleet API (ps_fleet_train.py on every role).

* With one worker (and one server), GEO is local training: the worker ends equal to one plain
  torch process (1e-5), whatever ``k_steps``.
* Also with ``fleet.prefetch`` (rows of ids not held locally fetched while the batch before
  trains), and every lookup is served by its prefetch.
* 2 servers x 2 workers exchanging deltas every 3 steps converge.
"""
import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from ps_fleet_model import reference, run_job  # noqa: E402

# torch's sparse Adagrad in the single-process reference warns about its own checks
pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks")

GEO = ("--mode", "geo", "--a-sync-configs", json.dumps({"k_steps": 3}))


def test_one_worker_equals_local_training(tmp_path):
    run_job(tmp_path, 1, 1, *GEO, "--steps", "7")
    got, expected = np.load(tmp_path / "worker0.npz"), reference(7)
    for key, value in expected.items():
        np.testing.assert_allclose(got[key], value, rtol=1e-5, atol=1e-5, err_msg=key)


def test_one_worker_with_prefetch_equals_local_training(tmp_path):
    run_job(tmp_path, 1, 1, *GEO, "--steps", "7", "--prefetch")
    got, expected = np.load(tmp_path / "worker0.npz"), reference(7)
    for key, value in expected.items():
        np.testing.assert_allclose(got[key], value, rtol=1e-5, atol=1e-5, err_msg=key)
    assert (int(got["prefetch_hits"]), int(got["prefetch_misses"])) == (7, 0)


def test_two_servers_two_workers_converge(tmp_path):
    run_job(tmp_path, 2, 2, *GEO, "--steps", "80", "--lr", "0.3")
    for rank in range(2):
        got = np.load(tmp_path / f"worker{rank}.npz")
        assert float(got["eval_after"]) < 0.6 * float(got["eval_before"]), \
            (float(got["eval_before"]), float(got["eval_after"]))
