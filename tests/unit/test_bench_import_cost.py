"""benchmarks/import_cost.py: one round reports both cases and fleetx's cost beyond torch."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import import_cost  # noqa: E402


def test_one_round_reports_every_case_and_the_cost_beyond_torch(capsys):
    summary = import_cost.main(["--rounds", "1", "--trees", str(ROOT)])
    assert set(summary["median_cpu_s"]) == {"torch", f"fleetx {ROOT}"}
    assert summary["median_cpu_s"]["torch"] > 0
    assert set(summary["beyond_torch_s"]) == {f"fleetx {ROOT}"}
    assert len(capsys.readouterr().out.splitlines()) == 2 + 1  # two runs, then the summary
