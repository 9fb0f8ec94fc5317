"""Load and soak: 2 servers x 4 async workers on the CTR workload, server 0 killed mid-way.

One job under the real ``fleetrun --server_num 2 --worker_num 4 --max_restarts 1`` (server
failover on), training the workload of ``benchmarks/ps_ctr.py`` (``ps_common.py``: the
generated Criteo-format data, the wide & deep model, SGD, batch 512 per worker) for
``--duration`` seconds. At ``--kill-at`` seconds (default: the middle) this script sends
SIGKILL to server 0; fleetrun restarts it, it loads its latest snapshot, the workers reconnect.
Time 0 is the first worker's first step (the workers start together, after the start barrier
of ``init_worker``); each worker trains until its own start + ``--duration``.

What it records (``--out``, JSON, and a printed summary):

* throughput over time: the whole job's samples/s per ``--interval`` bucket (default 5 s),
  from every worker's per-step timestamps; bucket edges fall on the kill time, partial
  buckets at either end are dropped;
* each server's resident memory over time (``VmRSS`` of ``/proc/<pid>/status`` every
  ``--sample-s``, the restarted server followed by its new pid, which every server process
  writes at start), and its growth over the last half before the kill and over the last half
  of the time after the kill (after the restart, for server 0): ``flat`` when it grew by at
  most ``--flat-pct`` percent;
* pull and push latency p50 / p99 / p999, send to reply, as the clients measured them
  (``KVClient.latency``), all workers merged: before the kill (up to 0.5 s before it), after
  it (requests sent again to the restarted server count from their first send), and in total;
* the time back to full throughput, RECOVERY: from the kill to the END of the first bucket
  that starts at or after the kill and whose samples/s reach ``--recovered`` (0.9) of the
  median of the buckets wholly before the kill (the first bucket left out of that median when
  there are at least three: it creates the table rows); None when no bucket does. An upper
  bound, at the resolution of one bucket.

By default the job runs through the reference scripts' ``harness.py``, which waits for a quiet
machine and reports the other jobs' CPU meanwhile (``benchmarks/README.md``); ``--bare`` runs
it directly (tests, a smoke run).

Usage:
    python benchmarks/ps_soak.py run --out /tmp/ps_soak.json          # 10 minutes
    python benchmarks/ps_soak.py run --duration 40 --kill-at 20 --bare --out /tmp/soak.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

if __name__ == "__main__":  # one thread per process, before torch starts; not on import (tests)
    for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(_var, "1")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT_DATA = "/tmp/fleetx_criteo"
SERVERS, WORKERS = 2, 4
BEFORE_MARGIN_S = 0.5  # the workers' "before the kill" latencies end this long before it


# -- train: the script every fleetrun process runs -------------------------------------------
def _capture_clients() -> list:
    """The KVClients this process starts (its communicator's), to read their latencies."""
    from fleetx.ps.client import KVClient
    clients, start = [], KVClient.start

    def capturing(self) -> None:
        clients.append(self)
        start(self)
    KVClient.start = capturing
    return clients


def cmd_train(args: argparse.Namespace) -> None:
    import torch
    import ps_common as pc
    from fleetx import fleet
    from ps_ctr import make_embedding
    torch.set_num_threads(1)
    torch.manual_seed(0)  # every role builds the same model
    fleet.init()
    strategy = fleet.DistributedStrategy()
    strategy.a_sync = True
    model = fleet.distributed_model(pc.CTRModel(make_embedding("sparse", "sgd")))
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=pc.LR), strategy)
    out = Path(args.dir)
    if fleet.is_server():
        with open(out / f"server{fleet.server_index()}.pid", "a") as f:
            f.write(f"{os.getpid()}\n")  # the driver samples this process's memory
        fleet.init_server()
        fleet.run_server()
        return
    data = pc.read_criteo(fleet.util.get_file_shard(pc.data_files(args.data)))
    clients = _capture_clients()
    fleet.init_worker()
    rank = fleet.worker_index()
    record = _train_for(model, opt, data, args, clients[0], out / f"progress{rank}",
                        out / f"start{rank}")
    fleet.stop_worker()
    (out / f"worker{rank}.json").write_text(json.dumps({"worker": rank, **record}))


