"""Keeping the result through the fleet API: ``fleet.save_persistables(dirname)`` in one job
(dense weights by the first worker, each server's shards with their optimizer state), then
``fleet.init_server(dirname)`` in a new job with the same number of servers. Training on goes
on exactly as if it had never stopped: 3 + 3 sync steps equal 6 steps of one torch process."""
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from ps_fleet_model import reference, run_job  # noqa: E402

# torch's sparse Adagrad in the single-process reference warns about its own checks
pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks")


def test_save_then_init_server_from_it_continues_training(tmp_path):
    saved = tmp_path / "model"
    root = {"FLEETX_PS_SAVE_ROOT": str(tmp_path)}  # the jobs run in the repository folder
    run_job(tmp_path / "first", 2, 2, "--steps", "3", "--save", str(saved), extra_env=root)
    folder, = saved.glob("save-*")
    assert sorted(p.name for p in folder.iterdir()) == [
        "dense-dense.0.npy", "dense.json", "server-0-of-2", "server-1-of-2"]
    run_job(tmp_path / "second", 2, 2, "--start", "3", "--steps", "3", "--load", str(saved),
            extra_env=root)
    expected = reference(6)
    for rank in range(2):
        got = np.load(tmp_path / "second" / f"worker{rank}.npz")
        for key, value in expected.items():
            np.testing.assert_allclose(got[key], value, rtol=1e-5, atol=1e-5, err_msg=key)
