"""CPU seconds a fresh interpreter spends importing fleetx, beside importing torch alone.

Every process fleetx starts (a rank, a server, a worker, a doc block run as a script) pays this
before its first line of work. Each round starts, in turn, a fresh ``python -c`` that imports
torch only, and one per source tree that imports ``fleetx.fleet`` from it (``--trees``: several
checkouts compared in the same run, e.g. before and after a change); the CPU time (user + system)
of each child is read from ``resource.getrusage``. Prints one JSON line per measurement, then the
medians and each tree's cost beyond torch.

Usage:
    python benchmarks/import_cost.py --rounds 9
    python benchmarks/import_cost.py --rounds 9 --trees /path/to/old /path/to/new
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHAT = {"torch": "import torch", "fleetx": "import fleetx.fleet"}


def cpu_seconds(code: str, tree: Path) -> float:
    """CPU seconds of a fresh interpreter running ``code`` with ``tree`` first on its path."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    # cwd: ``python -c`` puts its working directory first on the path, before PYTHONPATH
    subprocess.run([sys.executable, "-c", code], env=env, cwd=tree, check=True, timeout=120)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--trees", nargs="+", type=Path, default=[ROOT],
                    help="source trees whose fleetx is imported (default: this one)")
    args = ap.parse_args(argv)
    cases = [("torch", "torch", args.trees[0])] + [
        (f"fleetx {tree}", "fleetx", tree) for tree in args.trees]
    times: dict[str, list[float]] = {name: [] for name, _, _ in cases}
    for r in range(args.rounds):
        for name, what, tree in cases[r % len(cases):] + cases[:r % len(cases)]:
            seconds = cpu_seconds(WHAT[what], tree)
            times[name].append(seconds)
            print(json.dumps({"round": r, "case": name, "cpu_s": round(seconds, 3)}), flush=True)
    medians = {name: statistics.median(v) for name, v in times.items()}
    summary = {"rounds": args.rounds, "median_cpu_s": {k: round(v, 3) for k, v in medians.items()},
               "beyond_torch_s": {k: round(v - medians["torch"], 3)
                                  for k, v in medians.items() if k != "torch"}}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
