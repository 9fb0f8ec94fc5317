"""The client's latency recorder (fleetx/ps/latency.py, timed by fleetx/ps/tracker.py): quantiles
against numpy's on known samples, within one bucket width; merging and subtracting; the JSON
round trip; a real client timing its pulls and pushes per kind (what recording costs:
benchmarks/ps_latency_cost.py)."""
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from fleetx.ps import (DenseTableSpec, InitConfig, KVClient, PSConfig, PSServer, RuleConfig,
                       SparseTableSpec, Tables)
from fleetx.ps.latency import BUCKETS, QUANTILES, Histogram, Latencies, bounds, bucket
from fleetx.ps.tracker import Handle, Tracker
from fleetx.ps.api import Kind, Message

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import free_ports  # noqa: E402  (tests/helpers.py)

QS = (0.0, 0.1, 0.5, 0.9, 0.99, 0.999, 1.0)


def _hist(samples_ns) -> Histogram:
    h = Histogram()
    for x in samples_ns:
        h.add(int(x))
    return h


@pytest.mark.parametrize("n", [1, 7, 1000, 12345])
def test_quantiles_match_numpy_within_one_bucket_width(n):
    rng = np.random.default_rng(n)
    # a latency-like spread over six decades: log-normal around 200 us, plus a slow tail
    samples = np.exp(rng.normal(math.log(2e5), 1.0, n)).astype(np.int64) + 1
    samples[: n // 100] *= 1000
    h = _hist(samples)
    assert h.count == n
    for q in QS:
        exact = int(np.quantile(samples, q, method="inverted_cdf"))
        got = h.quantile(q) * 1e9
        low, high = bounds(bucket(exact))
        assert low <= exact < high
        # the bucket's middle, so within half a bucket of every value in it; buckets are
        # at most 1/64 of their value wide
        assert abs(got - exact) <= (high - low) / 2, (q, got, exact)
        assert abs(got - exact) <= exact / 128 + 0.5, (q, got, exact)


def test_buckets_tile_the_range_and_are_at_most_1_64_wide():
    edges = [bounds(b) for b in range(BUCKETS)]
    assert edges[0] == (0, 1)
    assert all(a[1] == b[0] for a, b in zip(edges, edges[1:]))       # no gap, no overlap
    assert all(high - low <= max(1, low / 64) for low, high in edges)
    for ns in [0, 1, 127, 128, 129, 255, 256, 1000, 12345, 10 ** 6, 10 ** 9, 10 ** 12]:
        low, high = bounds(bucket(ns))
        assert low <= ns < high, ns


def test_quantile_edges_empty_and_out_of_range():
    assert Histogram().quantile(0.5) is None
    with pytest.raises(ValueError, match="quantile 1.5 outside"):
        Histogram().quantile(1.5)
    assert bucket(-3) == bucket(0) == 0 and bucket(1) == 1
    assert bucket(10 ** 15) == BUCKETS - 1          # 11 days: the last bucket holds it
    assert bounds(BUCKETS - 1)[0] > 10 ** 13         # buckets cover more than 10,000 s
    h = _hist([5])
    assert all(h.quantile(q) == 5e-9 for q in QS)    # below 128 ns: exact


def test_merge_subtract_and_json_round_trip():
    a = Latencies()
    for x in (1_000, 2_000, 50_000):
        a.of("PULL").add(x)
    a.of("PUSH").add(7_000)
    before = a.copy()
    a.of("PULL").add(9_000_000)
    after = a.minus(before)
    assert after.summary()["PULL"]["count"] == 1
    assert abs(after.summary()["PULL"]["p50"] / 9e-3 - 1) < 0.01
    assert "PUSH" not in after.summary()                 # nothing new for PUSH
    both = Latencies.combined([before, after])
    assert both.to_json() == a.to_json()
    again = Latencies.from_json(a.to_json())
    assert again.summary() == a.summary()
    assert set(a.summary()["PULL"]) == {"count"} | {name for name, _ in QUANTILES}
    with pytest.raises(ValueError, match="sub_bits 5"):
        Histogram.from_json({"sub_bits": 5, "buckets": BUCKETS, "counts": {}})


def test_tracker_times_each_request_from_register_to_reply():
    t = Tracker()
    handle = Handle(2)
    slow = t.register(handle, 0, 0, kind="PULL")
    time.sleep(0.02)
    fast_id = t.register(handle, 1, 1, kind="PULL")
    untimed = t.register(Handle(1), 0, 0)             # failover's HELLO: no kind, not timed
    t.resolve(Message(Kind.PULL, fast_id).reply(), "s1")
    t.resolve(Message(Kind.PULL, slow).reply(), "s0")
    t.resolve(Message(Kind.HELLO, untimed).reply(), "s0")
    t.resolve(Message(Kind.PULL, slow).reply(), "s0")  # a stale reply: ignored
    lat = t.latency().summary()
    assert list(lat) == ["PULL"] and lat["PULL"]["count"] == 2
    assert lat["PULL"]["p50"] < 0.02 <= lat["PULL"]["p999"] * (1 + 1 / 64)
    handle.wait(1)


def test_a_client_reports_its_pulls_and_pushes():
    sgd = RuleConfig("sgd", lr=0.5)
    tables = Tables((SparseTableSpec("emb", 3, sgd, InitConfig("constant")),),
                    (DenseTableSpec("dense", 10, sgd),))
    config = PSConfig([f"127.0.0.1:{p}" for p in free_ports(2)], 1, heartbeat_interval=0.2,
                      dead_after=3.0, timeout=20)
    servers = [PSServer(config, i, tables).start() for i in range(2)]
    client = KVClient(config, 0, tables)
    try:
        client.start()
        ids = np.arange(20)
        for _ in range(30):
            client.pull({"emb": ids}).wait()
            client.push({"emb": (ids, np.ones((20, 3), np.float32))}).wait()
        lat = client.latency()
        assert lat["PULL"]["count"] == lat["PUSH"]["count"] == 60      # one request per server
        assert lat["HELLO"]["count"] == 2
        for kind in ("PULL", "PUSH"):
            assert 0 < lat[kind]["p50"] <= lat[kind]["p99"] <= lat[kind]["p999"] < 5
        assert client.latency(histograms=True).of("PULL").count == 60
    finally:
        client.stop()
        for s in servers:
            s.stop()


def test_the_cost_benchmark_times_what_the_tracker_records():
    """benchmarks/ps_latency_cost.py: the timed variant records every request under its kind,
    the untimed one records nothing (what the benchmark subtracts is the recorder alone)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import ps_latency_cost
    res = subprocess.run([sys.executable, ps_latency_cost.__file__, "--rounds", "1"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["untimed_ns"] > 0 and out["timed_ns"] > 0 and out["requests"] == 20_000
    t = Tracker()
    for kind, req in ((None, 1), ("PULL", 2)):
        t.register(Handle(1), 0, 0, None, kind)
        t.resolve(Message(Kind.PULL, req).reply(), "s")
    assert t.latency().summary()["PULL"]["count"] == 1
    assert set(t.latency().summary()) == {"PULL"}