def _train_for(model, opt, data, args, client, progress: Path, start_file: Path) -> dict:
    """Train epoch after epoch until ``--duration`` seconds after the first step; one line
    ``<time> <samples> <loss>`` per step into ``progress``. Returns the latency histograms."""
    import torch
    from fleetx import fleet
    loss_fn = torch.nn.BCEWithLogitsLoss()
    table = model.module.embedding  # the rows of the next batch travel while one trains
    began = time.time()
    start_file.with_suffix(".tmp").write_text(f"{began}\n")
    os.replace(start_file.with_suffix(".tmp"), start_file)  # the driver never reads half of it
    before: list = []
    timer = threading.Timer(max(0.0, args.kill_at - BEFORE_MARGIN_S),
                            lambda: before.append(client.latency(histograms=True)))
    timer.daemon = True
    timer.start()
    steps, flushed = 0, began
    with open(progress, "w") as f:
        while time.time() < began + args.duration:
            batches = data.batches(args.batch)
            for ids, dense, label in fleet.prefetch(batches, lambda b: {table: b[0]}):
                loss = loss_fn(model(ids, dense), label)
                opt.minimize(loss)
                now = time.time()
                f.write(f"{now:.4f} {len(label)} {float(loss):.5f}\n")
                steps += 1
                if now - flushed >= 1.0:
                    f.flush()
                    flushed = now
                if now >= began + args.duration:
                    break
    timer.cancel()
    total = client.latency(histograms=True)
    lat = {"total": total.to_json()}
    if before:
        lat.update(before=before[0].to_json(), after=total.minus(before[0]).to_json())
    return {"start": began, "steps": steps, "latency": lat}


