"""Parameter-server CTR benchmark: fleetx's PS against Paddle's, on the baseline's workload.

The workload, its timing rule and the aggregation are in ``benchmarks/ps_common.py``. Commands:

``train``   the role script that ``fleetrun --server_num S --worker_num W`` starts in every
            process (servers serve; workers load their file shard, train, append a JSON line
            to ``--result``);
``run``     one fleetx job: launches ``train`` under fleetrun and prints one JSON summary
            (``warm_samples_per_s`` = median over epochs 2.. of all samples / slowest worker);
``transports`` fleetx's TCP transport against the ZeroMQ one kept for comparison
            (``FLEETX_PS_TRANSPORT``, needs pyzmq: ``pip install -e '.[bench]'``): ``run`` jobs
            alternating A B A B for ``--rounds`` rounds; prints every run, then per round and
            in median the ratio of warm samples/s of each transport to the first one's;
``local``   the same model and data in one plain PyTorch process with one thread (no fleetx);
``compare`` the A/B campaign: for each case, fleetx's run and Paddle's
            (``$PADDLE_PS_PY anchors/paddle_ps_run.py``) alternate, each through
            ``anchors/harness.py``; runs with more than ``--max-foreign`` cores of other load are
            dropped; prints every run and a table of medians and ratios fleetx / Paddle, then
            the async ratios with the same sparse rule on both sides (``async_adam_*``: Paddle's
            async applies Adam to its table, see ``PADDLE_SPARSE_RULE``) beside those with
            fleetx's table on SGD (``async_1x2``, ``async_2x2``);
``speedup`` fleetx against plain PyTorch in one run (``ps_speedup.py``): per round one
            ``local`` job, then ``async_1x2`` and ``geo_1x2``, each through the harness when it
            is there; prints per round fleetx samples/s / (2 x plain samples/s) and the AUCs.

The anchors (harness, Paddle's job) live outside the repository: ``benchmarks/README.md``.

Usage:
    python examples/wide_and_deep/gen_criteo.py --lines 200000 --files 10 --out /tmp/fleetx_criteo
    python benchmarks/ps_ctr.py run --mode async --servers 1 --workers 2
    python benchmarks/ps_ctr.py transports --transports tcp,zmq --rounds 5 --mode async
    python benchmarks/ps_ctr.py local
    PADDLE_PS_PY=/tmp/paddle26-venv/bin/python python benchmarks/ps_ctr.py compare --rounds 3
    python benchmarks/ps_ctr.py compare --cases async_adam_1x2,async_1x2 --rounds 3
    python benchmarks/ps_ctr.py speedup --rounds 5
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple, Optional

if __name__ == "__main__":  # one thread per process, before torch starts; not on import (tests)
    for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(_var, "1")

import torch  # noqa: E402

import anchors  # noqa: E402
import ps_common as pc  # noqa: E402
import ps_counters  # noqa: E402
import ps_speedup  # noqa: E402
from fleetx.ps.api import TRANSPORTS  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT_DATA = "/tmp/fleetx_criteo"
# The sparse table's update rule Paddle 2.6.2 applies server-side, per mode: async falls through
# to SparseAdamSGDRule whatever the program's optimizer (an `if` where an `elif` was meant, in
# paddle/distributed/ps/the_one_ps.py; its lr is the program's, 0.05, betas 0.9/0.999, eps 1e-8);
# GEO's table is a dense local copy updated by the program's SGD.
PADDLE_SPARSE_RULE = {"async": "adam", "geo": "sgd"}


class Case(NamedTuple):
    """One comparison: fleetx's mode, servers and table rule; Paddle's mode (None: fleetx alone)."""

    mode: str
    servers: int
    sparse_rule: str
    paddle_mode: Optional[str]

    def rules(self) -> str:
        """``"ours/Paddle's"`` sparse rule, e.g. ``adam/adam``; ``sgd`` alone without Paddle."""
        theirs = PADDLE_SPARSE_RULE.get(self.paddle_mode or "")
        return f"{self.sparse_rule}/{theirs}" if theirs else self.sparse_rule

    def same_rule(self) -> bool:
        return PADDLE_SPARSE_RULE.get(self.paddle_mode or "") == self.sparse_rule


CASES = {
    # the headline: the same sparse rule (Adam) on both sides
    "async_adam_1x2": Case("async", 1, "adam", "async"),
    "async_adam_2x2": Case("async", 2, "adam", "async"),
    # fleetx's table with the program's SGD against Paddle's async (which applies Adam)
    "async_1x2": Case("async", 1, "sgd", "async"),
    "async_2x2": Case("async", 2, "sgd", "async"),
    "geo_1x2": Case("geo", 1, "sgd", "geo"),
    "geo_2x2": Case("geo", 2, "sgd", "geo"),
    "sync_1x2": Case("sync", 1, "sgd", None),
    "sync_2x2": Case("sync", 2, "sgd", None),
    "local": Case("local", 0, "sgd", None),
}


# -- train: the script every fleetrun process runs ----------------------------------------------
def make_embedding(table: str, sparse_rule: str) -> torch.nn.Module:
    from fleetx.nn import SparseEmbedding
    from fleetx.ps.api import InitConfig, RuleConfig
    if table == "embedding":
        if sparse_rule != "sgd":
            raise SystemExit("--sparse-rule adam needs --table sparse (the table's own rule)")
        return pc.local_embedding()
    rule = RuleConfig("adam", lr=pc.LR) if sparse_rule == "adam" else None
    return SparseEmbedding(pc.EMB_DIM, name="emb", rule=rule,
                           init=InitConfig("uniform", low=-0.01, high=0.01))


def cmd_train(args: argparse.Namespace) -> None:
    from fleetx import fleet, metrics
    torch.set_num_threads(1)
    torch.manual_seed(0)  # every role builds the same model
    fleet.init()
    strategy = fleet.DistributedStrategy()
    strategy.a_sync = args.mode != "sync"
    if args.mode == "geo":
        strategy.a_sync_configs = {"k_steps": args.k_steps}
    elif args.recv_every > 1:
        strategy.a_sync_configs = {"independent_recv_thread": True,
                                   "min_send_grad_num_before_recv": args.recv_every}
    model = fleet.distributed_model(pc.CTRModel(make_embedding(args.table, args.sparse_rule)))
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=pc.LR), strategy)
    if fleet.is_server():
        fleet.init_server()
        probe = ps_counters.ServerProbe()
        fleet.run_server()
        with open(f"{args.result}.server{fleet.server_index()}", "w") as f:
            json.dump({"server": fleet.server_index(), "cpu_trace": probe.stop()}, f)
        return
    t0 = time.perf_counter()
    data = pc.read_criteo(fleet.util.get_file_shard(pc.data_files(args.data)))
    load_s = time.perf_counter() - t0
    fleet.init_worker()
    rank = fleet.worker_index()
    say = (lambda s: print(f"worker {rank}: {s}", flush=True)) if not args.quiet else None
    probe = ps_counters.WorkerProbe(fleet.server_endpoints())
    probe.read()
    table = model.module.embedding  # the rows of the next batch travel while one trains
    loader = (lambda batches: fleet.prefetch(batches, lambda b: {table: b[0]})) \
        if args.prefetch else (lambda batches: batches)
    log = pc.train_epochs(model, opt.minimize, data, args.epochs, args.batch, say, probe.read,
                          loader)
    global_aucs = [metrics.auc(p, n) for p, n in log.stats]      # collectives: every worker
    fleet.stop_worker()
    cum_pos = sum(p for p, _ in log.stats)
    cum_neg = sum(n for _, n in log.stats)
    record = {"worker": rank, "workers": fleet.worker_num(), "mode": args.mode,
              "table": args.table, "sparse_rule": args.sparse_rule, "samples": len(data),
              "load_s": round(load_s, 2), "epoch_s": [round(s, 3) for s in log.seconds],
              "loss": [round(x, 5) for x in log.losses],
              "auc": [round(a, 4) for a in global_aucs],
              "auc_cum": round(metrics.auc_from_histograms(cum_pos, cum_neg), 4),
              "probe": probe.readings}
    with open(args.result, "a") as f:
        f.write(json.dumps(record) + "\n")
    if rank == 0 and not args.quiet:
        print(f"worker 0: epochs {record['epoch_s']} s, AUC per epoch {record['auc']}", flush=True)


# -- run: one fleetx job ---------------------------------------------------------------------------
def _launch(cmd: list, log_path: str, timeout: float, cwd: str,
            env: dict | None = None) -> object:
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, env=env,
                                start_new_session=True)   # a hung job is killed as a whole
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return "timeout"


def cmd_run(args: argparse.Namespace) -> None:
    print(json.dumps(run_job(args, args.transport)), flush=True)


def run_job(args: argparse.Namespace, transport: str) -> dict:
    """One fleetx job over ``transport`` (``FLEETX_PS_TRANSPORT`` of every process): its
    summary (logs kept and named when it failed)."""
    tmp = tempfile.mkdtemp(prefix="fleetx_ps_ctr_")
    result, log_dir = os.path.join(tmp, "result.jsonl"), os.path.join(tmp, "log")
    train = [str(HERE / "ps_ctr.py"), "train", "--mode", args.mode, "--k-steps",
             str(args.k_steps), "--data", os.path.abspath(args.data), "--epochs",
             str(args.epochs), "--batch", str(args.batch), "--table", args.table,
             "--sparse-rule", args.sparse_rule, "--recv-every", str(args.recv_every),
             "--result", result, "--quiet"] + ([] if args.prefetch else ["--no-prefetch"])
    cmd = [sys.executable, "-m", "fleetx.launch", "--server_num", str(args.servers),
           "--worker_num", str(args.workers), "--log_dir", log_dir] + train
    os.makedirs(log_dir)
    t0 = time.perf_counter()
    rc = _launch(cmd, os.path.join(tmp, "fleetrun.log"), args.timeout, str(ROOT),
                 dict(os.environ, FLEETX_PS_TRANSPORT=transport))
    rows = [json.loads(x) for x in open(result)] if os.path.exists(result) else []
    out = {"bench": f"fleetx_ps_{args.mode}" + ("_adam" if args.sparse_rule == "adam" else ""),
           "servers": args.servers, "workers": args.workers, "table": args.table,
           "sparse_rule": args.sparse_rule, "k_steps": args.k_steps if args.mode == "geo" else None,
           "recv_every": args.recv_every if args.mode == "async" else None,
           "transport": transport, "batch": args.batch, "rc": rc,
           "job_wall_s": round(time.perf_counter() - t0, 1),
           "workers_reported": len(rows)}
    servers = [json.load(open(p)) for p in sorted(Path(tmp).glob("result.jsonl.server*"))]
    if len(rows) == args.workers:
        first = min(rows, key=lambda r: r["worker"])
        out.update(pc.aggregate(rows), auc=first["auc"], last_auc=first["auc_cum"],
                   loss=first["loss"], counted=ps_counters.summarize(rows, servers, args.batch))
        shutil.rmtree(tmp)
    else:  # keep the logs of a failed job
        out["log_dir"] = tmp
    return out


# -- transports: the TCP links against ZeroMQ, alternating in one run ----------------------------
def cmd_transports(args: argparse.Namespace) -> None:
    names = args.transports.split(",")
    if len(names) < 2 or len(set(names)) != len(names) or set(names) - set(TRANSPORTS):
        raise SystemExit(f"--transports {args.transports}: name two or more different ones of "
                         f"{', '.join(TRANSPORTS)}")
    runs = []
    for rnd in range(1, args.rounds + 1):
        for name in names:  # A B A B: drift on the machine hits every transport alike
            run = {"round": rnd, **run_job(args, name)}
            runs.append(run)
            print(json.dumps(run), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(run) + "\n")
    _transport_summary(runs, names, args.rounds)


def _transport_summary(runs: list, names: list, rounds: int) -> None:
    """Per round: each transport's warm samples/s and its ratio to the first transport's; then
    the medians (of the rates, and of the per-round ratios)."""
    rate = {(r["round"], r["transport"]): r.get("warm_samples_per_s") for r in runs}
    base = names[0]
    print(f"\n{'round':>5} " + " ".join(f"{n + ' samples/s':>16}" for n in names) + " " +
          " ".join(f"{n + '/' + base:>10}" for n in names[1:]))
    ratios: dict = {n: [] for n in names[1:]}
    for rnd in range(1, rounds + 1):
        cells = [_cell(rate.get((rnd, n)), ".0f", 16) for n in names]
        for n in names[1:]:
            a, b = rate.get((rnd, n)), rate.get((rnd, base))
            ratios[n].append(a / b if a and b else None)
        print(f"{rnd:>5} " + " ".join(cells) + " " +
              " ".join(_cell(ratios[n][-1], ".3f", 10) for n in names[1:]))
    medians = [_median([r for r in runs if r["transport"] == n], "warm_samples_per_s")
               for n in names]
    kept = {n: [x for x in ratios[n] if x is not None] for n in ratios}
    print(f"{'median':>5} " + " ".join(_cell(m, ".0f", 16) for m in medians) + " " +
          " ".join(_cell(statistics.median(kept[n]) if kept[n] else None, ".3f", 10)
                   for n in names[1:]))


# -- local: plain PyTorch, one process, one thread -------------------------------------------------
def cmd_local(args: argparse.Namespace) -> None:
    from fleetx.metrics import auc_from_histograms
    torch.set_num_threads(1)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    data = pc.read_criteo(pc.data_files(args.data))
    load_s = time.perf_counter() - t0
    model = pc.CTRModel(pc.local_embedding())
    opt = torch.optim.SGD(model.parameters(), lr=pc.LR)

    def step(loss: torch.Tensor) -> None:
        opt.zero_grad()
        loss.backward()
        opt.step()
    cpu = [time.process_time()]   # after each epoch too: CPU per sample, whatever else runs
    log = pc.train_epochs(model, step, data, args.epochs, args.batch,
                          on_epoch=lambda _: cpu.append(time.process_time()))
    row = {"samples": len(data), "load_s": load_s, "epoch_s": log.seconds}
    cum = (sum(p for p, _ in log.stats), sum(n for _, n in log.stats))
    warm = cpu[1:] if len(cpu) > 2 else cpu
    print(json.dumps({"bench": "torch_local", "servers": 0, "workers": 1, "batch": args.batch,
                      **pc.aggregate([row]),
                      "cpu_s_per_sample": (warm[-1] - warm[0]) / (len(data) * (len(warm) - 1)),
                      "auc": [round(auc_from_histograms(p, n), 4) for p, n in log.stats],
                      "last_auc": round(auc_from_histograms(*cum), 4),
                      "loss": [round(x, 5) for x in log.losses]}), flush=True)


# -- compare: fleetx and Paddle alternating, through the anchors' harness -------------------------
def _harnessed(cmd: list, max_wait: float) -> tuple:
    """Run ``cmd`` under ``anchors/harness.py``: (the command's JSON summary, the harness's)."""
    proc = subprocess.run([sys.executable, str(anchors.require("harness.py")), "--max-wait",
                           str(max_wait), "--", *map(str, cmd)], capture_output=True, text=True,
                          cwd=ROOT)
    bench = [x for x in proc.stdout.splitlines() if x.startswith('{"bench"')]
    harness = [x for x in proc.stderr.splitlines() if x.startswith('{"harness"')]
    return (json.loads(bench[-1]) if bench else {"rc": proc.returncode,
                                                  "tail": proc.stderr[-2000:]},
            json.loads(harness[-1]) if harness else {})


def _ours(case: str, args: argparse.Namespace) -> list:
    """``[(side, command)]``: fleetx's (or plain torch's) run of one case."""
    mode, servers, rule, _ = CASES[case]
    common = ["--data", args.data, "--epochs", args.epochs]
    if mode == "local":
        return [("torch", [sys.executable, HERE / "ps_ctr.py", "local", *common])]
    return [("fleetx", [sys.executable, HERE / "ps_ctr.py", "run", "--mode", mode, "--servers",
                        servers, "--workers", 2, "--sparse-rule", rule, *common])]


def _commands(case: str, args: argparse.Namespace) -> list:
    """``[(side, command)]`` of one case: fleetx's (or plain torch's) run, then Paddle's."""
    mode, servers, _, paddle_mode = CASES[case]
    common = ["--data", args.data, "--epochs", args.epochs]
    out = _ours(case, args)
    if paddle_mode is not None:
        out.append(("paddle", [args.paddle_py, anchors.require(*anchors.PADDLE_PS), "--mode",
                               paddle_mode, "--servers", servers, "--workers", 2, *common]))
    return out


