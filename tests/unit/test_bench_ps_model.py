"""benchmarks/ps_model.py: the scaling model's formulas (docs/scaling.md), on hand-computed cases.

Every case sets the inputs so that one limit is clearly the smallest and checks the job's
samples/s against the number worked out by hand from the formula written beside it.
"""
import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import ps_model as pm  # noqa: E402

B = 500
# A worker spends 40 us of CPU per sample (20 ms a step) and waits 5 ms a step; the server
# spends 3 ms per worker step of which 2 requests x 0.5 ms are fixed; 1,000 ids a step.
MODE = pm.ModeInputs("async", batch=B, worker_cpu_s_per_sample=40e-6, stall_s_per_step=5e-3,
                     server_cpu_s_per_step=3e-3, requests_per_step=2, unique_ids_per_step=1000,
                     sent_bytes_per_sample=5000, received_bytes_per_sample=3000,
                     dense_sent_bytes_per_sample=4000, dense_received_bytes_per_sample=2000,
                     frame_bytes=250)
# kernels: 1 / 1e6 + 1 / 1e6 = 2 us per id pulled and pushed under SGD, 1 + 4 = 5 us under Adam
COSTS = pm.Costs(server_request_s=0.5e-3, client_request_s=0.1e-3, pull_ids_per_s=1e6,
                 push_ids_per_s={"sgd": 1e6, "adam": 0.25e6})


def test_one_worker_one_server_is_bound_by_the_worker():
    p = pm.predict(MODE, COSTS, pm.Cluster(servers=1, workers=1))
    # workers: W B / (T_w + L) = 500 / (0.020 + 0.005); server: B / T_hot = 500 / 0.003
    assert p.bottleneck == "workers"
    assert p.samples_per_s == pytest.approx(500 / 0.025)
    assert p.limits["hottest server CPU"] == pytest.approx(500 / 0.003)
    assert p.hot_server_s_per_step == pytest.approx(0.003)   # at S = 1 the measured T1 itself


def test_many_workers_hit_the_server_and_more_servers_split_only_the_variable_part():
    p = pm.predict(MODE, COSTS, pm.Cluster(servers=1, workers=100))
    assert p.bottleneck == "hottest server CPU"
    assert p.samples_per_s == pytest.approx(500 / 0.003)
    # 4 servers: T_hot = q c_s + (V - K + kappa K) / S with V = 3 ms - 2 x 0.5 ms = 2 ms,
    # K = 1,000 ids x 2 us = 2 ms: 1 ms + 2 ms / 4 = 1.5 ms (perfect balance)
    p4 = pm.predict(MODE, COSTS, pm.Cluster(servers=4, workers=100))
    assert p4.hot_server_s_per_step == pytest.approx(1.5e-3)
    assert p4.samples_per_s == pytest.approx(500 / 1.5e-3)
    # every server still pays for its requests: T_all = S q c_s + V = 4 ms + 2 ms
    assert p4.all_servers_s_per_step == pytest.approx(6e-3)
    # the fixed part never divides: with 1,000 servers T_hot -> 1 ms + 2 us
    assert pm.predict(MODE, COSTS, pm.Cluster(1000, 100)).hot_server_s_per_step == \
        pytest.approx(1e-3 + 2e-6)


def test_the_hottest_server_takes_kappa_times_the_kernels_share():
    # kappa 1.5 at 4 servers: 1 ms + (0 + 1.5 x 2 ms) / 4 = 1.75 ms
    p = pm.predict(MODE, COSTS, pm.Cluster(servers=4, workers=100, balance=1.5))
    assert p.hot_server_s_per_step == pytest.approx(1.75e-3)
    assert p.all_servers_s_per_step == pytest.approx(6e-3)   # the sum does not depend on it


def test_another_rule_swaps_the_kernels_cost():
    # Adam: K = 1,000 x 5 us = 5 ms instead of 2 ms; the rest (V - K_sgd = 0) is unchanged
    p = pm.predict(MODE, COSTS, pm.Cluster(servers=1, workers=100), rule="adam")
    assert p.hot_server_s_per_step == pytest.approx(1e-3 + 5e-3)
    with pytest.raises(ValueError, match="no push rate measured for rule 'adagrad'; "
                                         "measured: adam, sgd"):
        pm.predict(MODE, COSTS, pm.Cluster(1, 1), rule="adagrad")


