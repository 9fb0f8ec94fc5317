"""The data position under fleetrun: with ``--max_restarts 1`` and ``fleet.auto_checkpoint``,
rank 1 of 2 is SIGKILLed mid-epoch (step 11 of 14, epoch 1; checkpoint at step 8), the worker
group restarts, both ranks' ``fleet.distributed_loader`` (2 DataLoader workers) continue epoch 1
from the checkpoint's sample, and the job ends with parameters bit-identical to an
uninterrupted run (``tests/scripts/loader_resume.py``)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_fleetrun import run  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "loader_resume.py"


def train(folder: Path, *args) -> tuple[list, str]:
    folder.mkdir()
    res = run(["--nproc_per_node", "2", "--max_restarts", "1", SCRIPT, "--ckpt", "ckpt",
               "--out", "final.pt", *args], folder, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    return [torch.load(folder / f"final.pt.{r}") for r in range(2)], res.stderr


@pytest.mark.slow
def test_a_rank_killed_mid_epoch_resumes_its_loaders_to_bit_identical_parameters(tmp_path):
    reference, err = train(tmp_path / "ref")
    assert "restart 1 of 1" not in err, err
    resumed, err = train(tmp_path / "kill", "--kill-at", 11)
    assert "restart 1 of 1: rank 1" in err and "was killed by signal SIGKILL" in err, err
    log = (tmp_path / "kill" / "log" / "workerlog.0").read_text()
    assert "rank 0 restart 1 starts at step 8 epoch 1" in log, log
    for rank in range(2):
        # the restarted group's batches are the uninterrupted run's from step 8 on
        assert resumed[rank]["seen"] == reference[rank]["seen"][8:], rank
        for name, value in resumed[rank]["params"].items():
            assert torch.equal(value, reference[rank]["params"][name]), (rank, name)