def _median(rows: list, key: str):
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def _cell(value, spec: str, width: int) -> str:
    return format(value, spec).rjust(width) if value is not None else "-".rjust(width)


def _side(runs: list, case: str, paddle: bool, kept_only: bool) -> list:
    return [r for r in runs if r["case"] == case and (r["side"] == "paddle") == paddle
            and (r["kept"] or not kept_only)]


def _ratio(runs: list, case: str, kept_only: bool = True) -> Optional[float]:
    """Median samples/s of fleetx's (or torch's) runs over Paddle's, for ``case``: of the kept
    runs, or (``kept_only=False``) of every run that finished."""
    a = _median(_side(runs, case, False, kept_only), "samples_per_s")
    b = _median(_side(runs, case, True, kept_only), "samples_per_s")
    return a / b if a and b else None


def _summary(runs: list, cases: list) -> None:
    """Per case: medians of the kept runs, the ratio ours / Paddle (of the kept runs, and of all
    runs: Paddle's own servers read as foreign load, see docs/benchmarks.md), AUC medians (all
    runs); then the async ratios with the same sparse rule on both sides (the headline) and with
    SGD on fleetx's table."""
    print(f"\n{'case':16} {'rule ours/Paddle':>16} {'ours samples/s':>15} "
          f"{'Paddle samples/s':>17} {'ratio':>6} {'all runs':>8} {'our AUC':>8} "
          f"{'Paddle AUC':>10}  kept ours, Paddle")
    for case in cases:
        mine, theirs = _side(runs, case, False, False), _side(runs, case, True, False)
        a = _median([r for r in mine if r["kept"]], "samples_per_s")
        b = _median([r for r in theirs if r["kept"]], "samples_per_s")
        print(f"{case:16} {CASES[case].rules():>16} {_cell(a, '.0f', 15)} {_cell(b, '.0f', 17)} "
              f"{_cell(_ratio(runs, case), '.2f', 6)} {_cell(_ratio(runs, case, False), '.2f', 8)} "
              f"{_cell(_median(mine, 'auc'), '.4f', 8)} {_cell(_median(theirs, 'auc'), '.4f', 10)}"
              f"  {sum(r['kept'] for r in mine)}/{len(mine)}, "
              f"{sum(r['kept'] for r in theirs)}/{len(theirs)}")
    for title, same in (("same sparse rule on both sides (Adam), the headline", True),
                        ("fleetx's table on SGD, Paddle's on Adam", False)):
        cells = [f"{c} {_cell(_ratio(runs, c), '.2f', 0)} (all runs "
                 f"{_cell(_ratio(runs, c, False), '.2f', 0)})" for c in cases
                 if CASES[c].paddle_mode == "async" and CASES[c].same_rule() == same]
        if cells:
            print(f"async, fleetx / Paddle, {title}: {'; '.join(cells)}")


