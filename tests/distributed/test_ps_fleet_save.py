"""Keeping the result through the fleet API: ``fleet.save_persistables(dirname)`` in one job
(dense weights by the first worker, each server's shards with their optimizer state), then
``fleet.init_server(dirname)`` in a new job with the same number of servers. Training on goes
on exactly as if it had never stopped: 3 + 3 sync steps equal 6 steps of one torch process.
Likewise from a base (mode 1) and deltas (mode 2) with SGD, and from a mode 0 save with
Adagrad, against an uninterrupted job (1e-6), on 2 servers and re-sharded to 3."""
import json
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


def _assert_same(a: Path, b: Path, atol: float) -> None:
    for rank in range(2):
        got, want = np.load(a / f"worker{rank}.npz"), np.load(b / f"worker{rank}.npz")
        for key in ("emb", "tags", "mlp.0.weight", "mlp.0.bias", "mlp.2.weight"):
            np.testing.assert_allclose(got[key], want[key], rtol=0, atol=atol, err_msg=key)


@pytest.mark.parametrize("load_servers", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_resuming_from_a_base_and_deltas_equals_never_stopping(tmp_path, load_servers):
    root = {"FLEETX_PS_SAVE_ROOT": str(tmp_path)}
    sgd = ("--optimizer", "sgd")
    run_job(tmp_path / "straight", 2, 2, *sgd, "--steps", "6", extra_env=root)
    saves = [tmp_path / n for n in ("base", "d1", "d2")]
    run_job(tmp_path / "first", 2, 2, *sgd, "--steps", "4", "--save-at", f"1:1:{saves[0]}",
            "--save-at", f"2:2:{saves[1]}", "--save-at", f"3:2:{saves[2]}", extra_env=root)
    manifests = [json.loads((d / "manifest.json").read_text()) for d in saves]
    assert [m["info"]["mode"] for m in manifests] == [1, 2, 2]
    assert manifests[2]["info"]["prev_save_id"] == manifests[1]["save_id"]
    run_job(tmp_path / "resumed", load_servers, 2, *sgd, "--start", "4", "--steps", "2",
            "--load", ",".join(map(str, saves)), extra_env=root)
    _assert_same(tmp_path / "resumed", tmp_path / "straight", 1e-6)


@pytest.mark.slow  # the first test covers a mode 0 save through the fleet API (against torch)
def test_resuming_from_a_mode0_save_keeps_adagrad_state_exactly(tmp_path):
    root = {"FLEETX_PS_SAVE_ROOT": str(tmp_path)}
    run_job(tmp_path / "straight", 2, 2, "--steps", "5", extra_env=root)
    run_job(tmp_path / "first", 2, 2, "--steps", "3", "--save-at", f"2:0:{tmp_path / 's'}",
            extra_env=root)
    run_job(tmp_path / "resumed", 2, 2, "--start", "3", "--steps", "2", "--load",
            str(tmp_path / "s"), extra_env=root)
    _assert_same(tmp_path / "resumed", tmp_path / "straight", 1e-6)
