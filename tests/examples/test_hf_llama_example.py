"""examples/hf_llama under the real fleetrun on 2 processes: a Hugging Face LlamaForCausalLM
(byte-level, from a config) with sharding stage 3, recompute by class and amp, exported with
fleet.export_model and loaded back with from_pretrained."""
from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hf_models import transformers  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TRAIN = str(ROOT / "examples/hf_llama/train.py")
TINY = ("--hidden", "32", "--n_layer", "2", "--block_size", "32", "--batch_size", "8",
        "--eval_windows", "16", "--sample_tokens", "40", "--progress_every", "0")


def fleetrun(tmp_path: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "fleetx.launch", "--nproc_per_node", "2",
           "--log_dir", str(tmp_path / "log"), TRAIN, "--out", str(tmp_path / "export"), *args]
    return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=timeout)


def held_out(out: str) -> list[tuple[float, float]]:
    return [(float(a), float(b)) for a, b in
            re.findall(r"held-out loss (\d+\.\d+)  \(unigram (\d+\.\d+)\)", out)]


def test_llama_trains_sharded_recomputed_and_exports(tmp_path):
    tf = transformers()
    res = fleetrun(tmp_path, "--steps", "10", "--eval_every", "5", "--warmup", "3", *TINY)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = res.stdout
    for name in ("amp", "recompute", "sharding"):
        assert re.search(rf"\d\. {name} +applied", out), (name, out[-3000:])
    assert "stage 3" in out and "LlamaDecoderLayer" in out
    evals = held_out(out)
    assert len(evals) == 2
    assert 2.5 < evals[0][1] < 3.5  # the review text's byte entropy, in nats
    # untrained: near-uniform over 256 ids (ln 256 = 5.5); ten updates bring it well under
    assert all(math.isfinite(loss) for loss, _ in evals) and evals[-1][0] < 5.0
    # the export is a from_pretrained folder with the trained weights
    folder = tmp_path / "export"
    assert (folder / "model.safetensors").is_file() and (folder / "config.json").is_file()
    model = tf.LlamaForCausalLM.from_pretrained(folder)
    assert model.config.num_hidden_layers == 2 and model.config.hidden_size == 32
    sample = out.split("temperature 0.8):\n", 1)[1]
    assert sample.startswith("This dress") and len(sample) >= len("This dress") + 10
    log1 = (tmp_path / "log" / "workerlog.1").read_text()
    assert "update 10/10" not in log1 and "sample (" not in log1


@pytest.mark.slow
def test_llama_held_out_loss_falls_below_the_unigram_model(tmp_path):
    """A small default-width model for 80 updates: under the unigram model of the bytes."""
    transformers()
    res = fleetrun(tmp_path, "--steps", "80", "--eval_every", "40", "--n_layer", "2",
                   "--max_ratio", "0.95", "--progress_every", "30", timeout=1500)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    loss, unigram = held_out(res.stdout)[-1]
    assert loss < 0.95 * unigram
