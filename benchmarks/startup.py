"""Start-up overhead of ``fleetrun --nproc_per_node 2`` against ``torchrun --nproc_per_node 2``.

What is timed ("ready_s"): from the moment the launcher command starts to the moment the LAST of
the two ranks has finished ``init_process_group("gloo")`` and a first barrier (each rank
appends its wall-clock time to a file). "total_s" adds the shutdown. fleetrun's extra work is the
worker bootstrap (parent-death signal, guardian, variables, log redirection) and its start-up
printing; both launchers run the same torch elastic agent underneath.

Method: the two launchers alternate (A B A B ...), so slow drifts of the machine hit both alike.
Every run is wrapped by the shared harness (``anchors/harness.py``), which waits for a quiet
machine and reports how much CPU other people's work took meanwhile ("foreign_cores"); runs with
more than ``--max-foreign`` cores of foreign load are discarded. The launch instant is stamped by
``sh -c 'date; exec launcher'`` inside the harness, after its quiet-wait.

Usage:
    python benchmarks/startup.py [--pairs 10] [--max-foreign 0.1] [--harness PATH]
    python benchmarks/startup.py --pairs 1 --max-wait 5   # smoke run
Prints one JSON line per run, then one summary line: medians of the kept runs and the ratio
fleetrun / torchrun.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anchors
from ports import free_port

HERE = Path(__file__).resolve()
# Both launchers get the same environment: gloo on loopback (the host name need not resolve).
_ENV = ["env", "GLOO_SOCKET_IFNAME=lo"]


def worker(ready_file: str) -> None:
    """One rank: join, barrier, stamp."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.barrier()
    stamp = time.time()
    with open(ready_file, "a") as f:
        f.write(f"{stamp}\n")
    print(f"rank {dist.get_rank()} ready at {stamp:.6f}", flush=True)
    dist.destroy_process_group()


def _console_script(name: str) -> str:
    """The entry script next to this interpreter (no version-manager shim in front of it)."""
    beside = Path(sys.executable).with_name(name)
    return str(beside) if beside.exists() else shutil.which(name) or name


def launcher_cmd(name: str, ready_file: Path, workdir: Path) -> list[str]:
    script = [str(HERE), "--worker", str(ready_file)]
    if name == "fleetrun":
        return [_console_script("fleetrun"), "--nproc_per_node", "2",
                "--log_dir", str(workdir / "log"), *script]
    return [_console_script("torchrun"), "--nproc_per_node", "2", "--master_addr",
            "127.0.0.1", "--master_port", str(free_port()), *script]


def run_once(name: str, args: argparse.Namespace, workdir: Path) -> dict:
    ready, start = workdir / "ready", workdir / "start"
    ready.write_text("")
    inner = ["sh", "-c", 'date +%s.%N > "$0"; exec "$@"', str(start), *_ENV,
             *launcher_cmd(name, ready, workdir)]
    cmd = [sys.executable, str(args.harness), "--max-wait", str(args.max_wait), "--", *inner]
    proc = subprocess.run(cmd, cwd=workdir, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True, timeout=args.max_wait + 300)
    report = next((json.loads(line) for line in reversed(proc.stderr.splitlines())
                   if line.startswith('{"harness"')), None)
    stamps = [float(x) for x in ready.read_text().split()]
    if proc.returncode != 0 or report is None or len(stamps) != 2:
        raise RuntimeError(f"{name} run failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    t0 = float(start.read_text())
    return {"launcher": name, "ready_s": round(max(stamps) - t0, 3),
            "total_s": report["wall_s"], "foreign_cores": report["foreign_cores"],
            "started_quiet": report["started_quiet"],
            "kept": report["foreign_cores"] <= args.max_foreign}


def summarize(runs: list[dict]) -> dict:
    summary: dict = {"bench": "startup_nproc2_init_gloo"}
    for name in ("fleetrun", "torchrun"):
        kept = [r["ready_s"] for r in runs if r["launcher"] == name and r["kept"]]
        summary[f"{name}_kept"] = len(kept)
        summary[f"{name}_discarded"] = sum(r["launcher"] == name and not r["kept"] for r in runs)
        summary[f"{name}_median_ready_s"] = round(statistics.median(kept), 3) if kept else None
    a, b = summary["fleetrun_median_ready_s"], summary["torchrun_median_ready_s"]
    summary["ratio_fleetrun_over_torchrun"] = round(a / b, 3) if a and b else None
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=10, help="A/B pairs to run (default 10)")
    ap.add_argument("--max-foreign", type=float, default=0.1,
                    help="discard runs with more foreign load than this, in cores (default 0.1)")
    ap.add_argument("--max-wait", type=float, default=120,
                    help="seconds the harness waits for a quiet machine per run (default 120)")
    ap.add_argument("--harness", type=Path,
                    help="anchors/harness.py (default: found as benchmarks/README.md says)")
    ap.add_argument("--worker", metavar="READY_FILE", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker)
    if args.harness is None:
        args.harness = anchors.require("harness.py")
    elif not args.harness.is_file():
        ap.error(f"--harness {args.harness}: no such file")
    runs = []
    with tempfile.TemporaryDirectory(prefix="fleetx-startup-") as tmp:
        for _ in range(args.pairs):
            for name in ("fleetrun", "torchrun"):
                run = run_once(name, args, Path(tmp))
                runs.append(run)
                print(json.dumps(run), flush=True)
    print(json.dumps(summarize(runs)), flush=True)


if __name__ == "__main__":
    main()
