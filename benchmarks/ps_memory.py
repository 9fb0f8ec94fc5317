"""Bytes of server memory per sparse row, against the raw size of the row and its optimizer state.

For each rule (SGD: ``dim`` floats; Adagrad: ``2 * dim``; Adam: ``2 * dim + 1`` more, per the
row layouts of ``fleetx/ps/_kernels.c``), one fresh process fills one ``SparseTable`` the way a
server does (rows created by pulls of new ids, 65,536 per request, from the default capacity:
every growth included) and reports:

  raw          a row's values: weights and optimizer state (``4 * width``; 64, 128, 196 bytes
               at dim 16), the ``raw B/row`` of ``fleet.table_stats()``
  nbytes       what the table holds (``SparseTable.memory()``: values, index slots and keys;
               docs/ps_tables.md §4 gives it per rule)
  rss          the resident memory the process gained (``/proc/self/statm``) while filling it
  rss_trimmed  the same once the C allocator gave its free memory back (``malloc_trim(0)``):
               rss also counts the allocator's cache of freed request buffers (tens of MB,
               however many rows), which the next requests reuse
  peak_rss     the highest resident memory of the process minus its start (``ru_maxrss``),
               growth of the index included

each per row and as a ratio to the raw bytes of a row. Ids are 63-bit hashes of a counter, made
one request at a time, so no id list inflates the process.

Usage:  python benchmarks/ps_memory.py [--rows 10000000] [--dim 16] [--rules sgd,adagrad,adam]
"""
import argparse
import ctypes
import ctypes.util
import json
import os
import resource
import subprocess
import sys

import numpy as np

RAW_FLOATS = {"sgd": lambda d: d, "adagrad": lambda d: 2 * d, "adam": lambda d: 3 * d + 1}
BATCH = 1 << 16


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(rule: str, rows: int, dim: int) -> dict:
    """Fill a table of ``rows`` rows under ``rule`` in this process; the figures above."""
    from fleetx.ps import kernels
    from fleetx.ps.api import InitConfig, RuleConfig, SparseTableSpec
    from fleetx.ps.rules import make_rule
    from fleetx.ps.table import SparseTable
    spec = SparseTableSpec("t", dim, RuleConfig(rule, lr=0.01), InitConfig("uniform"))
    start, start_peak = _rss(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    table = SparseTable(spec, make_rule(spec.rule))
    for lo in range(0, rows, BATCH):
        counter = np.arange(lo, min(rows, lo + BATCH), dtype=np.uint64)
        table.pull((kernels.mix64(counter) >> np.uint64(1)).view(np.int64))
    assert len(table) == rows, f"{len(table)} rows, expected {rows} (a hash collision?)"
    raw = 4 * RAW_FLOATS[rule](dim)
    assert raw == 4 * table.width, (raw, table.width)
    rss = _rss() - start
    ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)
    trimmed = _rss() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - start_peak
    parts = table.memory()
    return {"rule": rule, "rows": rows, "dim": dim, "raw_bytes_per_row": raw,
            "nbytes_per_row": round(table.nbytes / rows, 2),
            "rss_per_row": round(rss / rows, 2), "rss_trimmed_per_row": round(trimmed / rows, 2),
            "peak_rss_per_row": round(peak / rows, 2),
            "nbytes_ratio": round(table.nbytes / rows / raw, 4),
            "rss_ratio": round(rss / rows / raw, 4),
            "rss_trimmed_ratio": round(trimmed / rows / raw, 4),
            "parts_per_row": {k: round(v / rows, 2) for k, v in parts.items()},
            "backend": kernels.backend()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--rules", default="sgd,adagrad,adam")
    ap.add_argument("--case", default=None, help=argparse.SUPPRESS)  # one rule, in this process
    args = ap.parse_args()
    if args.case:
        print(json.dumps(measure(args.case, args.rows, args.dim)), flush=True)
        return
    for rule in args.rules.split(","):
        if rule not in RAW_FLOATS:
            raise SystemExit(f"unknown rule {rule!r}; choose from {', '.join(RAW_FLOATS)}")
        out = subprocess.run([sys.executable, __file__, "--case", rule, "--rows",
                              str(args.rows), "--dim", str(args.dim)], capture_output=True,
                             text=True, check=False)
        if out.returncode:
            raise SystemExit(f"{rule}: {out.stderr[-2000:]}")
        print(out.stdout.strip(), flush=True)


if __name__ == "__main__":
    main()