def _ensure_data(args: argparse.Namespace) -> None:
    """Generate ``--lines`` lines into ``--data`` when it holds no part-* file."""
    if not any(Path(args.data).glob("part-*")):
        subprocess.run([sys.executable, ROOT / "examples/wide_and_deep/gen_criteo.py", "--lines",
                        str(args.lines), "--files", "10", "--out", args.data], check=True)


def cmd_speedup(args: argparse.Namespace) -> None:
    ps_speedup.cmd_speedup(args, _ours, str(ROOT), _ensure_data)


def cmd_compare(args: argparse.Namespace) -> None:
    cases = args.cases.split(",")
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; known: {', '.join(CASES)}")
    anchors.require("harness.py")
    if any(CASES[c].paddle_mode for c in cases):
        anchors.require(*anchors.PADDLE_PS)
        if not os.path.exists(args.paddle_py):
            raise SystemExit(f"Paddle's python {args.paddle_py} not found: set PADDLE_PS_PY or "
                             "--paddle-py, or build the venv as benchmarks/README.md says "
                             "(section 'Paddle 2.6.2 for the parameter-server comparison')")
    _ensure_data(args)
    runs = []
    for rnd in range(1, args.rounds + 1):
        for case in cases:
            for side, cmd in _commands(case, args):
                bench, harness = _harnessed(cmd, args.max_wait)
                foreign = harness.get("foreign_cores")
                run = {"round": rnd, "case": case, "side": side,
                       "samples_per_s": bench.get("warm_samples_per_s"),
                       "auc": bench.get("last_auc"), "foreign_cores": foreign,
                       "kept": foreign is not None and foreign <= args.max_foreign
                       and bench.get("warm_samples_per_s") is not None,
                       "bench": bench, "harness": harness}
                runs.append(run)
                print(json.dumps(run), flush=True)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(run) + "\n")
    _summary(runs, cases)


