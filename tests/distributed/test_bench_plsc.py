"""benchmarks/plsc.py at a small size: the head bytes it reports are the shard's and fall as 1/mp.

Parameter + gradient + momentum of a ``[C/mp, D]`` float32 shard: ``3 * 4 * C * D / mp`` bytes
on every rank; the step times are measured (positive) but not judged.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import plsc as bench  # noqa: E402


def test_head_bytes_per_rank_fall_as_one_over_mp():
    args = argparse.Namespace(classes=4096, in_features=16, batch=8, steps=1, warmup=1)
    heads, rss, step = bench.measure(2, args)  # mp 1 would hold 3 * 4 * 4096 * 16 bytes
    assert heads == [3 * 4 * 4096 * 16 // 2] * 2
    assert all(r > 0 for r in rss) and step > 0
