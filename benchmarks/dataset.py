"""Datasets: lines/s parsed by fleetx's readers against a plain Python loop, and the wide&deep
pipeline from raw files to parameter-server training.

``parse``     slot text files (generated, seed 0: a Criteo-like layout, one dense slot of 13
              floats, 26 sparse slots of one 63-bit id, a label) read through
              ``pipe_command="cat"`` by each variant, in the same run:

              ``python``          a plain Python loop over the same files: ``line.split()``,
                                  ``int()`` / ``float()`` per token into lists, numpy at the end
              ``c/thread/N``      fleetx's readers (what ``load_into_memory`` runs), N of them,
                                  the C parser, reader threads (the default)
              ``c/process/N``     the same with reader processes
              ``numpy/thread/2``, ``numpy/process/2``  the numpy parser (no C build)

              Every round runs every variant once, the order rotating so that none always
              follows another; each variant's samples are checked to be the same (a checksum).
              Prints lines/s per variant (median and interquartile range over rounds) and the
              per-round ratios of each to the Python loop and of processes to threads.
``pipeline``  ``examples/wide_and_deep/train_dataset.py`` end to end, under
              ``fleetrun --server_num 2 --worker_num 2`` (or ``--launcher python``: one process):
              seconds of loading (files -> generator -> parse -> global shuffle) and of
              training, lines/s of the load, samples/s of training, the held-out AUC.

    python benchmarks/dataset.py parse --lines 400000 --files 4 --rounds 7
    python benchmarks/dataset.py pipeline --rounds 3
    python benchmarks/dataset.py parse --lines 2000 --files 2 --rounds 1    # smoke: seconds

Prints a human summary and one JSON line.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from ratios import quartiles

from fleetx.data import Slot
from fleetx.data.block import SampleBlock
from fleetx.data.readers import ParallelReader, ReadOptions

ROOT = Path(__file__).resolve().parents[1]
DENSE, SPARSE = 13, 26
SLOTS = tuple([Slot("dense", "float32", dense_width=DENSE)] +
              [Slot(f"C{i}") for i in range(1, SPARSE + 1)] +
              [Slot("label", "int64", dense_width=1)])
VARIANTS = ("python", "c/thread/1", "c/thread/2", "c/process/1", "c/process/2",
            "numpy/thread/2", "numpy/process/2")


def write_files(folder: Path, lines: int, files: int, seed: int = 0) -> list:
    """``files`` slot text files holding ``lines`` samples in all."""
    rng = np.random.default_rng(seed)
    paths = []
    for i, part in enumerate(np.array_split(np.arange(lines), files)):
        dense = rng.random((len(part), DENSE))
        ids = rng.integers(0, 2**63 - 1, (len(part), SPARSE))
        labels = rng.integers(0, 2, len(part))
        text = [f"{DENSE} " + " ".join(f"{x:.4f}" for x in dense[k]) + " " +
                " ".join(f"1 {v}" for v in ids[k]) + f" 1 {labels[k]}\n"
                for k in range(len(part))]
        path = folder / f"part-{i:03d}"
        path.write_text("".join(text))
        paths.append(str(path))
    return paths


def python_loop(files: list) -> tuple:
    """The baseline: what one writes without fleetx's readers. Returns (samples, checksum)."""
    columns = [[] for _ in SLOTS]
    samples = 0
    for path in files:
        with open(path, "rb") as f:
            for line in f:
                tokens = line.split()
                if not tokens:
                    continue
                at = 0
                for column, slot in zip(columns, SLOTS):
                    count = int(tokens[at])
                    read = float if slot.dtype == "float32" else int
                    column.extend(map(read, tokens[at + 1:at + 1 + count]))
                    at += 1 + count
                samples += 1
    arrays = [np.array(c, np.float32 if s.dtype == "float32" else np.int64)
              for c, s in zip(columns, SLOTS)]
    return samples, checksum(arrays)


def checksum(arrays: list) -> tuple:
    ints = sum(int(a.view(np.uint64).sum(dtype=np.uint64)) for a in arrays if a.dtype == np.int64)
    floats = sum(float(a.astype(np.float64).sum()) for a in arrays if a.dtype == np.float32)
    return ints % 2**64, round(floats, 3)


def fleetx_readers(files: list, variant: str) -> tuple:
    """``load_into_memory``'s work: the readers, then one block. Returns (samples, checksum)."""
    parser, kind, readers = variant.split("/")
    reader = ParallelReader(files, ReadOptions(SLOTS, parser=parser), int(readers), kind)
    block = SampleBlock.concat(SLOTS, [b for _, b in reader])
    return block.size, checksum([block.values[s.name] for s in SLOTS])