# -- profile: where a PS step's time goes, from a py-spy recording --------------------------------
# A worker's main-thread sample under train_epochs goes to the first bucket one of whose
# functions is on its stack (order matters: a wait inside a lookup is a wait).
WORKER_BUCKETS = (
    ("waiting for a server's reply", ("Handle.wait",)),
    ("sparse lookup: de-dup, request, row mapping", ("RemoteSparseBackend.", "KVClient.pull")),
    ("backward (torch autograd)", ("_engine_run_backward",)),
    ("dense parameters: flatten, copy in/out", ("ModelLayout.dense_", "ModelLayout.load_dense")),
    ("sparse gradients: collect", ("ModelLayout.sparse_grads", "pop_gradients")),
    ("communicator step: queue, merge, send", ("Communicator.step",)),
    ("metrics (AUC histogram)", ("AUC.update",)),
    ("torch optimizer step (GEO, plain torch)", ("Optimizer.profile_hook_step",)),
    ("forward (torch)", ("Module._call_impl",)),
)
IDLE = ("Condition.wait", "Event.wait", "_recv_into", "socket.accept", "Heartbeats._run",
        "select", "sleep")


def _stacks(path: str):
    """``(process, thread, [function names], samples)`` per line of a py-spy raw file recorded
    with ``--subprocesses --threads --idle``."""
    for line in open(path):
        stack, count = line.rstrip("\n").rsplit(" ", 1)
        frames = stack.split(";")
        procs = [i for i, f in enumerate(frames) if f.startswith("process ")]
        if not procs:
            continue
        rest = frames[procs[-1] + 1:]
        thread = rest[0] if rest and rest[0].startswith("thread ") else ""
        names = [f.split(" (", 1)[0] for f in rest[1 if thread else 0:]]
        yield frames[procs[-1]].split(":", 1)[0], thread.split(": ", 1)[-1], names, int(count)


