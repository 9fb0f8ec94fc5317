"""Sync mode through the fleet API, on real processes (ps_fleet_train.py on every role).

* 2 servers x 2 workers end equal to one torch process on the union batch (1e-5): the MLP, the
  ``nn.Embedding(sparse=True)`` rows and the ``nn.EmbeddingBag(sparse=True)`` rows, read back
  right after the last ``minimize`` (so a step's update is visible once ``minimize`` returned).
* With ``fleet.prefetch`` (the next batch's rows requested while a batch trains) the result is
  the same at 1e-5: in sync mode a request for the next batch leaves only once the step
  returned, and every lookup was served by a prefetch.
* Evaluation never waits for another worker: not while it sleeps before its first step, and
  not after it stopped early (the remaining worker's sync steps go on without it).
"""
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from ps_fleet_model import reference, run_job  # noqa: E402

# torch's sparse Adagrad in the single-process reference warns about its own checks
pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks")


def test_two_servers_two_workers_equal_one_process_on_the_union_batch(tmp_path):
    run_job(tmp_path, 2, 2, "--mode", "sync", "--steps", "5")
    expected = reference(5)
    for rank in range(2):
        got = np.load(tmp_path / f"worker{rank}.npz")
        for key, value in expected.items():
            np.testing.assert_allclose(got[key], value, rtol=1e-5, atol=1e-5, err_msg=key)
        assert len(got["losses"]) == 5
    assert not np.allclose(expected["emb"], reference(0)["emb"], atol=1e-3)  # it did train


def test_prefetching_the_next_batch_keeps_sync_exact(tmp_path):
    run_job(tmp_path, 2, 2, "--mode", "sync", "--steps", "5", "--prefetch")
    expected = reference(5)
    for rank in range(2):
        got = np.load(tmp_path / f"worker{rank}.npz")
        for key, value in expected.items():
            np.testing.assert_allclose(got[key], value, rtol=1e-5, atol=1e-5, err_msg=key)
        assert (int(got["prefetch_hits"]), int(got["prefetch_misses"])) == (5, 0)


def test_evaluation_never_waits_for_other_workers(tmp_path):
    results = run_job(tmp_path, 1, 2, "--mode", "sync", "--steps", "6", "--sleep-rank1", "4",
                      "--stop-rank1-after", "2")
    first, second = (np.load(tmp_path / f"worker{r}.npz") for r in range(2))
    assert float(first["eval_seconds"]) < 3.0  # rank 1 was asleep for 4 s meanwhile
    assert len(first["losses"]) == 6 and len(second["losses"]) == 2
    assert "eval loss" in results["worker 0"][1]