def test_a_network_bound_job_runs_at_bandwidth_over_bytes_per_sample():
    # Tiny CPU costs, 1 MB/s cards. One worker and one server: a worker sends 5,000 B a sample
    # (more than it receives), so 1e6 / 5,000 = 200 samples/s, on both cards.
    fast = replace(MODE, worker_cpu_s_per_sample=1e-9, stall_s_per_step=0.0,
                   server_cpu_s_per_step=1e-9)
    cheap = pm.Costs(0.0, 0.0, 1e12, {"sgd": 1e12})
    p = pm.predict(fast, cheap, pm.Cluster(1, 1, bandwidth_bytes_per_s=1e6))
    assert p.samples_per_s == pytest.approx(1e6 / 5000)
    assert p.bottleneck in ("a worker's network", "hottest server's network")
    # 10 workers, 1 server: the server's card carries every worker's bytes: still 200/s
    p10 = pm.predict(fast, cheap, pm.Cluster(1, 10, bandwidth_bytes_per_s=1e6))
    assert p10.bottleneck == "hottest server's network"
    assert p10.samples_per_s == pytest.approx(200)
    # 2 servers: each gets the framing of every request (q h / B = 2 x 250 / 500 = 1 B a
    # sample) plus half the rest: (5,000 - 1) / 2 + 1 = 2,500.5 B a sample in
    p2 = pm.predict(fast, cheap, pm.Cluster(2, 10, bandwidth_bytes_per_s=1e6))
    assert p2.bytes["server_in"] == pytest.approx(2500.5)
    assert p2.samples_per_s == pytest.approx(1e6 / 2500.5)
    # the worker sends one more request's framing per extra server: 5,000 + 1 B
    assert p2.bytes["worker_out"] == pytest.approx(5001)


def test_skew_moves_the_sparse_bytes_but_not_the_dense_ones():
    fast = replace(MODE, worker_cpu_s_per_sample=1e-9, stall_s_per_step=0.0,
                   server_cpu_s_per_step=1e-9)
    cheap = pm.Costs(0.0, 0.0, 1e12, {"sgd": 1e12})
    p = pm.predict(fast, cheap, pm.Cluster(2, 10, bandwidth_bytes_per_s=1e6, balance=1.2))
    # in: sparse (5,000 - 1 - 4,000) x 1.2 + dense 4,000, over 2, plus 1 B of framing
    assert p.bytes["server_in"] == pytest.approx((999 * 1.2 + 4000) / 2 + 1)


def test_shared_cores_divide_all_the_cpu_of_a_step():
    # 3 workers + 1 server on 2 cores: C B / (T_w + T_all) = 2 x 500 / (0.020 + 0.003),
    # below the workers' own 3 x 500 / 0.025
    p = pm.predict(MODE, COSTS, pm.Cluster(servers=1, workers=3, cores=2))
    assert p.bottleneck == "shared cores"
    assert p.samples_per_s == pytest.approx(1000 / 0.023)
    # 4 servers on the same 2 cores: the worker pays 3 more requests a step (3 x 2 x 0.1 ms)
    # and the servers 6 more fixed costs (T_all = 4 x 2 x 0.5 ms + 2 ms = 6 ms)
    p4 = pm.predict(MODE, COSTS, pm.Cluster(servers=4, workers=3, cores=2))
    assert p4.worker_s_per_step == pytest.approx(0.020 + 0.6e-3)
    assert p4.samples_per_s == pytest.approx(1000 / (0.0206 + 0.006))


