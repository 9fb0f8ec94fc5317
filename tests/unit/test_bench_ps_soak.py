"""benchmarks/ps_soak.py: its pure analysis (throughput buckets, the recovery time, memory
flatness, merged latencies, the summary) on synthetic input; what the watch reads of the job's
files; and, in the slow stage, the whole benchmark at a short duration: 2 servers x 4 workers
under fleetrun, server 0 killed with SIGKILL and restarted, training resumed."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fleetx.ps.latency import Latencies

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import ps_soak  # noqa: E402


def _steady(t_from, t_to, dt=0.125, n=100):
    """One worker's steps: ``n`` samples every ``dt`` seconds (binary-exact times)."""
    k0, k1 = round(t_from / dt), round(t_to / dt)
    return [(k * dt, n) for k in range(k0, k1)]


def test_throughput_sums_every_worker_per_bucket_with_edges_on_the_anchor():
    steps = _steady(0, 20) + _steady(0, 20)            # two workers, 800 samples/s each
    buckets = ps_soak.throughput(steps, 0.0, 20.0, 5.0, anchor=12.0)
    # edges at 12 + 5k; the partial buckets [0, 2) and [17, 20) are dropped
    assert buckets == [(2.0, 1600.0), (7.0, 1600.0), (12.0, 1600.0)]
    stalled = [s for s in steps if not 12.0 <= s[0] < 14.5]   # nothing for 2.5 s after 12
    assert ps_soak.throughput(stalled, 0.0, 20.0, 5.0, 12.0)[2] == (12.0, 800.0)
    assert ps_soak.throughput(steps, 0.0, 4.0, 5.0, 0.0) == []   # no whole bucket


def test_recovery_is_the_end_of_the_first_bucket_back_at_90_percent_of_the_median_before():
    rates = [10, 100, 90, 100, 10, 80, 95, 100]     # warm-up, steady, kill at 20, back at 30
    buckets = [(5.0 * i, float(r)) for i, r in enumerate(rates)]
    rec = ps_soak.recovery(buckets, 5.0, kill=20.0)
    # the warm-up bucket is left out of the median: 100, not the 95 of (10, 100, 90, 100)
    assert rec["baseline_samples_per_s"] == 100 and rec["buckets_before"] == 3
    assert rec["recovered_s"] == 15.0                 # bucket [30, 35): 95 >= 90
    assert ps_soak.recovery(buckets, 5.0, 20.0, fraction=0.99)["recovered_s"] == 20.0
    # the kill inside a bucket: [15, 20) is not wholly before it, [20, 25) is not at or after
    assert ps_soak.recovery(buckets, 5.0, 17.0)["recovered_s"] == 18.0
    # two buckets before: both count; none before: no baseline, no recovery
    rec = ps_soak.recovery([(0.0, 60.0), (5.0, 100.0), (10.0, 75.0)], 5.0, 10.0)
    assert rec["baseline_samples_per_s"] == 80 and rec["recovered_s"] == 5.0
    assert ps_soak.recovery([(0.0, 1.0)], 5.0, 0.0)["recovered_s"] is None
    never = [(0.0, 100.0), (5.0, 100.0), (10.0, 100.0), (15.0, 50.0), (20.0, 89.0)]
    assert ps_soak.recovery(never, 5.0, 15.0)["recovered_s"] is None


def test_growth_over_a_window_and_flatness():
    mib = 2 ** 20
    samples = [(float(t), 100 * mib + (t * mib if t < 10 else 10 * mib)) for t in range(31)]
    early = ps_soak.growth(samples, 0, 10, flat_pct=5)
    assert early["growth_bytes"] == 10 * mib and early["growth_pct"] == 10.0
    assert not early["flat"]
    late = ps_soak.growth(samples, 15, 30, flat_pct=5)
    assert late["growth_bytes"] == 0 and late["flat"] and late["from_s"] == 15.0
    slow = ps_soak.growth([(0.0, 100), (10.0, 104)], 0, 10, flat_pct=5)
    assert slow["flat"] and slow["growth_pct"] == 4.0
    assert ps_soak.growth(samples, 40, 50, 5) is None     # no sample there
    assert ps_soak.growth(samples[:1], 0, 50, 5) is None   # one sample: no growth to tell


def _worker(before_ns, after_ns):
    lat, total = Latencies(), Latencies()
    for ns in before_ns:
        lat.of("PULL").add(ns)
        total.of("PULL").add(ns)
    for ns in after_ns:
        total.of("PULL").add(ns)
    return {"latency": {"before": lat.to_json(), "after": total.minus(lat).to_json(),
                        "total": total.to_json()}}


def test_latencies_of_every_worker_are_merged_per_part():
    workers = [_worker([1000] * 99, [5_000_000_000]), _worker([1000] * 100, [2000] * 100)]
    got = {p: ps_soak.latency_summary(workers, p) for p in ("before", "after", "total")}
    assert got["before"]["PULL"]["count"] == 199 and got["after"]["PULL"]["count"] == 101
    assert got["total"]["PULL"]["count"] == 300
    assert abs(got["after"]["PULL"]["p999"] / 5.0 - 1) < 0.01   # the outage is in the tail
    assert abs(got["before"]["PULL"]["p999"] / 1e-6 - 1) < 0.01
    assert ps_soak.latency_summary([{"latency": {"total": {}}}], "before") == {}


