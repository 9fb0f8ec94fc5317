"""Distributed inference through the fleet API, 2 servers x 2 workers, in each mode: a job
trains, turns to inference in the same job (``DistributedInfer.init_distributed_infer_env()``),
saves and scores its held-out shards; an inference-only job started from that save scores the
same shards. The two agree exactly (every prediction and the merged AUC), scoring creates no
row (held-out batches hold ids never trained), and every write is refused naming the mode: by
the servers of the training job for a worker that turned to inference, by the read-only
servers of the inference-only job, and by the optimizer on the worker.

``tests/scripts/ps_infer.py`` is the script every role runs."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from ps_fleet_model import run_job  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "ps_infer.py"
WRITES = ("push", "pull_create", "init")


@pytest.mark.slow
@pytest.mark.parametrize("mode, bare", [("sync", False), ("async", False), ("geo", False),
                                        ("sync", True)])
def test_standalone_inference_from_the_save_equals_inference_after_training(tmp_path, mode,
                                                                            bare):
    """``bare``: the inference-only script builds no optimizer (DistributedInfer does)."""
    root = {"FLEETX_PS_SAVE_ROOT": str(tmp_path)}
    run_job(tmp_path / "train", 2, 2, "--mode", mode, "--save", str(tmp_path / "ckpt"),
            extra_env=root, script=SCRIPT)
    run_job(tmp_path / "infer", 2, 2, "--mode", mode, "--infer-from", str(tmp_path / "ckpt"),
            *(["--bare"] if bare else []), extra_env=root, script=SCRIPT)
    trained = [np.load(tmp_path / "train" / f"worker{r}.npz") for r in range(2)]
    alone = [np.load(tmp_path / "infer" / f"worker{r}.npz") for r in range(2)]
    aucs = {float(w["auc"]) for w in trained + alone}
    assert len(aucs) == 1 and 0.0 < aucs.pop() < 1.0  # one merged AUC, the same everywhere
    for a, b in zip(trained, alone):
        np.testing.assert_array_equal(a["preds"], b["preds"])  # this worker's shard, exactly
        for w in (a, b):  # scoring (eval and train-mode forwards) created no row
            assert json.loads(str(w["rows_before"])) == json.loads(str(w["rows_after"]))
        refused_in_job, refused_alone = (json.loads(str(w["refusals"])) for w in (a, b))
        for what in WRITES:
            assert "turned to inference" in refused_in_job[what], refused_in_job
            assert "serves an inference-only job" in refused_alone[what], refused_alone
        for r in (refused_in_job, refused_alone):
            assert r["step"].startswith("StateError: optimizer step in inference mode")
    assert json.loads(str(trained[0]["rows_after"])) == json.loads(str(alone[0]["rows_after"]))
