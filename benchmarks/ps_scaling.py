"""Parameter-server scaling: measure the model's inputs, check it against real jobs, predict.

The model (``benchmarks/ps_model.py``, formulas in ``docs/scaling.md``) turns a handful of
measured costs into a job's samples/s and its bottleneck for any number of servers, workers,
cores and network bandwidth. Subcommands:

``partition`` the partition function's balance (pure computation, no timing): the hottest
            server's share of the ids over the mean, for Zipf-skewed ids at several skews and
            for the CTR workload's own ids, at several numbers of servers; with and without
            the client's per-batch de-duplication (which is what makes hot ids cheap);
``memory``  bytes a table holds per row, per rule (``ps_memory.py`` in a fresh process, ``--rows``);
``inputs``  everything the model needs, into one JSON (``--out``): one shard's kernel rates
            and the fixed CPU of a request (``benchmarks/ps_table.py``), the worker's compute
            (``ps_ctr.py local``), one job per mode with 1 server and 1 worker
            (``ps_ctr.py run``: CPU, waits, requests and bytes per step, counted in the
            processes), the workload's ids per step, the partition balance, the memory;
``validate`` jobs with 1, 2 and 4 servers (``ps_ctr.py run``), measured against predicted,
            side by side; ``--cores`` is what the processes share (on a 2-core machine, 4
            servers and 2 workers share 2 cores);
``predict`` the model alone, from an inputs JSON: limits and bottleneck of a cluster (by
            default 100 servers, 1,000 workers, 25 Gbit/s), and the memory of its servers.

Usage (a quiet machine; docs/scaling.md has the full campaign and its timings):
    python benchmarks/ps_scaling.py partition
    python benchmarks/ps_scaling.py inputs --out /tmp/ps_inputs.json
    python benchmarks/ps_scaling.py validate --inputs /tmp/ps_inputs.json --out /tmp/ps_val.jsonl
    python benchmarks/ps_scaling.py predict --inputs /tmp/ps_inputs.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

import ps_model as pm
from fleetx.ps.api import PSConfig, RuleConfig
from fleetx.ps.partition import server_of
from fleetx.ps.rules import make_rule

HERE = Path(__file__).resolve().parent
SHARD_NUM = PSConfig(("127.0.0.1:1",), 1).shard_num      # the default a job runs with
RULES = ("sgd", "adagrad", "adam")
SLOTS, BATCH, DIM = 26, 512, 16                           # the CTR workload (ps_common.py)
GBIT = 1e9 / 8


# -- partition: how evenly the partition function spreads ids --------------------------------
def zipf_batches(skew: float, vocab: int, batches: int, size: int, seed: int = 0) -> list:
    """``batches`` arrays of ``size`` ids drawn from ``vocab`` random 63-bit keys, key of rank
    ``r`` with probability proportional to ``r ** -skew`` (0: uniform)."""
    rng = np.random.default_rng(seed)
    keys = rng.integers(1, 2 ** 63 - 1, size=vocab, dtype=np.int64)
    cdf = np.cumsum(np.arange(1, vocab + 1, dtype=np.float64) ** -skew)
    ranks = np.searchsorted(cdf / cdf[-1], rng.random((batches, size)))
    return list(keys[np.minimum(ranks, vocab - 1)])


def balance(batches: list, servers: int, shard_num: int = SHARD_NUM) -> dict:
    """The hottest server's load over the mean load, from ``fleetx.ps.partition.server_of``:

    ``ids``: distinct ids per batch summed over the batches (what servers' kernels see: the
    client de-duplicates each batch); ``ids_step``: the same per batch, averaged (what a sync
    round waits for); ``raw``: every occurrence, no de-duplication; ``rows``: the distinct ids
    of all batches (table rows); ``empty``: servers that own no row; ``top_id_share``: the most
    frequent id's share of all occurrences.
    """
    def per_server(ids):
        return np.bincount(server_of(ids, servers, shard_num), minlength=servers)
    uniq = [np.unique(b) for b in batches]
    counts = np.array([per_server(u) for u in uniq], np.float64)
    agg = counts.sum(axis=0)
    every = np.concatenate(batches)
    raw, rows = per_server(every), per_server(np.unique(every))
    _, freq = np.unique(every, return_counts=True)
    return {"ids": agg.max() / agg.mean(),
            "ids_step": float(np.mean(counts.max(axis=1) / counts.mean(axis=1))),
            "raw": raw.max() / raw.mean(), "rows": rows.max() / rows.mean(),
            "empty": int((rows == 0).sum()), "top_id_share": freq.max() / len(every)}


def workload_batches(data: str, batch: int = BATCH) -> list:
    """The CTR workload's ids, one flat array per batch of ``batch`` lines (full batches)."""
    import ps_common as pc
    ids = pc.read_criteo(pc.data_files(data)).ids
    return [ids[lo:lo + batch].reshape(-1) for lo in range(0, len(ids) - batch + 1, batch)]


