"""benchmarks/ps_scaling.py and ps_counters.py at a tiny size.

The partition balance is checked on ids placed by hand; the counters' summary on hand-made
readings; each subcommand runs (the ones that start jobs in the slow stage), and there the
bytes counted at the sockets of a sync job match the wire format's sizes for the workload's
distinct ids per step.
"""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import ps_counters  # noqa: E402
import ps_scaling  # noqa: E402
from fleetx.ps.partition import server_of  # noqa: E402

SCRIPT = str(ROOT / "benchmarks" / "ps_scaling.py")


def _run(*args, timeout=600):
    res = subprocess.run([sys.executable, SCRIPT, *map(str, args)], capture_output=True,
                         text=True, timeout=timeout, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout


def _ids_on(server: int, servers: int, count: int) -> list:
    """``count`` ids that the partition function puts on ``server`` of ``servers``."""
    cand = np.arange(1, 10_000, dtype=np.int64)
    return cand[server_of(cand, servers, ps_scaling.SHARD_NUM) == server][:count].tolist()


def test_balance_of_ids_placed_by_hand():
    a, b = _ids_on(0, 2, 3), _ids_on(1, 2, 1)
    hot = a[0]
    # two batches; the hot id is repeated 5 times in each, the client keeps it once
    batches = [np.array(a + b + [hot] * 5), np.array(a + b + [hot] * 5)]
    got = ps_scaling.balance(batches, 2)
    # distinct ids per batch: 3 on server 0, 1 on server 1 -> 6 / mean(6, 2) = 1.5
    assert got["ids"] == pytest.approx(1.5) and got["ids_step"] == pytest.approx(1.5)
    # every occurrence: (3 + 5) x 2 = 16 on server 0 and 2 on server 1 -> 16 / 9
    assert got["raw"] == pytest.approx(16 / 9)
    assert got["rows"] == pytest.approx(1.5) and got["empty"] == 0
    assert got["top_id_share"] == pytest.approx(6 / 9)           # 12 of 18 occurrences
    one = ps_scaling.balance(batches, 1)
    assert one["ids"] == one["raw"] == one["rows"] == 1.0


def test_balance_names_servers_without_rows():
    got = ps_scaling.balance([np.array(_ids_on(0, 4, 2) + _ids_on(3, 4, 2))], 4)
    assert got["empty"] == 2 and got["rows"] == pytest.approx(2.0)   # 2 / mean(2, 0, 0, 2)


def test_zipf_batches_are_skewed_as_asked():
    flat = np.concatenate(ps_scaling.zipf_batches(1.5, 1000, 4, 5000))
    top = np.unique(flat, return_counts=True)[1].max() / len(flat)
    # P(rank 1) = 1 / sum(r^-1.5, r <= 1000) = 0.385
    assert top == pytest.approx(1 / np.sum(np.arange(1, 1001) ** -1.5), abs=0.02)
    uniform = np.concatenate(ps_scaling.zipf_batches(0.0, 1000, 4, 5000))
    assert np.unique(uniform, return_counts=True)[1].max() / len(uniform) < 0.002


def _reading(wall, cpu, sent, received, pulls, pushes, dense, framing):
    return {"wall": wall, "cpu": cpu, "sent": sent, "received": received,
            "requests": {"PULL": [pulls, 0, 0, framing * pulls],
                         "PUSH": [pushes, 0, dense, framing * pushes]}}


def test_counters_summary_takes_the_warm_epochs():
    # one worker, 1,000 samples an epoch in batches of 500 (2 steps); readings before epoch 1
    # and after epochs 1 and 2: only epoch 2 counts
    worker = {"samples": 1000, "probe": [
        _reading(100.0, 10.0, 0, 0, 0, 0, 0, 100),
        _reading(101.0, 10.8, 9_000, 5_000, 2, 2, 4_000, 100),
        _reading(102.5, 11.8, 20_000, 11_000, 4, 4, 10_000, 100)]}
    # the server's CPU: 0.2 s at wall 101, 0.6 s at wall 102.5 (linear in between)
    server = {"cpu_trace": [(100.0, 0.0), (101.0, 0.2), (102.5, 0.6)]}
    got = ps_counters.summarize([worker], [server], 500)
    assert got["samples"] == 1000 and got["steps"] == 2
    assert got["worker_cpu_s_per_sample"] == pytest.approx(1.0 / 1000)
    assert got["stall_s_per_step"] == pytest.approx((1.5 - 1.0) / 2)
    assert got["requests_per_step"] == pytest.approx(2.0)      # 2 pulls + 2 pushes, 2 steps
    assert got["sent_bytes_per_sample"] == pytest.approx(11.0)
    assert got["received_bytes_per_sample"] == pytest.approx(6.0)
    assert got["dense_sent_bytes_per_sample"] == pytest.approx(6.0)
    assert got["frame_bytes"] == pytest.approx(100.0)
    assert got["server_cpu_s_per_step"] == pytest.approx(0.4 / 2)


def test_partition_subcommand_runs():
    out = _run("partition", "--servers", "1,2,4", "--skews", "0,1.5", "--vocab", 2000,
               "--batches", 3, "--batch-ids", 300)
    doc = json.loads(out.strip().splitlines()[-1])
    assert doc["shard_num"] == ps_scaling.SHARD_NUM
    assert set(doc["balance"]) == {"zipf 0", "zipf 1.5"}
    assert doc["balance"]["zipf 0"]["1"]["ids"] == 1.0
    for skew in doc["balance"].values():
        assert all(b["ids"] >= 1.0 for b in skew.values())
    # de-duplication: the skewed ids' hottest server carries far more occurrences than ids
    assert doc["balance"]["zipf 1.5"]["4"]["raw"] > doc["balance"]["zipf 1.5"]["4"]["ids"]


def test_memory_subcommand_measures_each_rule():
    doc = json.loads(_run("memory", "--rows", 3000).strip().splitlines()[-1])
    rows = doc["bytes_per_row"]
    # raw rows: 16 weights (+16 Adagrad sums, +33 Adam moments and step), as docs/ps_tables.md §4
    assert [rows[r]["raw"] for r in ("sgd", "adagrad", "adam")] == [64, 128, 196]
    for r in rows.values():  # the peak is resident memory: page-granular noise at 3,000 rows
        assert r["held"] >= r["nbytes"] >= r["raw"] and r["peak"] >= 0
    assert rows["sgd"]["held"] < rows["adagrad"]["held"] < rows["adam"]["held"]
    assert doc["dense_width"]["sgd"] == 1.0 and doc["base_bytes"] > 0


def _inputs() -> dict:
    mode = {"batch": 512, "worker_cpu_s_per_sample": 4e-5, "stall_s_per_step": 1e-3,
            "server_cpu_s_per_step": 2e-3, "requests_per_step": 2, "unique_ids_per_step": 3500,
            "sent_bytes_per_sample": 4500, "received_bytes_per_sample": 4400,
            "dense_sent_bytes_per_sample": 3900, "dense_received_bytes_per_sample": 3900,
            "frame_bytes": 130}
    balance = {str(s): {"ids": 1.0 + s / 300, "rows": 1.0 + s / 400} for s in (1, 100)}
    row = {"held": 150.0}
    return {"modes": {"async": mode, "sync": mode},
            "costs": {"server_request_s": 2e-4, "client_request_s": 1e-4,
                      "pull_ids_per_s": 2e7, "push_ids_per_s": {"sgd": 1.5e7, "adam": 5e6}},
            "balance": balance, "balance_zipf": {"1.5": balance},
            "workload": {"dense_numel": 493_215},
            "compute": {"compute_s_per_sample": 3e-5},
            "memory": {"bytes_per_row": {r: row for r in ps_scaling.RULES},
                       "dense_width": {"sgd": 1.0, "adagrad": 2.0, "adam": 3.0},
                       "base_bytes": 3e8}}


def test_predict_subcommand_names_the_bottleneck(tmp_path):
    path = tmp_path / "inputs.json"
    path.write_text(json.dumps(_inputs()))
    out = _run("predict", "--inputs", path, "--modes", "async,sync", "--rule", "adam",
               "--skew", "1.5")
    lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    assert [(x["mode"], x["servers"], x["workers"]) for x in lines] == \
        [("async", 100, 1000), ("sync", 100, 1000)]
    # 2 requests x 0.2 ms fixed on every server every worker step: the servers bind first
    assert lines[0]["bottleneck"] == "hottest server CPU"
    assert "bottleneck: hottest server CPU; then workers" in out
    assert "async: a worker's CPU per sample 40.0 us = the model's compute 30.0 us (plain " \
           "PyTorch) + the PS client 10.0 us" in out
    assert "memory, 1e+09 rows over 100 servers: fullest server sgd" in out
    res = subprocess.run([sys.executable, SCRIPT, "predict", "--inputs", str(path),
                          "--servers", "7"], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode != 0
    assert "no partition balance for 7 servers; measured for: 1, 100" in res.stderr
    res = subprocess.run([sys.executable, SCRIPT, "predict", "--inputs", str(path),
                          "--skew", "2"], capture_output=True, text=True, cwd=ROOT)
    assert "--skew 2: no balance measured at that skew; measured: 1.5" in res.stderr


@pytest.mark.slow
def test_inputs_and_validate_run_and_the_sockets_count_the_wire_format(tmp_path):
    data = tmp_path / "data"
    subprocess.run([sys.executable, str(ROOT / "examples/wide_and_deep/gen_criteo.py"),
                    "--lines", "5120", "--files", "2", "--out", str(data)],
                   check=True, capture_output=True)
    inputs = tmp_path / "inputs.json"
    _run("inputs", "--out", inputs, "--data", data, "--epochs", 2, "--k-steps", 2,
         "--table-rows", 20_000, "--table-batches", 10, "--memory-rows", 5000,
         "--balance-servers", "1,2,100", "--skews", "0,1.2", "--timeout", 300, timeout=900)
    doc = json.loads(inputs.read_text())
    assert set(doc["modes"]) == {"async", "sync", "geo"}
    sync, work = doc["modes"]["sync"], doc["workload"]
    # sync, 1 server: every step one PULL and one PUSH, 10 full batches of 512
    assert sync["requests_per_step"] == 2.0
    u, dim, b = work["unique_ids_per_step"], 16, 512
    dense = 4 * work["dense_numel"] / b
    assert sync["dense_sent_bytes_per_sample"] == pytest.approx(dense)
    # sent: the pull's ids (8 B each), the push's ids and gradients (8 + 64 B), the dense
    # gradients, the framing; received: rows (64 B), the dense weights, framing like requests
    framing = 2 * sync["frame_bytes"] / b
    assert sync["sent_bytes_per_sample"] == pytest.approx((8 + 8 + 4 * dim) * u / b + dense
                                                          + framing, rel=0.01)
    assert sync["received_bytes_per_sample"] == pytest.approx(4 * dim * u / b + dense,
                                                              rel=0.01)
    out = _run("validate", "--inputs", inputs, "--data", data, "--epochs", 2, "--modes",
               "async", "--servers", "1,2", "--timeout", 300, timeout=900)
    rows = [line.split() for line in out.splitlines()[1:]]
    assert [r[:2] for r in rows] == [["async", "1x2"], ["async", "2x2"]]
    assert all(float(r[2]) > 0 and float(r[3]) > 0 for r in rows)


# -- the figures docs/scaling.md states ------------------------------------------------------------
def test_shard_blocks_per_server_as_the_doc_says():
    shards = np.arange(ps_scaling.SHARD_NUM)
    for servers, sizes in ((100, {10}), (300, {3, 4}), (1000, {1})):
        # server_of maps a shard s to s * S // shard_num: count the shards each server owns
        owner = shards * servers // ps_scaling.SHARD_NUM
        assert set(np.bincount(owner, minlength=servers)) == sizes
    from fleetx.ps.api import PSConfig, PSConfigError
    with pytest.raises(PSConfigError, match="shard_num=1000 < number of servers 1001"):
        PSConfig(tuple(f"127.0.0.1:{6000 + i}" for i in range(1001)), 1)


def test_uniform_ids_at_300_servers_balance_as_the_doc_says():
    # blocks of 3 or 4 shards: even uniform ids leave the fullest server 1.26x the mean
    batches = ps_scaling.zipf_batches(0.0, 10 ** 6, 200, ps_scaling.BATCH * ps_scaling.SLOTS)
    assert ps_scaling.balance(batches, 300)["ids"] == pytest.approx(1.259, abs=5e-4)


@pytest.mark.slow
def test_ctr_workload_figures_as_the_doc_says(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "examples/wide_and_deep/gen_criteo.py"),
                    "--lines", "200000", "--files", "10", "--out", str(tmp_path)],
                   check=True, capture_output=True)
    import argparse
    work = ps_scaling.workload(argparse.Namespace(data=str(tmp_path), batch=512, k_steps=100))
    assert work["batches"] == 390 and work["dense_numel"] == 493_215
    assert work["distinct_ids"] == 177_675
    assert work["unique_ids_per_step"] == pytest.approx(3491, abs=0.5)
    assert work["geo_unique_ids_per_step"] == pytest.approx(806.4, abs=0.05)
    u, d = work["unique_ids_per_step"], 4 * work["dense_numel"]
    # section 3: per sample out (pull ids, push ids and gradients, dense) and in (rows, dense)
    assert (8 * u + 72 * u + d) / 512 == pytest.approx(4400, abs=5)
    assert (64 * u + d) / 512 == pytest.approx(4290, abs=5)
    got = ps_scaling.balance(ps_scaling.workload_batches(str(tmp_path)), 100)
    assert got["ids"] == pytest.approx(1.247, abs=5e-4)
    assert got["raw"] == pytest.approx(3.914, abs=5e-4)
    assert got["rows"] == pytest.approx(1.070, abs=5e-4)
    assert got["top_id_share"] == pytest.approx(0.0226, abs=5e-5)
    uniform = ps_scaling.zipf_batches(0.0, 10 ** 6, 200, ps_scaling.BATCH * ps_scaling.SLOTS)
    assert ps_scaling.balance(uniform, 100)["ids"] == pytest.approx(1.025, abs=5e-4)
    zipf = ps_scaling.zipf_batches(1.2, 10 ** 6, 200, ps_scaling.BATCH * ps_scaling.SLOTS)
    skewed = ps_scaling.balance(zipf, 100)
    assert (skewed["ids"], skewed["raw"]) == (pytest.approx(1.273, abs=5e-4),
                                              pytest.approx(19.151, abs=5e-4))
