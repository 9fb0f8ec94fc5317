"""A worker whose main thread is stuck while its heartbeat thread lives (a real process) stalls
a sync round or a barrier: after the timeout the server declares it lost, naming it, and every
waiting worker gets that error instead of waiting forever."""
import re
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from ps_cluster import (DIM, NUMEL, finish, free_ports, start_server, start_worker,  # noqa
                        write_cluster)

from fleetx.ps import DenseTableSpec, RuleConfig, SparseTableSpec, Tables  # noqa: E402

TIMEOUT = 6.0  # FLEETX_TIMEOUT of the job


@pytest.mark.parametrize("mode, wait", [("sync", "a sync round"), ("async", "barrier 'end'")],
                         ids=["sync-round", "async-barrier"])
def test_a_stuck_worker_is_named_after_the_timeout(tmp_path, mode, wait):
    tables = Tables((SparseTableSpec("emb", DIM, RuleConfig("sgd")),),
                    (DenseTableSpec("dense", NUMEL, RuleConfig("sgd")),))
    path = write_cluster(tmp_path / "cluster.json", {
        "servers": [f"127.0.0.1:{free_ports(1)[0]}"], "num_workers": 2, "mode": mode,
        "heartbeat_interval": 0.4, "dead_after": 2.0, "timeout": TIMEOUT}, tables.to_json())
    server = start_server(path, 0)
    w0 = start_worker(path, 0, tmp_path / "w0.npz", "--steps", "6")
    w1 = start_worker(path, 1, tmp_path / "w1.npz", "--steps", "6", "--stuck-after", "2")
    try:
        assert w1.stderr.readline().strip() == "stuck"
        t0 = time.monotonic()
        (rc0, err0), (rc_s, err_s) = finish([w0, server], timeout=60)
        elapsed = time.monotonic() - t0
        assert w1.poll() is None  # alive all along: its heartbeats kept the link up
    finally:
        w1.kill()
        finish([w1], 5)
    lost = (rf"worker 1 \(pid {w1.pid} on .*\) lost: sent no request for \d+ s while worker 0 "
            rf"waited in {wait} \(timeout 6 s, FLEETX_TIMEOUT\); its heartbeats still came, so "
            rf"the process is alive but stuck")
    assert rc0 == 3 and re.search(r"ERROR PeerLostError: " + lost, err0), err0
    assert rc_s == 1 and re.search(lost, err_s), err_s
    assert elapsed < TIMEOUT + 20, elapsed  # detection bound, generous for a loaded machine