def _fmt(b: dict) -> str:
    return (f"{b['ids']:>6.3f} {b['ids_step']:>8.3f} {b['raw']:>8.3f} {b['rows']:>6.3f} "
            f"{b['empty']:>5} {100 * b['top_id_share']:>7.2f}%")


def cmd_partition(args) -> None:
    servers = [int(s) for s in args.servers.split(",")]
    sets = {f"zipf {s}": zipf_batches(float(s), args.vocab, args.batches, args.batch_ids)
            for s in args.skews.split(",")}
    if args.data:
        sets["CTR workload"] = workload_batches(args.data)
    print(f"hottest server / mean; batches of {args.batch_ids} ids (Zipf: over {args.vocab:,} "
          f"keys, {args.batches} batches); shard_num {SHARD_NUM}")
    print(f"{'ids':>16} {'servers':>7} {'ids':>6} {'ids_step':>8} {'raw':>8} {'rows':>6} "
          f"{'empty':>5} {'top id':>8}")
    out = {}
    for name, batches in sets.items():
        out[name] = {s: balance(batches, s) for s in servers}
        for s, b in out[name].items():
            print(f"{name:>16} {s:>7} {_fmt(b)}", flush=True)
    print(json.dumps({"bench": "ps_partition", "shard_num": SHARD_NUM, "balance": out}))


# -- memory: bytes per row per rule -------------------------------------------------------------
def bytes_per_row(rule: str, rows: int, dim: int = DIM) -> dict:
    """A table of ``rows`` rows under ``rule``, filled in a fresh process by
    ``benchmarks/ps_memory.py`` (the one measurement of a table's memory): ``held`` is the
    resident memory the process gained per row once the allocator returned its free memory
    (``rss_trimmed``; at small row counts page granularity makes it noisy, so it is never taken
    below the table's own accounting, ``nbytes``), ``peak`` the peak resident memory per row
    while filling it, ``raw`` a row's values (weights and rule state, as ``raw B/row`` of the
    memory report; the key and index slots are in ``nbytes``)."""
    out = subprocess.run([sys.executable, str(HERE / "ps_memory.py"), "--case", rule,
                          "--rows", str(rows), "--dim", str(dim)], capture_output=True,
                         text=True, check=False)
    if out.returncode:
        raise SystemExit(f"ps_memory.py --case {rule}: {out.stderr[-2000:]}")
    m = json.loads(out.stdout.strip().splitlines()[-1])
    held = max(m["rss_trimmed_per_row"], m["nbytes_per_row"])
    return {"rows": rows, "held": held, "peak": m["peak_rss_per_row"],
            "nbytes": m["nbytes_per_row"], "raw": m["raw_bytes_per_row"]}


def base_bytes() -> int:
    """Peak RSS of a process that imported what a fleetx server imports (torch, fleetx.ps)."""
    code = "import resource, torch, fleetx.ps; " \
           "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)"
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              check=True).stdout.strip())


def memory(rows: int) -> dict:
    dense = {r: make_rule(RuleConfig(r)).width(10 ** 6) / 10 ** 6 for r in RULES}
    return {"bytes_per_row": {r: bytes_per_row(r, rows) for r in RULES},
            "dense_width": dense, "base_bytes": base_bytes()}


def cmd_memory(args) -> None:
    print(json.dumps({"bench": "ps_memory", **memory(args.rows)}))


# -- inputs: measure what the model needs ------------------------------------------------------
def _run(cmd: list, timeout: float) -> list:
    """Run a benchmark script; its JSON output lines (fails naming the command)."""
    # TCP only: the model is of a network, and processes of one machine would otherwise talk
    # through Unix-domain sockets, whose bytes the workers' socket counters do not see
    env = dict(os.environ, FLEETX_PS_LOCAL_SOCKETS="0")
    res = subprocess.run([sys.executable, *map(str, cmd)], capture_output=True, text=True,
                         timeout=timeout, cwd=HERE.parent, env=env)
    lines = [json.loads(x) for x in res.stdout.splitlines() if x.startswith("{")]
    if res.returncode or not lines:
        raise SystemExit(f"{' '.join(map(str, cmd))} failed (rc {res.returncode}):\n"
                         f"{res.stdout[-2000:]}{res.stderr[-3000:]}")
    return lines


