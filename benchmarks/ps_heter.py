"""Heter workers against trainers that run the dense part themselves, on the wide&deep example.

    python benchmarks/ps_heter.py --rounds 3 --epochs 2
    python benchmarks/ps_heter.py --rounds 1 --epochs 1 --limit 4000      # a smoke run

Each round runs two fleetrun jobs back to back, in alternating order (plain first in odd
rounds): ``--server_num 1 --worker_num W examples/wide_and_deep/train.py --mode M --epochs E``,
and the same with ``--heter_worker_num 1 ... --heter`` (the MLP on a heter worker, on its GPU
when it has one). For each job it reads the example's last epoch line: samples/s (every
worker's samples over the epoch's wall time) and the held-out AUC. It prints one line per job,
then per round the ratio heter / plain of samples/s, and the quartiles of those ratios.
``--out FILE`` appends every job as a JSON line.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ratios import quartiles  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "examples" / "wide_and_deep" / "train.py"
_EPOCH = re.compile(r"epoch (\d+)/(\d+): loss ([0-9.]+), (\d+) samples/s, held-out AUC ([0-9.]+)")


def run_job(args: argparse.Namespace, heter: bool) -> dict:
    """One fleetrun job; its last epoch's figures."""
    flags = ["--heter_worker_num", "1"] if heter else []
    with tempfile.TemporaryDirectory() as cwd:
        cmd = [sys.executable, "-m", "fleetx.launch", "--server_num", "1", "--worker_num",
               str(args.workers), *flags, str(TRAIN), "--mode", args.mode, "--epochs",
               str(args.epochs), "--seed", str(args.seed)]
        cmd += ["--heter"] if heter else []
        cmd += ["--limit", str(args.limit)] if args.limit else []
        res = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=args.timeout)
    if res.returncode != 0:
        raise SystemExit(f"job failed ({'heter' if heter else 'plain'}):\n{res.stdout[-2000:]}"
                         f"{res.stderr[-2000:]}")
    epochs = _EPOCH.findall(res.stdout)
    if not epochs:
        raise SystemExit(f"no epoch line in the job's output:\n{res.stdout[-2000:]}")
    _, _, loss, rate, auc = epochs[-1]
    return {"job": "heter" if heter else "plain", "mode": args.mode, "workers": args.workers,
            "epochs": args.epochs, "limit": args.limit, "samples_per_s": int(rate),
            "loss": float(loss), "auc": float(auc)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--mode", choices=("sync", "async"), default="async")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--limit", type=int, default=0, help="training rows (0: all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", default=None, help="append every job as a JSON line here")
    args = ap.parse_args()
    ratios = []
    for r in range(args.rounds):
        jobs = {}
        for heter in ((False, True) if r % 2 == 0 else (True, False)):
            row = run_job(args, heter)
            jobs[row["job"]] = row
            print(json.dumps({"round": r + 1, **row}), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps({"round": r + 1, **row}) + "\n")
        ratios.append(jobs["heter"]["samples_per_s"] / jobs["plain"]["samples_per_s"])
        print(f"round {r + 1}: heter / plain samples/s = {ratios[-1]:.3f} (AUC heter "
              f"{jobs['heter']['auc']:.4f}, plain {jobs['plain']['auc']:.4f})", flush=True)
    low, mid, high = quartiles(ratios)
    print(f"heter / plain samples/s over {args.rounds} round(s): median {mid:.3f} "
          f"(quartiles {low:.3f}-{high:.3f})", flush=True)


if __name__ == "__main__":
    main()