def measure_parse(files: list, lines: int, rounds: int) -> dict:
    rates = {v: [] for v in VARIANTS}
    results = {}
    for r in range(rounds):
        order = VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]
        for variant in order:
            start = time.perf_counter()
            result = python_loop(files) if variant == "python" else fleetx_readers(files,
                                                                                   variant)
            rates[variant].append(lines / (time.perf_counter() - start))
            results.setdefault(variant, result)
            if result != results["python" if "python" in results else variant] \
                    or result[0] != lines:
                raise SystemExit(f"{variant} read other samples: {result} vs {results}")
    over_python = {v: [a / b for a, b in zip(rates[v], rates["python"])] for v in VARIANTS[1:]}
    over_threads = {p: [a / b for a, b in zip(rates[p], rates[p.replace("process", "thread")])]
                    for p in ("c/process/1", "c/process/2", "numpy/process/2")}
    return {"lines": lines, "rounds": rounds, "lines_per_s": rates,
            "over_python": over_python, "process_over_thread": over_threads}


def report_parse(result: dict) -> str:
    out = [f"parse: {result['lines']} lines, {result['rounds']} rounds; lines/s median "
           f"[q1, q3]"]
    for variant, rates in result["lines_per_s"].items():
        q1, med, q3 = quartiles(rates)
        out.append(f"  {variant:16s} {med:12.0f}  [{q1:.0f}, {q3:.0f}]")
    for title, ratios in (("over the Python loop", result["over_python"]),
                          ("processes over threads", result["process_over_thread"])):
        out.append(f"ratio {title}, median [q1, q3]:")
        for variant, values in ratios.items():
            q1, med, q3 = quartiles(values)
            out.append(f"  {variant:16s} {med:8.2f}  [{q1:.2f}, {q3:.2f}]")
    return "\n".join(out)


def run_pipeline(launcher: str, data: str, epochs: int, extra: list) -> dict:
    """One run of the wide&deep dataset example; its figures, read from worker 0's output."""
    script = str(ROOT / "examples" / "wide_and_deep" / "train_dataset.py")
    cmd = [sys.executable, script] if launcher == "python" else [
        sys.executable, "-m", "fleetx.launch", "--server_num", "2", "--worker_num", "2",
        "--log_dir", tempfile.mkdtemp(prefix="fleetx_bench_log_"), script]
    cmd += ["--data", data, "--epochs", str(epochs), *extra]
    start = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{res.stdout[-3000:]}{res.stderr[-3000:]}")
    loaded = re.search(r"loaded (\d+) training and (\d+) held-out samples", res.stdout)
    times = re.search(r"time: load ([0-9.]+) s, train ([0-9.]+) s", res.stdout)
    aucs = re.findall(r"held-out AUC ([0-9.]+)", res.stdout)
    lines = int(loaded.group(1)) + int(loaded.group(2))
    load_s, train_s = float(times.group(1)), float(times.group(2))
    return {"wall_s": time.perf_counter() - start, "load_s": load_s, "train_s": train_s,
            "load_lines_per_s": lines / load_s,
            "train_samples_per_s": int(loaded.group(1)) * epochs / train_s,
            "auc": float(aucs[-1])}


def report_pipeline(runs: list, launcher: str) -> str:
    out = [f"pipeline ({launcher}): median [q1, q3] over {len(runs)} runs"]
    for key in ("wall_s", "load_s", "train_s", "load_lines_per_s", "train_samples_per_s",
                "auc"):
        q1, med, q3 = quartiles([r[key] for r in runs])
        out.append(f"  {key:20s} {med:12.4g}  [{q1:.4g}, {q3:.4g}]")
    share = statistics.median(r["load_s"] / (r["load_s"] + r["train_s"]) for r in runs)
    out.append(f"  load share of load + train: {share:.0%}")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("part", choices=("parse", "pipeline"))
    ap.add_argument("--lines", type=int, default=400_000, help="parse: samples in all")
    ap.add_argument("--files", type=int, default=4, help="parse: files")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--launcher", choices=("fleetrun", "python"), default="fleetrun")
    ap.add_argument("--data", default="/tmp/fleetx_adult", help="pipeline: the raw files")
    ap.add_argument("--epochs", type=int, default=4, help="pipeline: epochs")
    ap.add_argument("--limit", type=int, default=0, help="pipeline: training rows (0: all)")
    args = ap.parse_args()
    if args.part == "parse":
        with tempfile.TemporaryDirectory(prefix="fleetx_bench_data_") as folder:
            files = write_files(Path(folder), args.lines, args.files)
            result = measure_parse(files, args.lines, args.rounds)
        print(report_parse(result))
    else:
        extra = ["--limit", str(args.limit)] if args.limit else []
        runs = [run_pipeline(args.launcher, args.data, args.epochs, extra)
                for _ in range(args.rounds)]
        result = {"launcher": args.launcher, "runs": runs}
        print(report_pipeline(runs, args.launcher))
    print(json.dumps({"part": args.part, **result}))


if __name__ == "__main__":
    main()