def measure_costs(args) -> dict:
    """One shard's kernel rates, and the fixed CPU of a request on each side: what a batch
    costs more when fanned out to ``--fanout`` servers instead of 1, per extra request."""
    size = ["--rows", args.table_rows, "--batches", args.table_batches, "--windows", 3]
    kern = {r["bench"]: r for r in _run([HERE / "ps_table.py", *size], args.timeout)}
    one, many = ({r["bench"]: r for r in _run([HERE / "ps_table.py", "--wire", "--servers", n,
                                               *size], args.timeout)} for n in (1, args.fanout))

    def fixed(side):   # per extra request, mean of pull and push; noise may make it < 0
        extra = [(many[b][f"{side}_cpu_us_per_call"] - one[b][f"{side}_cpu_us_per_call"])
                 / (args.fanout - 1) for b in ("wire/pull", "wire/push/sgd")]
        return max(float(np.mean(extra)), 0.0) * 1e-6
    return {"server_request_s": fixed("server"), "client_request_s": fixed("client"),
            "pull_ids_per_s": kern["pull"]["median_ids_per_s"],
            "push_ids_per_s": {r: kern[f"push/{r}"]["median_ids_per_s"] for r in ("sgd", "adam")},
            "kernels": list(kern.values()), "wire": [*one.values(), *many.values()]}


def workload(args) -> dict:
    """Distinct ids per step (and per GEO exchange, per step) and the dense size."""
    import torch
    import ps_common as pc
    batches = workload_batches(args.data, args.batch)
    k = args.k_steps
    windows = [np.concatenate(batches[i:i + k]) for i in range(0, len(batches) - k + 1, k)]
    model = pc.CTRModel(torch.nn.Embedding(1, pc.EMB_DIM))
    return {"batch": args.batch, "batches": len(batches), "k_steps": k,
            "unique_ids_per_step": float(np.mean([len(np.unique(b)) for b in batches])),
            "geo_unique_ids_per_step": float(np.mean([len(np.unique(w)) for w in windows]) / k)
            if windows else None,
            "distinct_ids": int(len(np.unique(np.concatenate(batches)))),
            "dense_numel": sum(p.numel() for n, p in model.named_parameters()
                               if not n.startswith("embedding"))}


def _job(args, mode: str, servers: int, workers: int) -> dict:
    out = _run([HERE / "ps_ctr.py", "run", "--mode", mode, "--servers", servers, "--workers",
                workers, "--data", args.data, "--epochs", args.epochs, "--batch", args.batch,
                "--k-steps", args.k_steps, "--timeout", args.timeout], args.timeout + 60)[-1]
    if "counted" not in out:
        raise SystemExit(f"{mode} job with {servers} server(s) failed: {out}")
    if not out["counted"]["sent_bytes_per_sample"]:
        raise SystemExit(f"{mode} job with {servers} server(s): its workers' TCP sockets "
                         "counted no bytes (did they talk over Unix-domain sockets? "
                         "FLEETX_PS_LOCAL_SOCKETS must be 0)")
    return out


def calibrate(args, mode: str, work: dict) -> dict:
    """One job with 1 server and 1 worker: the mode's :class:`ps_model.ModeInputs`."""
    job = _job(args, mode, 1, 1)
    counted = job["counted"]
    fields = {f: counted[f] for f in ("worker_cpu_s_per_sample", "stall_s_per_step",
                                      "server_cpu_s_per_step", "requests_per_step",
                                      "sent_bytes_per_sample", "received_bytes_per_sample",
                                      "dense_sent_bytes_per_sample",
                                      "dense_received_bytes_per_sample", "frame_bytes")}
    ids = work["geo_unique_ids_per_step"] if mode == "geo" else work["unique_ids_per_step"]
    return {"batch": args.batch, **fields, "unique_ids_per_step": ids, "rule": "sgd",
            "samples_per_s": job["warm_samples_per_s"], "job": job}


def cmd_inputs(args) -> None:
    doc = {"bench": "ps_scaling_inputs", "cores": os.cpu_count(), "args": vars(args)}
    doc["costs"] = measure_costs(args)
    doc["workload"] = work = workload(args)
    local = _run([HERE / "ps_ctr.py", "local", "--data", args.data, "--epochs", args.epochs,
                  "--batch", args.batch], args.timeout)[-1]
    doc["compute"] = {"local_samples_per_s": local["warm_samples_per_s"],
                      "compute_s_per_sample": local["cpu_s_per_sample"]}
    doc["modes"] = {m: calibrate(args, m, work) for m in args.modes.split(",")}
    batches = workload_batches(args.data, args.batch)
    doc["balance"] = {str(s): balance(batches, s) for s in _ints(args.balance_servers)}
    doc["balance_zipf"] = {
        sk: {str(s): balance(zipf_batches(float(sk), 10 ** 6, 100, args.batch * SLOTS), s)
             for s in _ints(args.balance_servers)} for sk in args.skews.split(",")}
    doc["memory"] = memory(args.memory_rows)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(json.dumps({"bench": "ps_scaling_inputs", "out": args.out,
                      "modes": {m: v["samples_per_s"] for m, v in doc["modes"].items()}}))


