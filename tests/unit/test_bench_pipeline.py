"""benchmarks/pipeline.py at a tiny size: both engines run the same stages on gloo.

Our pipeline and ``torch.distributed.pipelining`` (``Schedule1F1B`` / ``ScheduleGPipe`` over
``PipelineStage``) start from the same weights and micro-batches, so their first mini-batch's
mean loss agrees; the micro-batches alive per stage follow the schedules' theory; every row
has a bubble, both step times and the theoretical bubble.
"""
import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import pipeline as bench  # noqa: E402


@pytest.mark.slow  # two processes and two engines: 30-50 s on a busy 2-core machine
def test_fleetx_and_torch_pipelining_run_the_same_stages():
    args = argparse.Namespace(micro=[3], micro_batch_size=2, layers_per_stage=1, width=8,
                              ms=1.0, steps=1)
    rows = {row[2]: row for row in bench.measure(2, args)}
    assert set(rows) == {"1F1B", "FThenB"}
    for mode, (p, m, _, bubble, theory, peak, alive, ours, theirs, gap) in rows.items():
        assert (p, m) == (2, 3) and theory == pytest.approx(1 / 4)
        assert 0 <= bubble < 1 and all(b > 0 for b in peak)
        assert ours > 0 and theirs > 0
        assert gap <= 1e-6, mode  # same weights, same micro-batches: the same loss
    assert rows["1F1B"][6] == [2, 1]  # min(p - s, m) micro-batches alive on stage s
    assert rows["FThenB"][6] == [3, 3]
