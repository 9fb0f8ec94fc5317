"""benchmarks/model_parallel.py at a tiny size: data parallel, mp 2 and pp 2 of the example GPT
on 2 processes report their state bytes, activations and speed, and the state bytes are the
split the layouts promise: mp 2 holds the replicated part and half of the split blocks on each
rank, the two pipeline stages together hold the whole model plus the head's copy of the
embeddings."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples" / "gpt"))
from model import GPT, GPTConfig  # noqa: E402

EMBD, LAYERS, BLOCK, VOCAB = 32, 2, 16, 99
# the plain GPT's parameters that tensor parallelism splits in two (the row-parallel biases of
# attn.proj and mlp.2 stay whole on every rank)
SPLIT = ("attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight", "mlp.0.weight", "mlp.0.bias",
         "mlp.2.weight")


def test_model_parallel_benchmark_reports_the_split_state(tmp_path):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "model_parallel.py"), "--rounds", "1",
           "--steps", "1", "--warmup", "1", "--n_embd", str(EMBD), "--n_layer", str(LAYERS),
           "--block_size", str(BLOCK), "--batch", "8", "--micro", "2",
           "--out", str(tmp_path / "out.json")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])["results"]
    memory, speed = out["memory"], out["speed"]

    plain = GPT(GPTConfig(VOCAB, BLOCK, LAYERS, 4, EMBD))
    named = dict(plain.named_parameters())  # the tied head listed once, as state_bytes counts
    total = 4 * sum(p.numel() for p in named.values())
    split = 4 * sum(p.numel() for n, p in named.items() if n.endswith(SPLIT))
    assert [r["state"]["parameters"] for r in memory["data_parallel"]] == [total, total]
    assert [r["state"]["parameters"] for r in memory["mp2"]] == [total - split // 2] * 2
    head_copy = 4 * (VOCAB + BLOCK) * EMBD  # the last stage's PipeEmbedding
    assert sum(r["state"]["parameters"] for r in memory["pp2"]) == total + head_copy
    for case in ("data_parallel", "mp2", "pp2"):
        for r in memory[case]:
            assert r["activations"] > 0
            assert r["peak"] == sum(r["state"].values()) + r["activations"]
        assert speed[case]["samples_per_s"] > 0
    assert {"median", "q1", "q3"} <= set(speed["mp2"]["vs_data_parallel"])
