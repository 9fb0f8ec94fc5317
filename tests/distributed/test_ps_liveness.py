"""Never hang: a dead or frozen server or worker becomes an error naming it, fast; a long but
legitimate wait (a peer still loading data) is not a failure."""
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from ps_cluster import (DIM, NUMEL, finish, free_ports, start_server, start_worker,  # noqa
                        write_cluster)

from fleetx.ps import DenseTableSpec, PSConfig, RuleConfig, SparseTableSpec, Tables  # noqa

DEAD_AFTER = 2.0


def cluster(tmp_path, servers, workers, timeout=30.0, mode="sync"):
    tables = Tables((SparseTableSpec("emb", DIM, RuleConfig("sgd")),),
                    (DenseTableSpec("dense", NUMEL, RuleConfig("sgd")),))
    config = {"servers": [f"127.0.0.1:{p}" for p in free_ports(servers)],
              "num_workers": workers, "mode": mode, "heartbeat_interval": 0.4,
              "dead_after": DEAD_AFTER, "timeout": timeout}
    return write_cluster(tmp_path / "cluster.json", config, tables.to_json())


def kill(p):
    if p.poll() is None:
        p.kill()  # SIGKILL also ends a stopped process


def test_default_liveness_settings_detect_a_dead_peer_within_30s():
    c = PSConfig(["h:1"], 1)
    assert 1 <= c.heartbeat_interval <= 5 and c.dead_after <= 30


@pytest.mark.parametrize("how", ["die", "hang"])
def test_a_lost_worker_is_named_by_the_others_and_the_server(tmp_path, how):
    path = cluster(tmp_path, 1, 2)
    server = start_server(path, 0)
    t0 = time.monotonic()
    w0 = start_worker(path, 0, tmp_path / "w0.npz", "--steps", "50")
    w1 = start_worker(path, 1, tmp_path / "w1.npz", "--steps", "50", f"--{how}-after", "2")
    try:
        (rc0, err0), (rc_s, err_s) = finish([w0, server], timeout=30)
        elapsed = time.monotonic() - t0
    finally:
        kill(w1)
        finish([w1], 5)
    assert rc0 == 3, err0
    assert re.search(r"ERROR PeerLostError: worker 1 \(pid \d+ on .*\) lost: ", err0), err0
    reason = "connection closed by peer" if how == "die" else "no frame or heartbeat for 2 s"
    assert reason in err0 and "reported by server 0" in err0
    assert rc_s == 1 and "worker 1 (pid" in err_s, err_s
    assert elapsed < 30


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["die", "hang"])
def test_a_lost_server_is_named_by_the_worker(tmp_path, sig):
    path = cluster(tmp_path, 2, 1)
    servers = [start_server(path, i) for i in range(2)]
    worker = start_worker(path, 0, tmp_path / "w0.npz", "--steps", "400", "--sleep-before", "1")
    try:
        time.sleep(0.8)  # the worker is connected and idle (sleeping before its first step)
        t0 = time.monotonic()
        os.kill(servers[1].pid, sig)
        (rc, err), = finish([worker], timeout=30)
        elapsed = time.monotonic() - t0
    finally:
        for s in servers:
            kill(s)
        finish(servers, 5)
    assert rc == 3, err
    port = re.search(r":(\d+)", Path(path).read_text().split('"servers"')[1].split(",")[1])[1]
    assert re.search(rf"ERROR PeerLostError: server 1 \(127\.0\.0\.1:{port}\) lost: ", err), err
    assert elapsed < (DEAD_AFTER + 5 if sig == signal.SIGSTOP else 5), elapsed


def test_a_worker_that_never_connects_is_named(tmp_path):
    path = cluster(tmp_path, 1, 2, timeout=2.0)
    server = start_server(path, 0)
    worker = start_worker(path, 0, tmp_path / "w0.npz")
    (rc, err), (rc_s, err_s) = finish([worker, server], timeout=30)
    assert rc == 3 and "worker 1 lost: did not connect within 2.5 s" in err, err
    assert rc_s == 1 and "worker 1 lost" in err_s


def test_a_long_wait_for_a_live_peer_is_not_a_failure(tmp_path):
    """Worker 1 starts its steps 2x dead_after late: worker 0's first sync step and the
    servers simply wait, kept alive by heartbeats."""
    path = cluster(tmp_path, 1, 2)
    procs = [start_server(path, 0),
             start_worker(path, 0, tmp_path / "w0.npz", "--steps", "3"),
             start_worker(path, 1, tmp_path / "w1.npz", "--steps", "3",
                          "--sleep-before", str(2 * DEAD_AFTER))]
    for rc, err in finish(procs[1:] + procs[:1], 30):
        assert rc == 0, err