def _ints(text: str) -> list:
    return [int(x) for x in text.split(",")]


# -- validate: predicted against measured, 1, 2 and 4 servers ----------------------------------
def cmd_validate(args) -> None:
    doc = json.load(open(args.inputs))
    costs = pm.costs(doc)
    print(f"{'mode':>5} {'S x W':>6} {'predicted':>10} {'measured':>9} {'meas/pred':>9} "
          f"{'bottleneck (predicted)':>24} {'srv CPU ms/step pred/meas':>26} "
          f"{'B/sample out pred/meas':>24}")
    for mode in args.modes.split(","):
        inputs = pm.mode_inputs(doc, mode)
        for s in _ints(args.servers):
            cluster = pm.Cluster(s, args.workers, cores=args.cores,
                                 balance=pm.balance_at(doc, s))
            p = pm.predict(inputs, costs, cluster)
            job = _job(args, mode, s, args.workers)
            c = job["counted"]
            row = {"bench": "ps_scaling_validate", "mode": mode, "servers": s,
                   "workers": args.workers, "cores": args.cores,
                   "predicted_samples_per_s": p.samples_per_s, "bottleneck": p.bottleneck,
                   "limits": p.limits, "measured_samples_per_s": job["warm_samples_per_s"],
                   "predicted_server_cpu_s_per_step": p.all_servers_s_per_step,
                   "predicted_bytes_per_sample": p.bytes, "counted": c}
            print(f"{mode:>5} {f'{s}x{args.workers}':>6} {p.samples_per_s:>10.0f} "
                  f"{job['warm_samples_per_s']:>9.0f} "
                  f"{job['warm_samples_per_s'] / p.samples_per_s:>9.2f} {p.bottleneck:>24} "
                  f"{1e3 * p.all_servers_s_per_step:>12.2f} / "
                  f"{1e3 * c.get('server_cpu_s_per_step', float('nan')):<11.2f} "
                  f"{p.bytes['worker_out']:>10.0f} / {c['sent_bytes_per_sample']:<10.0f}",
                  flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")


# -- predict: the model alone --------------------------------------------------------------------
def _balance(doc: dict, servers: int, skew) -> float:
    if skew is None:
        return pm.balance_at(doc, servers)
    skews = doc.get("balance_zipf", {})
    if skew not in skews:
        raise SystemExit(f"--skew {skew}: no balance measured at that skew; measured: "
                         f"{', '.join(skews) or 'none'} (inputs --skews)")
    return pm.balance_at({"balance": skews[skew]}, servers)


def cmd_predict(args) -> None:
    doc = json.load(open(args.inputs))
    costs = pm.costs(doc)
    costs = pm.Costs(costs.server_request_s * args.request_cost_scale,
                     costs.client_request_s * args.request_cost_scale, costs.pull_ids_per_s,
                     costs.push_ids_per_s)
    bw = args.bandwidth_gbit * GBIT if args.bandwidth_gbit else None
    compute = doc.get("compute", {}).get("compute_s_per_sample")
    for mode in args.modes.split(","):
        inputs = pm.mode_inputs(doc, mode)
        if compute:
            print(f"{mode}: a worker's CPU per sample {1e6 * inputs.worker_cpu_s_per_sample:.1f} "
                  f"us = the model's compute {1e6 * compute:.1f} us (plain PyTorch) + the PS "
                  f"client {1e6 * (inputs.worker_cpu_s_per_sample - compute):.1f} us")
        for s in _ints(args.servers):
            for w in _ints(args.workers):
                cluster = pm.Cluster(s, w, cores=args.cores, bandwidth_bytes_per_s=bw,
                                     balance=_balance(doc, s, args.skew), rtt_s=args.rtt)
                rule = None if mode == "geo" else args.rule   # GEO servers add deltas
                p = pm.predict(inputs, costs, cluster, rule)
                nxt, rate = p.next_bottleneck()
                limits = ", ".join(f"{k} {v:,.0f}" for k, v in sorted(p.limits.items(),
                                                                        key=lambda kv: kv[1]))
                print(f"{mode} {s} servers x {w} workers: {p.samples_per_s:,.0f} samples/s, "
                      f"bottleneck: {p.bottleneck}; then {nxt} ({limits})")
                print(json.dumps({"bench": "ps_scaling_predict", "mode": mode, "servers": s,
                                  "workers": w, "samples_per_s": p.samples_per_s,
                                  "bottleneck": p.bottleneck, "next": nxt, "limits": p.limits,
                                  "bytes_per_sample": p.bytes}))
    mem = doc["memory"]
    for rows in (float(r) for r in args.rows.split(",")):
        for s in _ints(args.servers):
            per = {r: pm.server_memory(rows, s, mem["bytes_per_row"][r]["held"],
                                       pm.balance_at(doc, s, "rows"),
                                       doc["workload"]["dense_numel"], mem["dense_width"][r],
                                       mem["base_bytes"]) for r in RULES}
            print(f"memory, {rows:.0e} rows over {s} servers: fullest server " + ", ".join(
                f"{r} {v / 2 ** 30:.2f} GiB" for r, v in per.items()))


def add_parsers(sub) -> None:
    p = sub.add_parser("partition", help="balance of the partition function (no timing)")
    p.add_argument("--servers", default="1,2,4,8,16,100,300,1000")
    p.add_argument("--skews", default="0,0.8,1.0,1.2,1.5", help="Zipf exponents (0: uniform)")
    p.add_argument("--vocab", type=int, default=10 ** 6)
    p.add_argument("--batches", type=int, default=200)
    p.add_argument("--batch-ids", type=int, default=BATCH * SLOTS)
    p.add_argument("--data", help="also the CTR workload's ids (a folder of part-* files)")
    p = sub.add_parser("memory", help="bytes per row per rule")
    p.add_argument("--rows", type=int, default=10 ** 6)
    for name in ("inputs", "validate"):
        p = sub.add_parser(name)
        p.add_argument("--data", default="/tmp/fleetx_criteo")
        p.add_argument("--epochs", type=int, default=3)
        p.add_argument("--batch", type=int, default=BATCH)
        p.add_argument("--k-steps", type=int, default=100, help="GEO exchange interval")
        p.add_argument("--modes", default="async,sync,geo")
        p.add_argument("--timeout", type=float, default=900, help="seconds per job")
        p.add_argument("--out", required=name == "inputs", help="JSON (lines) written here")
    p = sub.choices["inputs"]
    p.add_argument("--table-rows", type=int, default=10 ** 6, help="ps_table.py --rows")
    p.add_argument("--table-batches", type=int, default=200, help="ps_table.py --batches")
    p.add_argument("--fanout", type=int, default=4,
                   help="servers of the fan-out measurement (ps_table.py --wire --servers)")
    p.add_argument("--memory-rows", type=int, default=10 ** 6)
    p.add_argument("--balance-servers", default="1,2,4,8,16,100,300,1000")
    p.add_argument("--skews", default="0,1.0,1.2,1.5")
    p = sub.choices["validate"]
    p.add_argument("--inputs", required=True)
    p.add_argument("--servers", default="1,2,4")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--cores", type=float, default=os.cpu_count(),
                   help="cores the job's processes share (this machine's by default)")
    p = sub.add_parser("predict", help="the model alone, from an inputs JSON")
    p.add_argument("--inputs", required=True)
    p.add_argument("--modes", default="async,sync,geo")
    p.add_argument("--servers", default="100")
    p.add_argument("--workers", default="1000")
    p.add_argument("--cores", type=float, default=None,
                   help="cores all processes share (default: each process has its own)")
    p.add_argument("--bandwidth-gbit", type=float, default=25.0, help="per NIC, each way")
    p.add_argument("--rtt", type=float, default=0.0, help="network round trip, seconds")
    p.add_argument("--rule", choices=("sgd", "adam"), default=None,
                   help="the sparse rule (default: the measured jobs', SGD; GEO servers "
                        "always add deltas)")
    p.add_argument("--skew", default=None, help="use the balance of Zipf ids at this skew")
    p.add_argument("--request-cost-scale", type=float, default=1.0,
                   help="what if a request's fixed CPU were this many times today's")
    p.add_argument("--rows", default="1e8,1e9", help="table sizes for the memory prediction")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    add_parsers(sub)
    args = ap.parse_args()
    {"partition": cmd_partition, "memory": cmd_memory, "inputs": cmd_inputs,
     "validate": cmd_validate, "predict": cmd_predict}[args.command](args)


if __name__ == "__main__":
    main()
