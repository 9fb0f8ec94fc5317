"""benchmarks/gpu_step.py at its tiny size on the CPU (its figures come from a GPU; here only
that every trainer runs and the report has every case, ratio and derived figure). Separate
processes: the benchmark imports the GPT example's ``model`` module by its plain name."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CASES = ("fp32", "fleetx_fp32", "torch_amp", "fleetx_amp", "torch_amp_ckpt",
         "fleetx_amp_recompute")
PAIRS = ("fleetx_fp32/fp32", "fleetx_amp/torch_amp", "fleetx_amp_recompute/torch_amp_ckpt",
         "torch_amp/fp32", "torch_amp_ckpt/torch_amp")


def test_every_trainer_runs_and_the_report_has_tokens_per_second_and_mfu(tmp_path):
    out = tmp_path / "gpu_step.json"
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_step.py"), "--size",
                          "tiny", "--rounds", "2", "--steps", "1", "--warmup", "1", "--device",
                          "cpu", "--peak-flops", "1e12", "--json", str(out)],
                         capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads(res.stdout.strip().splitlines()[-1])
    assert json.loads(out.read_text()) == result
    assert (result["device"], result["rounds_done"]) == ("cpu", 2)
    assert set(result["ms_per_step"]) == set(result["tokens_per_s"]) == set(CASES)
    assert set(result["time_ratios"]) == set(result["time_ratio_medians"]) == set(PAIRS)
    assert all(len(v) == 2 for v in result["time_ratios"].values())
    # the tiny GPT: 2 layers, 64 wide, 32 tokens of context (a 32 x 64 position embedding,
    # left out of N), batch 4
    n = result["n_params"] - 32 * 64
    assert result["flops_per_token"] == 6 * n + 12 * 2 * 32 * 64
    assert result["tokens_per_step"] == 4 * 32
    assert (result["peak_flops"], result["peak_source"]) == (1e12, "--peak-flops")
    for case in CASES:
        ms, tps = result["ms_per_step"][case], result["tokens_per_s"][case]
        assert ms > 0 and tps == pytest.approx(4 * 32 * 1000 / ms)
        assert result["mfu"][case] == pytest.approx(tps * result["flops_per_token"] / 1e12)
        assert f"  {case} " in res.stdout


def test_the_peak_table_picks_the_variant_before_the_family():
    res = subprocess.run([sys.executable, "-c", "import gpu_step as g; print([g.peak_flops(n)[0] "
                          "for n in ('NVIDIA H200', 'NVIDIA H100 80GB HBM3', 'NVIDIA H100 PCIe', "
                          "'NVIDIA A100-SXM4-80GB', 'Tesla T4')])"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT / "benchmarks")
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip() == str([989.5e12, 989.5e12, 756e12, 312e12, None])
