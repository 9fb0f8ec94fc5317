"""Micro-benchmark of one parameter-server shard: ids/s through a SparseTable's pull and push.

Setting (mirrors the sparse-table anchors in the project's baselines): one table of
``--rows`` (1e6) rows of dim ``--dim`` (16) float32, already populated; batches of ``--batch``
(4096) ids, Zipf(1.1)-distributed over random 63-bit feasigns (hot ids scattered over the
table) or uniform; 64 pre-generated batches cycled; one thread. The ids are de-duplicated per
batch first, as a client does before the wire, so ids/s counts the unique ids the shard maps.

Measured per batch:
  pull       table.pull(ids): id -> row through the hash index + gather of the rows
  push/sgd   table.push(ids, grads) with the SGD rule (index + update in place)
  push/adam  same with the Adam rule (state columns 2*dim + 1)
  find       the index lookup alone

Each figure is the median over --windows windows of --batches batches after a warm-up; one JSON
line per measurement. ``--backend numpy`` runs the numpy fallback kernels instead of C.

``--wire`` measures the same through the network instead: ``--servers`` (1) server processes
(``python -m fleetx.ps serve``) over loopback and a KVClient in this process (pull: de-dup,
route, one request per server, rows received in place; push: the same with gradients, async
mode), and the CPU each side spends per call (``server_cpu_us_per_call``: all servers
together; ``client_cpu_us_per_call``). The difference between ``--servers 4`` and
``--servers 1`` is what fanning a batch out to 3 more servers costs: ``benchmarks/ps_scaling.py``
takes the fixed cost of a request from it.

Usage:  python benchmarks/ps_table.py [--dist zipf|uniform] [--backend c|numpy]
        python benchmarks/ps_table.py --wire [--servers N]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

if __name__ == "__main__":  # one thread per process, before torch starts; not on import (tests)
    for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402

from fleetx.ps import kernels  # noqa: E402
from fleetx.ps.api import InitConfig, PSConfig, RuleConfig, SparseTableSpec, Tables  # noqa
from fleetx.ps.client import KVClient  # noqa: E402
from fleetx.ps.rules import make_rule  # noqa: E402
from fleetx.ps.table import SparseTable  # noqa: E402
from ports import free_port  # noqa: E402

NB = 64


def make_batches(args, keys, rng):
    if args.dist == "uniform":
        idx = rng.integers(0, args.rows, size=(NB, args.batch))
    else:
        idx = rng.permutation(args.rows)[(rng.zipf(1.1, size=(NB, args.batch)) - 1) % args.rows]
    return [np.unique(keys[b]) for b in idx]


def bench(name, fn, batches, args, cpu=None, **extra):
    """Print the median ids/s of ``fn`` over the windows; ``cpu()``, when given, returns
    ``{field: cpu seconds so far}`` of the processes involved, reported per timed call."""
    for i in range(min(args.batches, NB)):  # warm-up
        fn(i)
    rates = []
    before = cpu() if cpu else {}
    for _ in range(args.windows):
        n, t0 = 0, time.perf_counter()
        for i in range(args.batches):
            n += fn(i)
        rates.append(n / (time.perf_counter() - t0))
    calls = args.windows * args.batches
    extra.update({f"{k}_us_per_call": round(1e6 * (v - before[k]) / calls, 2)
                  for k, v in (cpu() if cpu else {}).items()})
    print(json.dumps({"bench": name, "backend": kernels.backend(), "dist": args.dist,
                      "table": f"{args.rows}x{args.dim} f32", "batch": args.batch,
                      "unique_per_batch": round(float(np.mean([len(b) for b in batches]))),
                      "median_ids_per_s": round(statistics.median(rates)),
                      "min_ids_per_s": round(min(rates)), "max_ids_per_s": round(max(rates)),
                      **extra}), flush=True)


def process_cpu_s(pid: int) -> float:
    """CPU seconds process ``pid`` has run so far, all its live threads, at nanosecond
    resolution (``/proc/<pid>/task/*/schedstat``; ``/proc/<pid>/stat`` counts 10 ms ticks)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):  # the thread ended meanwhile
            continue
    return total / 1e9


def wire(args, keys, batches, grads):
    """Pull and push through ``--servers`` server processes over loopback."""
    spec = SparseTableSpec("t", args.dim, RuleConfig("sgd", lr=0.01), InitConfig("uniform"))
    config = PSConfig([f"127.0.0.1:{free_port()}" for _ in range(args.servers)], 1,
                      mode="async")
    path = os.path.join(tempfile.mkdtemp(), "cluster.json")
    with open(path, "w") as f:
        json.dump({"config": config.to_dict(), "tables": json.loads(Tables((spec,)).to_json())},
                  f)
    servers = [subprocess.Popen([sys.executable, "-m", "fleetx.ps", "serve", "--cluster", path,
                                 "--index", str(i), "--log-level", "WARNING"],
                                stdout=subprocess.PIPE, text=True) for i in range(args.servers)]
    for server in servers:
        server.stdout.readline()
    client = KVClient(config, 0, Tables((spec,)))
    client.start()
    for lo in range(0, args.rows, 1 << 16):
        client.pull({"t": keys[lo:lo + (1 << 16)]}).wait()

    def cpu():  # every process, all threads: the client's receive threads included
        return {"server_cpu": sum(process_cpu_s(s.pid) for s in servers),
                "client_cpu": time.process_time()}
    extra = {"servers": args.servers}
    bench("wire/pull", lambda i: len(client.pull({"t": batches[i % NB]}).wait().sparse["t"].ids),
          batches, args, cpu, **extra)

    def push(i):
        client.push({"t": (batches[i % NB], grads[i % NB])}).wait()
        return len(batches[i % NB])
    bench("wire/push/sgd", push, batches, args, cpu, **extra)
    client.stop()
    for server in servers:
        server.wait(timeout=30)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--windows", type=int, default=5)
    ap.add_argument("--dist", choices=["zipf", "uniform"], default="zipf")
    ap.add_argument("--backend", choices=["c", "numpy"], default=kernels.backend())
    ap.add_argument("--wire", action="store_true", help="through server processes")
    ap.add_argument("--servers", type=int, default=1, help="with --wire: server processes")
    args = ap.parse_args()
    kernels.set_backend(args.backend)
    rng = np.random.default_rng(0)
    keys = rng.integers(1, 2 ** 63 - 1, size=args.rows, dtype=np.int64)
    batches = make_batches(args, keys, rng)
    grads = [rng.standard_normal((len(b), args.dim)).astype(np.float32) for b in batches]
    if args.wire:
        return wire(args, keys, batches, grads)

    for rule in ("sgd", "adam"):
        spec = SparseTableSpec("t", args.dim, RuleConfig(rule, lr=0.01), InitConfig("uniform"))
        table = SparseTable(spec, make_rule(spec.rule), capacity=args.rows)
        t0 = time.perf_counter()
        for lo in range(0, args.rows, 1 << 16):  # populate every row (first touch)
            table.pull(keys[lo:lo + (1 << 16)])
        fill = args.rows / (time.perf_counter() - t0)
        if rule == "sgd":
            bench("pull", lambda i: len(table.pull(batches[i % NB])), batches, args,
                  create_rows_per_s=round(fill))
            bench("find", lambda i: len(table.index.find(batches[i % NB])), batches, args)

        def push(i, table=table):
            table.push(batches[i % NB], grads[i % NB])
            return len(batches[i % NB])
        bench(f"push/{rule}", push, batches, args)


if __name__ == "__main__":
    main()