def test_sync_adds_the_servers_time_to_the_workers():
    sync = replace(MODE, mode="sync")
    # the measured wait included the server's 3 ms: L = 5 - 3 = 2 ms; one worker, one server:
    # 1 / (1 / (500 / 0.022) + 1 / (500 / 0.003)) = 500 / 0.025 samples/s
    p = pm.predict(sync, COSTS, pm.Cluster(1, 1))
    assert p.wait_s_per_step == pytest.approx(2e-3)
    assert p.samples_per_s == pytest.approx(500 / 0.025)
    assert p.bottleneck == "workers"
    # 20 workers: the server's 3 ms per worker step is 60 ms a round against the workers' 22:
    # a round of 20 x 500 samples takes 22 ms + 60 ms
    p20 = pm.predict(sync, COSTS, pm.Cluster(1, 20))
    assert p20.bottleneck == "hottest server CPU"
    assert p20.samples_per_s == pytest.approx(1 / (0.022 / 10_000 + 0.003 / 500))


def test_next_bottleneck_is_the_second_smallest_limit():
    p = pm.predict(MODE, COSTS, pm.Cluster(servers=1, workers=3, cores=2))
    assert p.bottleneck == "shared cores"
    assert p.next_bottleneck() == ("workers", pytest.approx(1500 / 0.025))


def test_server_memory_is_rows_over_servers_times_balance_plus_dense():
    # 1e9 rows over 100 servers, kappa_rows 1.1, 150 B a row: 1.65e9 B; dense 1e6 elements
    # under Adam (3 columns) over 100 servers: 120,000 B; base 3e8 B
    got = pm.server_memory(1e9, 100, 150.0, 1.1, 10 ** 6, 3.0, 3e8)
    assert got == pytest.approx(1.65e9 + 1.2e5 + 3e8)


def test_bad_inputs_name_what_is_wrong():
    with pytest.raises(ValueError, match="servers and workers must be >= 1, got 0 and 2"):
        pm.predict(MODE, COSTS, pm.Cluster(0, 2))
    with pytest.raises(ValueError, match="unknown mode 'mpi'; valid: sync, async, geo"):
        pm.mode_inputs({}, "mpi")
    with pytest.raises(ValueError, match="mode 'geo' was not measured; the inputs hold: async"):
        pm.mode_inputs({"modes": {"async": {}}}, "geo")
    with pytest.raises(ValueError, match=r"modes.async: missing batch, .*frame_bytes; "
                                         r"expected keys: batch,"):
        pm.mode_inputs({"modes": {"async": {}}}, "async")
    with pytest.raises(ValueError, match="no partition balance for 100 servers; measured for: "
                                         "1, 4"):
        pm.balance_at({"balance": {"4": {"ids": 1.0}, "1": {"ids": 1.0}}}, 100)


def test_inputs_json_round_trip():
    doc = {"modes": {"async": {**{f: getattr(MODE, f) for f in
                                  ("batch", "worker_cpu_s_per_sample", "stall_s_per_step",
                                   "server_cpu_s_per_step", "requests_per_step",
                                   "unique_ids_per_step", "sent_bytes_per_sample",
                                   "received_bytes_per_sample", "dense_sent_bytes_per_sample",
                                   "dense_received_bytes_per_sample", "frame_bytes")},
                               "samples_per_s": 123}},           # extra keys are ignored
           "costs": {"server_request_s": 0.5e-3, "client_request_s": 0.1e-3,
                     "pull_ids_per_s": 1e6, "push_ids_per_s": {"sgd": 1e6, "adam": 0.25e6},
                     "wire": []},
           "balance": {"4": {"ids": 1.5, "rows": 1.1}}}
    assert pm.mode_inputs(doc, "async") == MODE
    assert pm.costs(doc) == COSTS
    assert pm.balance_at(doc, 4) == 1.5 and pm.balance_at(doc, 4, "rows") == 1.1


def test_a_negative_measured_wait_counts_as_none():
    # a worker whose sender thread ran on the second core used more CPU than wall time
    p = pm.predict(replace(MODE, stall_s_per_step=-2e-3), COSTS, pm.Cluster(1, 1, rtt_s=1e-3))
    assert p.wait_s_per_step == pytest.approx(1e-3)          # only the network's round trip
    assert p.samples_per_s == pytest.approx(500 / 0.021)
