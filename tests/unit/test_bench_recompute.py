"""benchmarks/recompute.py at its tiny size: the bytes it reports are those of the engine.

fleetx's recompute keeps exactly what ``torch.utils.checkpoint`` used directly keeps on the same
model (each block's input), under half of what the plain model saves for backward, on both the
deep MLP and the small GPT; the timing part runs and yields one ratio per round.
"""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import recompute as bench  # noqa: E402


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_fleetx_saves_what_torch_checkpoint_saves(one_process, kind):
    dims = bench.SIZES["tiny"][kind]
    result = bench.measure(kind, dims, rounds=2)
    saved = result["saved_bytes"]
    assert saved["fleetx"] == saved["torch"]
    assert saved["fleetx"] <= 0.5 * saved["plain"]
    if kind == "mlp":  # each block's input and the head's input, (depth + 1) x batch x width
        # floats, and the loss's input and target, batch floats each
        assert saved["fleetx"] == ((dims["depth"] + 1) * dims["width"] + 2) * dims["batch"] * 4
    assert len(result["fleetx_over_torch"]) == 3 and result["step_s_median"]["fleetx"] > 0
    assert "layer cost" in bench.report(result)