# -- pure analysis (unit-tested on synthetic input) --------------------------------------------
def throughput(steps: list, start: float, end: float, width: float, anchor: float) -> list:
    """``[(bucket start, samples/s)]`` of every whole bucket inside ``[start, end)``; edges at
    ``anchor + k * width``; ``steps``: ``(time, samples)`` of every worker's steps."""
    first = anchor + math.ceil((start - anchor) / width) * width
    count = max(0, int((end - first) // width))
    sums = [0] * count
    for t, n in steps:
        k = int((t - first) // width)
        if 0 <= k < count:
            sums[k] += n
    return [(first + k * width, s / width) for k, s in enumerate(sums)]


def recovery(buckets: list, width: float, kill: float, fraction: float = 0.9) -> dict:
    """Time from ``kill`` to the end of the first bucket starting at or after it whose rate
    reaches ``fraction`` of the median rate of the buckets wholly before it (the first of those
    left out when three or more: it creates the table rows). ``recovered_s`` None: never."""
    before = [r for t, r in buckets if t + width <= kill]
    if len(before) >= 3:
        before = before[1:]
    baseline = statistics.median(before) if before else None
    out = {"baseline_samples_per_s": baseline, "fraction": fraction, "recovered_s": None,
           "buckets_before": len(before)}
    if baseline:
        for t, r in buckets:
            if t >= kill and r >= fraction * baseline:
                out["recovered_s"] = round(t + width - kill, 3)
                break
    return out


def growth(samples: list, t_from: float, t_to: float, flat_pct: float) -> Optional[dict]:
    """Resident memory growth over ``[t_from, t_to]`` from ``(time, bytes)`` samples: the last
    sample in it against the first; ``flat`` when at most ``flat_pct`` percent. None: fewer
    than two samples there."""
    inside = [(t, b) for t, b in samples if t_from <= t <= t_to]
    if len(inside) < 2:
        return None
    (t0, b0), (t1, b1) = inside[0], inside[-1]
    pct = 100.0 * (b1 - b0) / b0 if b0 else float("inf")
    return {"from_s": round(t0, 1), "to_s": round(t1, 1), "first_bytes": b0, "last_bytes": b1,
            "growth_bytes": b1 - b0, "growth_pct": round(pct, 2), "flat": pct <= flat_pct}


def latency_summary(workers: list, part: str) -> dict:
    """Every worker's ``part`` histograms merged: ``{kind: {count, p50, p99, p999}}`` (s)."""
    from fleetx.ps.latency import Latencies
    lats = [Latencies.from_json(w["latency"][part]) for w in workers if part in w["latency"]]
    return Latencies.combined(lats).summary() if lats else {}


# -- run: the job, watched -----------------------------------------------------------------------
class Watch:
    """Samples the servers' memory, starts the clock at the workers' first step, kills server 0.

    Args:
        out: the folder the job's processes write their pids, starts and progress into.
        kill_at: seconds after the first step; ``sample_s``: seconds between memory samples.
    """

    def __init__(self, out: Path, kill_at: float, sample_s: float) -> None:
        self.out, self.kill_at, self.sample_s = out, kill_at, sample_s
        self.memory: dict = {s: [] for s in range(SERVERS)}   # server -> [(time, pid, bytes)]
        self.pids: dict = {s: [] for s in range(SERVERS)}     # server -> [(pid, first seen)]
        self.t0: Optional[float] = None
        self.kill: Optional[float] = None
        self.killed_pid: Optional[int] = None

    def run(self, proc: subprocess.Popen, deadline: float):
        """Until the job ends: its exit code, or ``"timeout"`` (then it was killed)."""
        while proc.poll() is None:
            now = time.time()
            if now > deadline:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return "timeout"
            self.sample(now)
            if self.t0 is None:
                self.t0 = self.started()
            elif self.kill is None and now >= self.t0 + self.kill_at:
                self.kill_server(0)
            wake = self.sample_s if self.t0 is None or self.kill is not None else \
                min(self.sample_s, max(0.01, self.t0 + self.kill_at - time.time()))
            time.sleep(wake)
        return proc.returncode

    def sample(self, now: float) -> None:
        for s in range(SERVERS):
            pid = self.pid(s)
            if pid is None:
                continue
            if not self.pids[s] or self.pids[s][-1][0] != pid:
                self.pids[s].append((pid, now))
            rss = vm_rss(pid)
            if rss is not None:
                self.memory[s].append((now, pid, rss))

    def pid(self, server: int) -> Optional[int]:
        """The pid server ``server``'s latest process wrote (a restarted one writes anew)."""
        path = self.out / f"server{server}.pid"
        lines = path.read_text().split() if path.exists() else []
        return int(lines[-1]) if lines else None

    def started(self) -> Optional[float]:
        """The first worker's first step, once every worker wrote its start."""
        files = [self.out / f"start{r}" for r in range(WORKERS)]
        texts = [f.read_text().strip() if f.exists() else "" for f in files]
        return min(float(t) for t in texts) if all(texts) else None

    def kill_server(self, server: int) -> None:
        self.killed_pid = self.pid(server)
        os.kill(self.killed_pid, signal.SIGKILL)
        self.kill = time.time()


def vm_rss(pid: int) -> Optional[int]:
    """Resident memory of ``pid`` in bytes (``VmRSS``), None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None  # a zombie has no VmRSS line


def run_job(args: argparse.Namespace) -> dict:
    """Launch the job under fleetrun, watch it, return its analysed record."""
    work = Path(tempfile.mkdtemp(prefix="fleetx_ps_soak_"))
    out, log_dir = work / "out", work / "log"
    out.mkdir()
    interval = ["--checkpoint_interval", args.checkpoint_interval] \
        if args.checkpoint_interval else []
    cmd = [sys.executable, "-m", "fleetx.launch", "--server_num", str(SERVERS), "--worker_num",
           str(WORKERS), "--max_restarts", "1", "--log_dir", str(log_dir), *interval,
           str(HERE / "ps_soak.py"), "train", "--dir", str(out), "--data",
           os.path.abspath(args.data), "--duration", str(args.duration), "--kill-at",
           str(args.kill_at), "--batch", str(args.batch)]
    watch = Watch(out, args.kill_at, args.sample_s)
    with open(work / "fleetrun.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=str(ROOT),
                                start_new_session=True)  # a hung job is killed as a whole
        rc = watch.run(proc, time.time() + args.duration + args.timeout)
    record = analyse(out, log_dir, watch, args)
    record["rc"] = rc
    if rc == 0 and not args.keep:
        shutil.rmtree(work)
    else:
        record["work_dir"] = str(work)
    return record


def read_steps(out: Path) -> dict:
    """worker -> ``[(time, samples)]`` from its progress file (a torn last line is skipped)."""
    steps = {}
    for r in range(WORKERS):
        path = out / f"progress{r}"
        rows = [line.split() for line in path.read_text().splitlines()] if path.exists() else []
        steps[r] = [(float(x[0]), int(x[1])) for x in rows if len(x) == 3]
    return steps


def analyse(out: Path, log_dir: Path, watch: Watch, args: argparse.Namespace) -> dict:
    """The job's record from what its processes and the watch wrote (times relative to the
    first step)."""
    steps = read_steps(out)
    workers = [json.loads(p.read_text()) for p in sorted(out.glob("worker*.json"))]
    record = {"bench": "fleetx_ps_soak", "servers": SERVERS, "workers": WORKERS,
              "mode": "async", "batch": args.batch, "duration_s": args.duration,
              "kill_at_s": args.kill_at, "interval_s": args.interval,
              "workers_reported": len(workers)}
    t0 = watch.t0
    if t0 is None or not all(steps.values()):
        return {**record, "error": "the workers did not all start training"}
    kill = watch.kill - t0 if watch.kill is not None else None
    end = min(s[-1][0] for s in steps.values()) - t0
    every = [(t - t0, n) for s in steps.values() for t, n in s]
    buckets = throughput(every, 0.0, end, args.interval, kill if kill is not None else 0.0)
    record["throughput"] = [[round(t, 3), round(r, 1)] for t, r in buckets]
    record["memory"] = _memory(watch, t0, kill, end, args.flat_pct)
    record["latency"] = {part: latency_summary(workers, part)
                         for part in ("before", "after", "total")}
    if kill is None:
        return {**record, "error": "server 0 was not killed (the job ended first)"}
    restarted = watch.pids[0][1:]
    record["kill"] = {"at_s": round(kill, 3), "pid": watch.killed_pid,
                      "restarted_pid": restarted[0][0] if restarted else None,
                      "restarted_pid_seen_s": round(restarted[0][1] - t0, 2) if restarted
                      else None, "workers_back_after_s": _back_after(log_dir)}
    record["recovery"] = recovery(buckets, args.interval, kill, args.recovered)
    late = kill + (end - kill) / 2
    record["steps_after_kill"] = {r: sum(t - t0 > kill for t, _ in s) for r, s in steps.items()}
    record["resumed"] = all(any(t - t0 > late for t, _ in s) for s in steps.values())
    return record


def _memory(watch: Watch, t0: float, kill: Optional[float], end: float, flat_pct: float) -> dict:
    """Per server: the samples ``[time, pid, bytes]`` and the growth over the last half before
    the kill and over the last half of the time after it (server 0: after its restart)."""
    out = {}
    for s, rows in watch.memory.items():
        rel = [(t - t0, pid, b) for t, pid, b in rows]
        entry: dict = {"samples": [[round(t, 2), pid, b] for t, pid, b in rel]}
        if kill is not None:
            before = [(t, b) for t, pid, b in rel if t < kill]
            entry["before_kill"] = growth(before, kill / 2, kill, flat_pct)
            after = [(t, b) for t, pid, b in rel if t > kill]
            if s == 0:  # the restarted process only
                after = [(t, b) for t, pid, b in rel if t > kill and pid != watch.killed_pid]
            since = after[0][0] if after else end
            entry["after_kill"] = growth(after, since + (end - since) / 2, end, flat_pct)
        out[f"server{s}"] = entry
    return out


def _back_after(log_dir: Path) -> dict:
    """worker -> seconds its log says server 0 was away ("... is back after X s")."""
    back = {}
    for r in range(WORKERS):
        path = log_dir / f"workerlog.{r}"
        m = re.search(r"server 0 \([^)]*\) is back after ([\d.]+) s",
                      path.read_text(errors="replace")) if path.exists() else None
        back[r] = float(m[1]) if m else None
    return back


# -- the printed summary -----------------------------------------------------------------------
def summary(rec: dict) -> str:
    lines = [f"ps_soak: {rec['servers']} servers x {rec['workers']} workers, async, "
             f"{rec['duration_s']:.0f} s, rc {rec.get('rc')}"]
    if "error" in rec:
        return "\n".join(lines + [f"error: {rec['error']}"])
    k, rec_ = rec["kill"], rec["recovery"]
    lines.append(f"server 0 (pid {k['pid']}) killed at {k['at_s']:.1f} s; restarted as pid "
                 f"{k['restarted_pid']}; workers say it was away {k['workers_back_after_s']} s")
    base = rec_["baseline_samples_per_s"]
    lines.append(f"throughput, samples/s per {rec['interval_s']:g} s bucket: median before the "
                 f"kill {base:.0f}" if base else "throughput: no bucket before the kill")
    lines.append("  " + " ".join(f"{r:.0f}" for _, r in rec["throughput"]))
    back = f"{rec_['recovered_s']} s after the kill (end of the first such bucket)" \
        if rec_["recovered_s"] is not None else "not within the run"
    lines.append(f"back to >= {rec_['fraction']:.0%} of it: {back}; resumed: {rec['resumed']}")
    for name, mem in rec["memory"].items():
        parts = [f"{when} {g['growth_bytes'] / 2**20:+.1f} MiB ({g['growth_pct']:+.1f} %, "
                 f"{'flat' if g['flat'] else 'NOT flat'})"
                 for when, g in ((w, mem.get(w)) for w in ("before_kill", "after_kill")) if g]
        last = mem["samples"][-1][2] / 2**20 if mem["samples"] else float("nan")
        lines.append(f"{name} RSS {last:.0f} MiB at the end; growth over the last half "
                     + ("; ".join(parts) or "-"))
    for part in ("before", "after", "total"):
        for kind in ("PULL", "PUSH"):
            q = rec["latency"].get(part, {}).get(kind)
            if q:
                lines.append(f"latency {part:6} {kind:4} n={q['count']:<8} p50 "
                             f"{q['p50'] * 1e3:8.3f} ms  p99 {q['p99'] * 1e3:8.3f} ms  "
                             f"p999 {q['p999'] * 1e3:9.3f} ms")
    return "\n".join(lines)


def cmd_run(args: argparse.Namespace) -> None:
    if not 0 < args.kill_at < args.duration:
        raise SystemExit(f"--kill-at {args.kill_at}: must be inside (0, --duration "
                         f"{args.duration})")
    if not args.bare:  # before anything else: a missing harness names itself and the fix
        import anchors
        anchors.require("harness.py")
    if not any(Path(args.data).glob("part-*")):  # as ps_ctr.py does, without importing torch
        subprocess.run([sys.executable, str(ROOT / "examples/wide_and_deep/gen_criteo.py"),
                        "--lines", str(args.lines), "--files", "10", "--out", args.data],
                       check=True)
    if not args.bare:
        return _through_harness(args)
    rec = run_job(args)
    Path(args.out).write_text(json.dumps(rec, indent=1))
    print(summary(rec), flush=True)
    print(f"record: {args.out}", flush=True)
    if rec.get("rc") != 0 or "error" in rec:
        sys.exit(1)


def _through_harness(args: argparse.Namespace) -> None:
    """Run this command again with ``--bare`` under ``harness.py`` (it waits for a quiet
    machine); add its reading (the other jobs' CPU meanwhile) to the record."""
    import anchors
    cmd = [sys.executable, str(anchors.require("harness.py")), "--max-wait",
           str(args.max_wait), "--", sys.executable, str(HERE / "ps_soak.py"),
           *sys.argv[1:], "--bare"]
    proc = subprocess.run(cmd, stderr=subprocess.PIPE, text=True, cwd=str(ROOT))
    lines = proc.stderr.splitlines()
    reading = [x for x in lines if x.startswith('{"harness"')]
    sys.stderr.write("\n".join(x for x in lines if not x.startswith('{"harness"')) + "\n")
    if reading and Path(args.out).exists():
        rec = json.loads(Path(args.out).read_text())
        rec["harness"] = json.loads(reading[-1])
        Path(args.out).write_text(json.dumps(rec, indent=1))
        print(f"harness: {reading[-1]}", flush=True)
    sys.exit(proc.returncode)


def main() -> None:
    sys.path.insert(0, str(HERE))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    for name in ("run", "train"):
        p = sub.add_parser(name)
        p.add_argument("--data", default=DEFAULT_DATA, help="folder of Criteo-format part-* files")
        p.add_argument("--duration", type=float, default=600.0, help="seconds of training")
        p.add_argument("--kill-at", type=float, default=None,
                       help="seconds after the first step (default: --duration / 2)")
        p.add_argument("--batch", type=int, default=512, help="per worker")
    train = sub.choices["train"]
    train.add_argument("--dir", required=True, help="where pids, starts and progress go")
    run = sub.choices["run"]
    run.add_argument("--out", default="/tmp/ps_soak.json", help="the JSON record")
    run.add_argument("--interval", type=float, default=5.0, help="throughput bucket, seconds")
    run.add_argument("--recovered", type=float, default=0.9,
                     help="fraction of the median throughput before the kill that counts as "
                          "full throughput again")
    run.add_argument("--flat-pct", type=float, default=5.0,
                     help="memory growth (percent) still called flat")
    run.add_argument("--sample-s", type=float, default=1.0, help="seconds between RSS samples")
    run.add_argument("--checkpoint-interval", default=None,
                     help="fleetrun's --checkpoint_interval (default: fleetrun's, 30 s)")
    run.add_argument("--lines", type=int, default=200_000,
                     help="lines generated into --data when it holds no part-* file")
    run.add_argument("--timeout", type=float, default=600.0,
                     help="seconds beyond --duration before the job is killed")
    run.add_argument("--keep", action="store_true", help="keep the job's folder (logs)")
    run.add_argument("--bare", action="store_true", help="run without the harness")
    run.add_argument("--max-wait", type=float, default=300.0,
                     help="seconds the harness waits for a quiet machine")
    args = ap.parse_args()
    if args.kill_at is None:
        args.kill_at = args.duration / 2
    (cmd_run if args.command == "run" else cmd_train)(args)


if __name__ == "__main__":
    main()
