"""``ps_ctr.py speedup``: fleetx's parameter server against one plain PyTorch process, in one run.

The question (issue 11, item 7): do two fleetx workers and one server train the CTR workload
(``ps_common.py``) faster than one plain PyTorch process, and by how much? Each round runs the
plain process (``ps_ctr.py local``) and then every fleetx case (default: async and GEO, one
server, two workers), each job through ``anchors/harness.py`` when it is available (it waits
for a quiet machine and reports the CPU other jobs took meanwhile), so drift on the machine hits
both sides alike. Per round it prints, for each case,

    ratio = fleetx samples/s / (2 x plain samples/s)

(1.0: two workers do the work of two independent plain processes; the plain side has no
parameter server, the fleetx side has one more process on the same cores), with both AUCs
(worker 0's cumulative training AUC; the plain process's over its own run), then the quartiles
of each case's ratios over the rounds. samples/s is each job's median over epochs 2.. (see
``ps_common.aggregate``).

Usage:
    python benchmarks/ps_ctr.py speedup --rounds 5                      # async_1x2, geo_1x2
    python benchmarks/ps_ctr.py speedup --rounds 5 --cases async_1x2 --out /tmp/speedup.jsonl
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from typing import Callable, Optional

import anchors
from ratios import quartiles

DEFAULT_CASES = "async_1x2,geo_1x2"


def at_least_one(text: str) -> int:
    """An argparse type: an int >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_parser(sub, default_data: str) -> None:
    p = sub.add_parser("speedup", help="fleetx 1 server x 2 workers against 2 x one plain "
                                       "PyTorch process, alternating, through the harness")
    p.add_argument("--cases", default=DEFAULT_CASES,
                   help="comma-separated fleetx cases of ps_ctr.CASES (1 or 2 servers, 2 "
                        "workers)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--data", default=default_data)
    p.add_argument("--lines", type=int, default=200_000, help="generated when --data is empty")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--max-wait", type=float, default=120,
                   help="seconds the harness waits for a quiet machine before each job")
    p.add_argument("--max-foreign", type=float, default=0.1,
                   help="a round is 'kept' when every job's foreign load stayed below this")
    p.add_argument("--no-prefetch", dest="prefetch", action="store_false",
                   help="fleetx jobs iterate their batches without fleet.prefetch")
    p.add_argument("--recv-every", type=at_least_one, default=1,
                   help="async jobs receive the dense weights every N pushes "
                        "(independent_recv_thread + min_send_grad_num_before_recv)")
    p.add_argument("--out", help="also append every job as a JSON line to this file")


def run_command(cmd: list, max_wait: float, cwd: str) -> tuple[dict, dict]:
    """``cmd``'s JSON summary (its last ``{"bench"...}`` line) and the harness's reading;
    without the harness, the command runs bare and the reading is empty."""
    try:
        wrapped = [sys.executable, str(anchors.require("harness.py")), "--max-wait",
                   str(max_wait), "--"]
    except anchors.MissingAnchor:
        wrapped = []
    proc = subprocess.run(wrapped + [str(x) for x in cmd], capture_output=True, text=True,
                          cwd=cwd)
    bench = [x for x in proc.stdout.splitlines() if x.startswith('{"bench"')]
    harness = [x for x in proc.stderr.splitlines() if x.startswith('{"harness"')]
    return (json.loads(bench[-1]) if bench else {"rc": proc.returncode,
                                                  "tail": proc.stderr[-2000:]},
            json.loads(harness[-1]) if harness else {})


def rounds(cases: list, n: int, job: Callable[[str], tuple[dict, dict]],
           out: Optional[str] = None, say: Callable[[str], None] = print) -> list:
    """Run ``local`` then every case, ``n`` rounds; each job's record is printed (and
    appended to ``out``). Returns the records."""
    runs = []
    for rnd in range(1, n + 1):
        for case in ["local", *cases]:
            bench, harness = job(case)
            run = {"round": rnd, "case": case, "samples_per_s": bench.get("warm_samples_per_s"),
                   "auc": bench.get("last_auc"), "foreign_cores": harness.get("foreign_cores"),
                   "bench": bench, "harness": harness}
            runs.append(run)
            say(json.dumps(run))
            if out:
                with open(out, "a") as f:
                    f.write(json.dumps(run) + "\n")
    return runs