def test_the_watch_reads_pids_starts_and_memory(tmp_path):
    watch = ps_soak.Watch(tmp_path, kill_at=10, sample_s=1)
    assert watch.pid(0) is None and watch.started() is None
    (tmp_path / "server0.pid").write_text(f"123\n{os.getpid()}\n")   # restarted: the last
    assert watch.pid(0) == os.getpid()
    for r in range(ps_soak.WORKERS - 1):
        (tmp_path / f"start{r}").write_text(f"{100.0 + r}\n")
    assert watch.started() is None                      # one worker has not started
    (tmp_path / f"start{ps_soak.WORKERS - 1}").write_text("99.5\n")
    assert watch.started() == 99.5
    watch.sample(5.0)
    assert watch.pids[0] == [(os.getpid(), 5.0)] and watch.pids[1] == []
    (t, pid, rss), = watch.memory[0]
    assert (t, pid) == (5.0, os.getpid()) and rss > 10 * 2 ** 20
    assert ps_soak.vm_rss(2 ** 22 + 12345) is None       # no such process


def test_progress_lines_and_a_torn_last_line(tmp_path):
    (tmp_path / "progress0").write_text("10.5 512 0.69\n11.0 512 0.68\n11.5 51")
    steps = ps_soak.read_steps(tmp_path)
    assert steps[0] == [(10.5, 512), (11.0, 512)] and steps[1] == []


def test_summary_names_the_kill_recovery_memory_and_latencies():
    rec = {"servers": 2, "workers": 4, "duration_s": 60.0, "rc": 0, "interval_s": 5.0,
           "kill": {"at_s": 30.0, "pid": 11, "restarted_pid": 12,
                    "workers_back_after_s": {"0": 3.5}},
           "recovery": {"baseline_samples_per_s": 1000.0, "fraction": 0.9,
                        "recovered_s": 10.0},
           "throughput": [[0.0, 990.0], [5.0, 1000.0]], "resumed": True,
           "memory": {"server0": {"samples": [[1.0, 11, 2 ** 30]], "before_kill": {
               "growth_bytes": 2 ** 20, "growth_pct": 0.1, "flat": True}, "after_kill": None}},
           "latency": {"total": {"PULL": {"count": 9, "p50": 0.001, "p99": 0.002,
                                          "p999": 0.5}}}}
    text = ps_soak.summary(rec)
    assert "server 0 (pid 11) killed at 30.0 s; restarted as pid 12" in text
    assert "median before the kill 1000" in text and "990 1000" in text
    assert "back to >= 90% of it: 10.0 s after the kill" in text
    assert "server0 RSS 1024 MiB at the end" in text and "+1.0 MiB (+0.1 %, flat)" in text
    assert "latency total  PULL n=9" in text and "p999   500.000 ms" in text
    assert "error: boom" in ps_soak.summary({**rec, "error": "boom"})


@pytest.mark.parametrize("kill_at", ["0", "30", "-1"])
def test_a_kill_outside_the_run_is_refused(kill_at):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/ps_soak.py"), "run",
                           "--duration", "30", "--kill-at", kill_at, "--bare"],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode != 0
    assert f"--kill-at {float(kill_at)}: must be inside (0, --duration 30.0)" in proc.stderr


def test_without_the_harness_it_stops_first_naming_it_and_the_fix(tmp_path):
    data = tmp_path / "data"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/ps_soak.py"), "run",
                           "--data", str(data)], capture_output=True, text=True, cwd=ROOT,
                          timeout=60, env={**os.environ, "FLEETX_ANCHORS": str(tmp_path)})
    assert proc.returncode == 1
    assert "needs the reference script harness.py" in proc.stderr
    assert not data.exists()                           # nothing generated, nothing started


@pytest.mark.slow
def test_the_soak_benchmark_runs_short_and_training_resumes_after_the_kill(tmp_path):
    data, out = tmp_path / "data", tmp_path / "soak.json"
    subprocess.run([sys.executable, str(ROOT / "examples/wide_and_deep/gen_criteo.py"),
                    "--lines", "8000", "--files", "4", "--out", str(data)], check=True,
                   capture_output=True)
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/ps_soak.py"), "run",
                           "--duration", "30", "--kill-at", "15", "--data", str(data),
                           "--checkpoint-interval", "5s", "--bare", "--out", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rec = json.loads(out.read_text())
    assert rec["rc"] == 0 and rec["workers_reported"] == 4 and "error" not in rec
    assert rec["kill"]["restarted_pid"] not in (None, rec["kill"]["pid"])
    assert abs(rec["kill"]["at_s"] - 15) < 2
    assert all(v is not None for v in rec["kill"]["workers_back_after_s"].values())
    assert rec["resumed"] and all(n > 0 for n in rec["steps_after_kill"].values())
    times = [t for t, _ in rec["throughput"]]
    assert len(times) >= 4 and all(b - a == pytest.approx(5.0) for a, b in zip(times, times[1:]))
    assert rec["throughput"][-1][1] > 0                # samples in the last bucket
    assert set(rec["recovery"]) == {"baseline_samples_per_s", "fraction", "recovered_s",
                                    "buckets_before"}
    for s in ("server0", "server1"):
        mem = rec["memory"][s]
        assert mem["samples"] and set(mem) == {"samples", "before_kill", "after_kill"}
        assert mem["before_kill"] is not None and "flat" in mem["before_kill"]
    pids = {pid for _, pid, _ in rec["memory"]["server0"]["samples"]}
    assert pids == {rec["kill"]["pid"], rec["kill"]["restarted_pid"]}   # followed the restart
    for part in ("before", "after", "total"):
        for kind in ("PULL", "PUSH"):
            q = rec["latency"][part][kind]
            assert q["count"] > 0 and 0 < q["p50"] <= q["p99"] <= q["p999"]
    assert rec["latency"]["total"]["PULL"]["count"] == \
        rec["latency"]["before"]["PULL"]["count"] + rec["latency"]["after"]["PULL"]["count"]
    assert "back to >= 90% of it" in proc.stdout
