"""benchmarks/gpu_step.py at its tiny size on the CPU (its figures come from a GPU; here only
that every trainer runs and the report has every case and ratio). A separate process: the
benchmark imports the GPT example's ``model`` module by its plain name."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_trainer_runs_and_the_report_has_every_ratio():
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_step.py"), "--size",
                          "tiny", "--rounds", "2", "--steps", "1", "--warmup", "1", "--device",
                          "cpu"], capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads(res.stdout.strip().splitlines()[-1])
    cases = ("fp32", "torch_amp", "fleetx_amp", "torch_amp_ckpt", "fleetx_amp_recompute")
    assert set(result["ms_per_step"]) == set(cases)
    assert all(v > 0 for v in result["ms_per_step"].values())
    assert all(len(v) == 2 for v in result["time_ratios"].values())
    for case in cases:
        assert f"  {case} " in res.stdout