def ratio_of(runs: list, rnd: int, case: str) -> Optional[float]:
    """``case``'s samples/s over twice the plain process's, in round ``rnd``."""
    by = {r["case"]: r for r in runs if r["round"] == rnd}
    a, b = (by.get(case) or {}).get("samples_per_s"), (by.get("local") or {}).get(
        "samples_per_s")
    return a / (2 * b) if a and b else None


def summary(runs: list, cases: list, max_foreign: float, say: Callable[[str], None] = print
            ) -> dict:
    """Per round: each case's ratio and AUC beside the plain process's; then per case the
    quartiles of the ratios (of every round, and of the rounds whose jobs all ran on a quiet
    machine). Returns ``{case: median ratio of every round}``."""
    say("\nround  plain samples/s  plain AUC  " + "  ".join(
        f"{c + ' ratio':>15} {c + ' AUC':>13}" for c in cases) + "  quiet")
    for rnd in sorted({r["round"] for r in runs}):
        by = {r["case"]: r for r in runs if r["round"] == rnd}
        plain = by.get("local", {})
        quiet = all((r.get("foreign_cores") is not None and r["foreign_cores"] <= max_foreign)
                    for r in by.values())
        cells = "  ".join(f"{_fmt(ratio_of(runs, rnd, c), '.3f', 15)} "
                          f"{_fmt(by.get(c, {}).get('auc'), '.4f', 13)}" for c in cases)
        say(f"{rnd:>5}  {_fmt(plain.get('samples_per_s'), '.0f', 15)}  "
            f"{_fmt(plain.get('auc'), '.4f', 9)}  {cells}  {'yes' if quiet else 'no'}")
    medians = {}
    for case in cases:
        every = [x for x in (ratio_of(runs, rnd, case) for rnd in
                             sorted({r['round'] for r in runs})) if x is not None]
        if not every:
            say(f"{case}: no round finished")
            continue
        q1, med, q3 = quartiles(every)
        medians[case] = med
        aucs = [r["auc"] for r in runs if r["case"] == case and r.get("auc") is not None]
        plain = [r["auc"] for r in runs if r["case"] == "local" and r.get("auc") is not None]
        say(f"{case}: fleetx / (2 x plain) median {med:.3f} (quartiles {q1:.3f}-{q3:.3f}, "
            f"{len(every)} rounds); AUC {_fmt(_mid(aucs), '.4f', 0)} against plain "
            f"{_fmt(_mid(plain), '.4f', 0)}")
    return medians


def _mid(values: list) -> Optional[float]:
    return statistics.median(values) if values else None


def _fmt(value, spec: str, width: int) -> str:
    return format(value, spec).rjust(width) if value is not None else "-".rjust(width)


def cmd_speedup(args: argparse.Namespace, commands: Callable, root: str,
                ensure_data: Callable) -> None:
    """The subcommand: ``commands(case, args)`` gives each case's command (ps_ctr's)."""
    cases = [c for c in args.cases.split(",") if c]
    if "local" in cases or not cases:
        raise SystemExit(f"--cases {args.cases}: name fleetx cases; the plain process runs in "
                         "every round anyway")
    ensure_data(args)

    def job(case: str) -> tuple[dict, dict]:
        (_, cmd), *_ = commands(case, args)
        if case != "local" and not args.prefetch:
            cmd = [*cmd, "--no-prefetch"]
        if case != "local" and args.recv_every > 1:
            cmd = [*cmd, "--recv-every", str(args.recv_every)]
        return run_command(cmd, args.max_wait, root)

    summary(rounds(cases, args.rounds, job, args.out), cases, args.max_foreign)
