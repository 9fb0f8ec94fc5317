"""The two reports of ``scripts/gpu_check.sh``: what the machine is, and what the run found.

    python3 scripts/gpu_report.py env                       # torch, CUDA, NCCL, the GPUs
    python3 scripts/gpu_report.py summary OUT_DIR TESTS_STATUS BENCH_STATUS

``summary`` reads the test run's JUnit file (``OUT_DIR/gpu_tests.xml``) and the benchmark's JSON
(``OUT_DIR/gpu_step.json``) when they are there, prints one line per failed or skipped test and
the counts, and writes everything to ``OUT_DIR/gpu_check.json``. Standard library and torch only:
the GPU machine may have nothing else.
"""
from __future__ import annotations

import json
import platform
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def environment() -> dict:
    """Python, torch, CUDA, cuDNN, NCCL and every visible GPU (name, memory, capability)."""
    import torch
    info = {"python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
            "gpus": [], "nccl": None, "cudnn": None}
    if torch.cuda.is_available():
        nccl = torch.cuda.nccl.version()
        info["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
        info["cudnn"] = torch.backends.cudnn.version()
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            info["gpus"].append({"name": p.name, "memory_gib": round(p.total_memory / 2 ** 30, 1),
                                 "capability": f"{p.major}.{p.minor}"})
    return info


def test_results(junit: Path) -> dict:
    """Counts and the failed / skipped tests (with their messages) from a JUnit XML file."""
    if not junit.exists():
        return {"error": f"no {junit.name}: the test run did not finish"}
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    notes = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
            elif child.tag == "skipped" and outcome == "passed":
                outcome = "skipped"
            if child.tag in ("failure", "error", "skipped"):
                notes.append({"test": name, "outcome": outcome,
                              "message": (child.get("message") or "")[:300]})
        counts[outcome] += 1
    return {**counts, "not_passed": notes}


def summary(out: Path, tests_status: int, bench_status: int) -> dict:
    bench = out / "gpu_step.json"
    result = {"environment": environment(), "tests_status": tests_status,
              "tests": test_results(out / "gpu_tests.xml"), "benchmark_status": bench_status,
              "benchmark": json.loads(bench.read_text()) if bench.exists() else None}
    (out / "gpu_check.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def main(argv: list[str]) -> int:
    if argv[:1] == ["env"]:
        print(json.dumps(environment(), indent=1))
        return 0
    if len(argv) == 4 and argv[0] == "summary":
        result = summary(Path(argv[1]), int(argv[2]), int(argv[3]))
        tests = result["tests"]
        for note in tests.get("not_passed", []):
            print(f"  {note['outcome']}: {note['test']}: {note['message']}")
        counts = ", ".join(f"{tests[k]} {k}" for k in ("passed", "failed", "skipped")
                           if k in tests) or tests.get("error", "")
        print(f"gpu_check: tests: {counts} (pytest status {result['tests_status']}); benchmark "
              f"status {result['benchmark_status']}; {Path(argv[1]) / 'gpu_check.json'}")
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