def _bucket(names: list) -> str:
    for label, keys in WORKER_BUCKETS:
        if any(n.startswith(k) or ("." + k) in n or n.endswith(k) for n in names for k in keys):
            return label
    return "other (loop, loss, zero_grad)"


def _worker_split(stacks: list) -> dict:
    split: dict = {}
    for _, thread, names, n in stacks:
        if thread == "MainThread" and "train_epochs" in names:
            split[_bucket(names)] = split.get(_bucket(names), 0) + n
    return split


def _server_split(stacks: list) -> tuple:
    """(per thread kind: [busy, all] samples; busy samples per innermost function)."""
    threads: dict = {}
    leaves: dict = {}
    for _, thread, names, n in stacks:
        if not thread.startswith("ps-") or thread == "ps-heartbeat" or not names:
            continue
        kind = thread.split(" ", 1)[0]
        busy = not any(names[-1].startswith(i) for i in IDLE)
        counts = threads.setdefault(kind, [0, 0])
        counts[0] += n if busy else 0
        counts[1] += n
        if busy:
            leaves[f"{kind}: {names[-1]}"] = leaves.get(f"{kind}: {names[-1]}", 0) + n
    return threads, leaves


def cmd_profile(args: argparse.Namespace) -> None:
    stacks = list(_stacks(args.raw))
    roles: dict = {}
    for proc, _, names, _ in stacks:
        if "train_epochs" in names:
            roles[proc] = "worker"
        elif any(n.endswith("run_server") for n in names):
            roles.setdefault(proc, "server")
    for proc in sorted(roles):
        mine = [s for s in stacks if s[0] == proc]
        if roles[proc] == "worker":
            split = _worker_split(mine)
            print(f"{proc} worker: main thread while training, {sum(split.values())} samples")
        else:
            threads, split = _server_split(mine)
            busy = ", ".join(f"{k} {b}" for k, (b, _) in threads.items())
            print(f"{proc} server: busy samples per thread: {busy}; by function:")
        total = sum(split.values())
        for label, n in sorted(split.items(), key=lambda kv: -kv[1])[:args.top]:
            print(f"  {100 * n / max(total, 1):5.1f}%  {label}")


