"""The worker's background sending: GEO exchanges run on a sender thread and land at a later
step, async pushes on theirs. Client and servers in one process (servers on threads).

* An exchange that lands after the worker trained on: each row becomes the server's value plus
  what the worker trained since the snapshot, and its base the server's value.
* A lost server fails the exchange in flight; the next step (or flush) raises naming the
  server.
* ``stop`` flushes (every local step reaches the servers) and leaves no sending thread behind.
"""
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from fleetx.ps import (CommunicatorConfig, DenseTableSpec, InitConfig, PSConfig, PSError,
                       PSServer, RuleConfig, SparseTableSpec, Tables)
from fleetx.ps_torch import make_communicator

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import free_ports  # noqa: E402  (tests/helpers.py)

LR = 0.5
TABLES = Tables((SparseTableSpec("emb", 2, RuleConfig("sgd", lr=LR), InitConfig("constant")),),
                (DenseTableSpec("dense", 3, RuleConfig("sgd", lr=LR)),))


@pytest.fixture
def servers():
    made = []

    def make(mode, workers, count=1):
        config = PSConfig([f"127.0.0.1:{p}" for p in free_ports(count)], workers, mode=mode,
                          heartbeat_interval=0.2, dead_after=3.0, timeout=20)
        made.extend(PSServer(config, i, TABLES).start() for i in range(count))
        return config, made[-count:]
    yield make
    for s in made:
        s.stop()


def start(config, rank, k_steps=1):
    comm = make_communicator(config, rank, TABLES, CommunicatorConfig(k_steps=k_steps))
    comm.start(dense={"dense": np.zeros(3, np.float32)})
    return comm


def start_both(config, k_steps):
    """Two workers (``start`` meets every worker at a barrier)."""
    out = {}
    threads = [threading.Thread(target=lambda r=r: out.update({r: start(config, r, k_steps[r])}))
               for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out[0], out[1]


def geo_step(comm, ids, grad, params):
    comm.pull_sparse({"emb": np.array(ids)}).wait()
    comm.step(params, {}, {"emb": (np.array(ids), np.full((len(ids), 2), grad, np.float32))})


def local_row(comm, i):
    table = comm._local["emb"]
    row = table.slab[table.index.find(np.array([i]))[0]]
    return row[:2].copy(), row[table.width - 2:].copy()


def wait_for(predicate, seconds=5.0):
    deadline = time.monotonic() + seconds
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert predicate()


def test_an_exchange_landing_late_keeps_what_the_worker_trained_since_its_snapshot(servers):
    config, _ = servers("geo", 2)
    a, b = start_both(config, (1, 100))
    params_a, params_b = {"dense": np.zeros(3, np.float32)}, {"dense": np.zeros(3, np.float32)}
    geo_step(a, [7], 0.0, params_a)           # a holds row 7 = 0 (lands at a's next step)
    geo_step(b, [7], 1.0, params_b)           # b: row 7 = -0.5 locally
    b.flush()                                 # server: 0 + (-0.5) / 2 = -0.25
    geo_step(a, [7], 2.0, params_a)           # a: -1.0; snapshot -1.0, delta -0.5 sent
    wait_for(lambda: a._inflight.done.is_set())  # server: -0.25 - 0.5 = -0.75, in the reply
    geo_step(a, [7], 4.0, params_a)           # a trains on (-2.0 more) before it lands
    value, base = local_row(a, 7)
    # landed inside that step: -0.75 + (-3.0 - -1.0) = -2.75; base -0.75; then the next
    # exchange (k_steps 1) left with the snapshot -2.75
    np.testing.assert_allclose(value, [-2.75, -2.75])
    np.testing.assert_allclose(base, [-0.75, -0.75])
    a.flush()
    np.testing.assert_allclose(local_row(a, 7)[0], [-1.75, -1.75])  # -0.75 + (-2.0) / 2
    got = a.client.pull({"emb": np.array([7])}).wait().sparse["emb"].values
    np.testing.assert_allclose(got, [[-1.75, -1.75]])
    a.stop()
    b.stop()


def test_a_lost_server_fails_the_next_step_naming_it(servers):
    config, (server,) = servers("geo", 1)
    comm = start(config, 0, k_steps=2)
    params = {"dense": np.zeros(3, np.float32)}
    geo_step(comm, [1, 2], 1.0, params)
    server.stop()
    time.sleep(0.3)
    with pytest.raises(PSError, match=r"server 0 \(127\.0\.0\.1:\d+\)"):
        for _ in range(4):  # the exchange at step 2 fails; a later step or the flush says so
            comm.step(params, {}, {"emb": (np.array([1]), np.ones((1, 2), np.float32))})
        comm.flush()
    with pytest.raises(PSError):
        comm.stop()  # its flush cannot reach the server; the threads end all the same
    assert "ps-geo-send" not in {t.name for t in threading.enumerate()}


@pytest.mark.parametrize("mode", ["geo", "async"])
def test_stop_flushes_every_step_and_leaves_no_sending_thread(servers, mode):
    config, (server,) = servers(mode, 1)
    before = set(threading.enumerate())
    comm = start(config, 0, k_steps=5)
    params = {"dense": np.zeros(3, np.float32)}
    for _ in range(3):  # fewer than k_steps: only stop's flush sends them in GEO
        if mode == "geo":
            geo_step(comm, [4], 1.0, params)
        else:
            comm.step(params, {"dense": np.ones(3, np.float32)},
                      {"emb": (np.array([4]), np.ones((1, 2), np.float32))})
    names = {t.name for t in set(threading.enumerate()) - before}
    assert f"ps-{mode}-send" in names
    comm.stop()
    shard = server.shard  # what the server holds once the worker stopped
    np.testing.assert_allclose(shard.sparse["emb"].pull(np.array([4])), [[-1.5, -1.5]])
    if mode == "async":  # 3 steps of lr 0.5
        np.testing.assert_allclose(shard.dense["dense"].pull(), -1.5)
    alive = {t.name for t in threading.enumerate()}
    assert f"ps-{mode}-send" not in alive  # joined by stop
    # the worker's own receive threads end with their links (the server's run on here)
    wait_for(lambda: not [t for t in threading.enumerate() if t.name.startswith("ps-recv server")])
