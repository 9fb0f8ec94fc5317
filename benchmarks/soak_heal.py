"""Soak: 3 data-parallel ranks on CPU, one SIGKILLed every ``--every`` seconds, under
``fleetrun --fault_tolerance heal`` and then under ``--fault_tolerance restart`` (automatic
checkpoints every ``--ckpt-every`` steps), the same training script and step count.

Each rank logs one JSON line per step (``soak_train.py`` below, written into the run folder).
Reported per mode:

* effective training time: useful steps x median step time / wall time, where useful steps are
  the steps of the final trajectory (each step counted once) and the median step time is rank
  0's median interval between consecutive steps;
* steps lost per failure on the survivors: steps a survivor ran more than once (restart: the
  steps since the last checkpoint; heal: none unless a step is redone);
* rejoin time (heal): from the kill to the restarted rank's first step.

Example::

    python benchmarks/soak_heal.py --duration 1200 --every 120 --out /tmp/soak.json
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TRAIN = '''
import json, os, sys, time, torch
from fleetx import env, fleet
steps, mode, ckpt = int(sys.argv[1]), sys.argv[2], sys.argv[3]
fleet.init(is_collective=True)
slot = env.get_int("RANK")
torch.manual_seed(0)
model = fleet.distributed_model(torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                                    torch.nn.Linear(256, 1)))
opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.01))
start = fleet.auto_checkpoint(ckpt, every_steps=int(sys.argv[4])) if mode == "restart" \\
    else fleet.start_step()
out = open(f"steps.{slot}", "a")
for step in range(start, steps):
    g = torch.Generator().manual_seed(1000 * step + slot)
    x = torch.randn(256, 256, generator=g)
    opt.minimize(model(x).square().mean())
    out.write(json.dumps({"step": step, "pid": os.getpid(), "t": time.time()}) + "\\n")
    out.flush()
'''


def _records(folder: Path) -> dict:
    found = {}
    for slot in range(3):
        path = folder / f"steps.{slot}"
        found[slot] = [json.loads(line) for line in path.read_text().splitlines()] \
            if path.exists() else []
    return found


def run_mode(mode: str, steps: int, every: float, ckpt_every: int, folder: Path) -> dict:
    """Run one soak; the kills go to ranks 1 and 2 in turn (rank 0's log is the reference)."""
    folder.mkdir(parents=True)
    (folder / "soak_train.py").write_text(TRAIN)
    cmd = [sys.executable, "-m", "fleetx.launch", "--nproc_per_node", "3", "--fault_tolerance",
           mode, "--max_restarts", "1000", "soak_train.py", str(steps), mode, "ckpt",
           str(ckpt_every)]
    started = time.time()
    job = subprocess.Popen(cmd, cwd=folder, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           text=True)
    kills, victim = [], 1
    next_kill = started + every
    while job.poll() is None:
        time.sleep(0.2)
        if time.time() >= next_kill:
            last = _records(folder)[victim]
            if last:
                try:
                    os.kill(last[-1]["pid"], signal.SIGKILL)
                    kills.append({"t": time.time(), "slot": victim, "pid": last[-1]["pid"]})
                except ProcessLookupError:
                    pass
            victim = 3 - victim
            next_kill += every
    wall = time.time() - started
    return summarise(mode, _records(folder), kills, wall, job.returncode)


def summarise(mode: str, records: dict, kills: list, wall: float, code: int) -> dict:
    rank0 = records[0]
    steps = [r["step"] for r in rank0]
    gaps = [b["t"] - a["t"] for a, b in zip(rank0, rank0[1:]) if b["step"] == a["step"] + 1]
    median = statistics.median(gaps) if gaps else float("nan")
    useful = len(set(steps))
    redone = len(steps) - useful
    rejoins = []
    for kill in kills:
        later = [r for r in records[kill["slot"]] if r["t"] > kill["t"] and r["pid"] != kill["pid"]]
        if later:
            rejoins.append(later[0]["t"] - kill["t"])
    return {"mode": mode, "exit": code, "wall_s": wall, "useful_steps": useful,
            "median_step_s": median, "effective": useful * median / wall,
            "failures": len(kills), "steps_lost_per_failure_rank0": redone / max(len(kills), 1),
            "rejoin_s": rejoins, "rejoin_max_s": max(rejoins) if rejoins else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=1200, help="seconds per mode")
    parser.add_argument("--every", type=float, default=120, help="seconds between kills")
    parser.add_argument("--step-s", type=float, default=0.05,
                        help="expected seconds per step (sizes the step count)")
    parser.add_argument("--ckpt-every", type=int, default=100)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    steps = int(args.duration / args.step_s)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("heal", "restart"):
            results.append(run_mode(mode, steps, args.every, args.ckpt_every,
                                    Path(tmp) / mode))
            print(json.dumps(results[-1]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