def add_compare_parser(sub) -> None:
    p = sub.add_parser("compare")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated: {', '.join(CASES)}")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--data", default=DEFAULT_DATA)
    p.add_argument("--lines", type=int, default=200_000, help="generated when --data is empty")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--paddle-py", default=os.environ.get("PADDLE_PS_PY",
                                                         "/tmp/paddle26-venv/bin/python"))
    p.add_argument("--max-foreign", type=float, default=0.1,
                   help="drop runs during which other jobs used more cores than this")
    p.add_argument("--max-wait", type=float, default=120,
                   help="seconds the harness waits for a quiet machine before each run")
    p.add_argument("--out", help="also append every run as a JSON line to this file")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    for name in ("train", "run", "transports", "local"):
        p = sub.add_parser(name)
        p.add_argument("--data", default=DEFAULT_DATA, help="folder of Criteo-format part-* files")
        p.add_argument("--epochs", type=int, default=3)
        p.add_argument("--batch", type=int, default=pc.BATCH, help="per worker")
        if name == "local":
            continue
        p.add_argument("--mode", choices=("async", "geo", "sync"), default="async")
        p.add_argument("--k-steps", type=int, default=100, help="GEO exchange interval")
        p.add_argument("--table", choices=("sparse", "embedding"), default="sparse",
                       help="fleetx.nn.SparseEmbedding (rows on first touch) or "
                            "nn.Embedding(1000001, 16, sparse=True)")
        p.add_argument("--sparse-rule", choices=("sgd", "adam"), default="sgd",
                       help="the table's server rule (adam: as Paddle's async applies)")
        p.add_argument("--no-prefetch", dest="prefetch", action="store_false",
                       help="iterate the batches directly, not through fleet.prefetch")
        p.add_argument("--recv-every", type=ps_speedup.at_least_one, default=1,
                       help="async: the dense weights come back every N pushes "
                            "(a_sync_configs independent_recv_thread + "
                            "min_send_grad_num_before_recv); 1: every push (the default)")
        if name == "train":
            p.add_argument("--result", required=True, help="JSON lines file, one per worker")
            p.add_argument("--quiet", action="store_true")
        else:
            p.add_argument("--servers", type=int, default=1)
            p.add_argument("--workers", type=int, default=2)
            p.add_argument("--timeout", type=float, default=600)
        if name == "run":
            p.add_argument("--transport", choices=TRANSPORTS, default="tcp",
                           help="FLEETX_PS_TRANSPORT of every process")
        elif name == "transports":
            p.add_argument("--transports", default="tcp,zmq",
                           help=f"comma-separated, the first is the reference: {TRANSPORTS}")
            p.add_argument("--rounds", type=int, default=5)
            p.add_argument("--out", help="also append every run as a JSON line to this file")
    add_compare_parser(sub)
    ps_speedup.add_parser(sub, DEFAULT_DATA)
    p = sub.add_parser("profile", help="summarise a py-spy raw recording of a train job")
    p.add_argument("raw", help="py-spy record --subprocesses --threads --idle -f raw output")
    p.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    {"train": cmd_train, "run": cmd_run, "transports": cmd_transports, "local": cmd_local,
     "compare": cmd_compare, "speedup": cmd_speedup, "profile": cmd_profile}[args.command](args)


if __name__ == "__main__":
    main()
