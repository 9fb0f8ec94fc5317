"""Worker restarts under failover, in one process (servers on threads, real loopback sockets):
a worker whose connection dies is away, not lost; a new process of its rank rejoins; worker 0's
INIT on a restart keeps the trained tables; sync rounds wait for the away worker, drop its
unfinished pushes, and fail naming it once it stays away past the timeout; without failover a
lost worker stays lost. The fleetrun version with a real SIGKILL is in
tests/launch/test_fleetrun_ps_failover.py."""
import logging
import socket
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from fleetx.ps import (DenseTableSpec, InitConfig, KVClient, PSConfig, PSConfigError, PSServer,
                       RuleConfig, SparseTableSpec, Tables)
from fleetx.ps.api import PeerLostError
from fleetx.ps.rounds import START_BARRIER
from fleetx.ps_torch.worker import make_communicator

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import free_ports  # noqa: E402  (tests/helpers.py)

TABLES = Tables((SparseTableSpec("emb", 3, RuleConfig("sgd", lr=1.0),
                                 InitConfig("uniform", low=-1, high=1, seed=5)),),
                (DenseTableSpec("dense", 10, RuleConfig("sgd", lr=1.0)),))
IDS = np.arange(40, dtype=np.int64)
INITIAL = np.linspace(0, 1, 10, dtype=np.float32)
ROWS = np.zeros((len(IDS), 3), np.float32)  # worker 0's initial rows (an nn.Embedding's)


def config(tmp_path, mode="async", failover=True, timeout=20.0, workers=2):
    return PSConfig([f"127.0.0.1:{p}" for p in free_ports(2)], workers, mode=mode,
                    heartbeat_interval=0.2, dead_after=2.0, timeout=timeout,
                    snapshot_dir=str(tmp_path) if failover else None, snapshot_interval=3600.0,
                    snapshot_job="job-a")


def crash(client):
    """What SIGKILL does to a worker's connections: they end, without BYE, and nothing
    reconnects."""
    if client._failover is not None:
        client._failover.stopping = True
    client._heartbeats.stop()
    for link in client._links:
        link.close()


def crash_communicator(comm):
    """``crash`` for a worker driving a communicator: its sending thread ends with it."""
    crash(comm.client)
    comm._stopping.set()
    comm._thread.join(5)


def states(server, rank, want, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.stats()["workers"].get(rank) == want:
            return True
        time.sleep(0.02)
    return False


def dense_of(client):
    return client.pull(dense=["dense"]).wait(10).dense["dense"].copy()


def push(client, k):
    grads = np.full((len(IDS), 3), k, np.float32)
    return client.push({"emb": (IDS, grads)}, {"dense": np.full(10, k, np.float32)})


@pytest.fixture
def cluster(tmp_path):
    made = []

    def make(mode="async", failover=True, timeout=20.0, start=True):
        cfg = config(tmp_path, mode, failover, timeout)
        servers = [PSServer(cfg, i, TABLES).start() for i in range(2)]
        clients = [KVClient(cfg, r, TABLES) for r in range(2)]
        made.append((servers, clients))
        if start:
            for c in clients:
                c.start()
            clients[0].init({"emb": (IDS, ROWS)}, {"dense": INITIAL}).wait(10)
        return cfg, servers, clients

    yield make
    for servers, clients in made:
        for c in clients:
            if c._failover is not None:
                c._failover.stopping = True
            c.stop()
        for s in servers:
            s.stop()


def rejoin(cfg, clients, rank):
    clients[rank] = KVClient(cfg, rank, TABLES)
    clients[rank].start()
    return clients[rank]


def test_a_killed_worker_is_away_and_its_rank_rejoins_while_the_others_train(cluster, caplog):
    cfg, servers, clients = cluster()
    push(clients[0], 1.0).wait(10)
    with caplog.at_level(logging.WARNING, logger="fleetx.ps"):
        crash(clients[1])
        assert all(states(s, 1, "away") for s in servers)
        push(clients[0], 1.0).wait(10)  # the other worker trains on meanwhile
        client = rejoin(cfg, clients, 1)
    assert client.rejoined
    assert all(s.stats()["workers"] == {0: "active", 1: "active"} for s in servers)
    push(client, 1.0).wait(10)
    np.testing.assert_allclose(dense_of(client), INITIAL - 3.0, rtol=1e-6)
    assert "worker 1" in caplog.text and "is away" in caplog.text
    assert "rejoined after" in caplog.text
    assert not any(s.roster.lost for s in servers)


def test_a_second_hello_of_an_active_rank_is_still_refused(cluster):
    cfg, servers, clients = cluster()
    with pytest.raises(PSConfigError, match="worker rank 1 already active"):
        KVClient(cfg, 1, TABLES).start()


def test_worker_0_restarted_inits_nothing_the_trained_dense_values_stay(cluster):
    cfg, servers, clients = cluster()
    for _ in range(3):
        push(clients[0], 0.5).wait(10)
    trained = dense_of(clients[0])
    np.testing.assert_allclose(trained, INITIAL - 1.5)
    rows = clients[1].pull({"emb": IDS}).wait(10).sparse["emb"].expand().copy()
    crash(clients[0])
    assert states(servers[0], 0, "away")
    client = rejoin(cfg, clients, 0)
    # the restarted script's init_worker sends its initial values again, as at the first start
    applied = client.init({"emb": (IDS, ROWS)}, {"dense": INITIAL}).wait(10)
    assert applied == set()
    np.testing.assert_array_equal(dense_of(client), trained)
    np.testing.assert_array_equal(client.pull({"emb": IDS}).wait(10).sparse["emb"].expand(), rows)


def test_the_communicator_of_a_restarted_worker_skips_the_start_barrier(cluster, caplog):
    cfg, servers, clients = cluster(start=False)
    comms = [make_communicator(cfg, r, TABLES) for r in range(2)]
    started = [None, None]

    def start(r):
        started[r] = comms[r].start({"dense": INITIAL})

    threads = [threading.Thread(target=start, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    np.testing.assert_array_equal(started[0]["dense"], INITIAL)
    np.testing.assert_array_equal(started[1]["dense"], INITIAL)
    push(comms[1].client, 2.0).wait(10)
    crash_communicator(comms[0])
    assert states(servers[0], 0, "away")
    again = make_communicator(cfg, 0, TABLES)
    comms.append(again)
    with caplog.at_level(logging.WARNING, logger="fleetx.ps"):
        values = again.start({"dense": INITIAL})  # would hang at the barrier: worker 1 is past
    np.testing.assert_allclose(values["dense"], INITIAL - 2.0)  # the trained values
    assert "worker 0: rejoined the job under way" in caplog.text
    for c in comms[1:]:
        c.stop()


def test_a_restarted_geo_worker_starts_from_the_servers_current_values(cluster):
    cfg, servers, clients = cluster(mode="geo", start=False)
    comms = [make_communicator(cfg, r, TABLES) for r in range(2)]
    threads = [threading.Thread(target=comms[r].start, args=({"dense": INITIAL},))
               for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    delta = np.full(10, 0.25, np.float32)
    comms[1].client.push({}, {"dense": delta}).wait(10)  # a GEO exchange adds its delta
    current = dense_of(comms[1].client)
    np.testing.assert_allclose(current, INITIAL + 0.25)
    crash_communicator(comms[1])
    assert states(servers[0], 1, "away")
    again = make_communicator(cfg, 1, TABLES)
    values = again.start({"dense": INITIAL})
    np.testing.assert_array_equal(values["dense"], current)
    np.testing.assert_array_equal(again._base["dense"], current)  # the base of its deltas
    again.stop()
    comms[0].stop()


def test_sync_a_round_waits_for_the_restarted_worker_and_drops_its_unfinished_push(cluster):
    cfg, servers, clients = cluster(mode="sync")
    stale = push(clients[1], 100.0)  # joins round 1, which waits for worker 0
    time.sleep(0.2)
    crash(clients[1])  # killed in the middle of its round
    assert all(states(s, 1, "away") for s in servers)
    waiting = push(clients[0], 1.0)
    time.sleep(0.5)
    assert not waiting.done()  # the round waits for worker 1: its dead push does not count
    client = rejoin(cfg, clients, 1)
    push(client, 3.0).wait(10)
    waiting.wait(10)
    # the mean of worker 0's push and the restarted worker's, not of the 100 it pushed before
    np.testing.assert_allclose(dense_of(client), INITIAL - 2.0)
    assert not stale.done()  # never answered: its process is gone


def test_sync_a_worker_away_past_the_timeout_fails_the_round_naming_it(cluster):
    cfg, servers, clients = cluster(mode="sync", timeout=2.0)
    crash(clients[1])
    waiting = push(clients[0], 1.0)
    began = time.monotonic()
    with pytest.raises(PeerLostError, match=r"worker 1 .*did not rejoin within 2 s"):
        waiting.wait(15)
    assert time.monotonic() - began < 10


def test_sync_the_stall_deadline_starts_again_when_the_worker_rejoins(cluster):
    cfg, servers, clients = cluster(mode="sync", timeout=3.0)
    crash(clients[1])
    waiting = push(clients[0], 1.0)
    time.sleep(2.0)  # away for 2 s of 3
    client = rejoin(cfg, clients, 1)
    time.sleep(2.0)  # 4 s since the round began, 2 s since it rejoined: not stuck yet
    assert not waiting.done()
    push(client, 1.0).wait(10)
    waiting.wait(10)
    np.testing.assert_allclose(dense_of(client), INITIAL - 1.0)


def test_a_barrier_waits_for_the_away_worker(cluster):
    cfg, servers, clients = cluster(mode="sync")
    crash(clients[1])
    assert states(servers[0], 1, "away")
    entered = clients[0].barrier("epoch")
    time.sleep(0.5)
    assert not entered.done()
    rejoin(cfg, clients, 1).barrier("epoch").wait(10)
    entered.wait(10)


def test_without_failover_a_dead_worker_is_lost_and_its_rank_cannot_return(cluster):
    cfg, servers, clients = cluster(mode="sync", failover=False)
    crash(clients[1])
    assert states(servers[0], 1, "lost")
    with pytest.raises(PeerLostError, match="worker 1"):
        push(clients[0], 1.0).wait(10)
    with pytest.raises(PSConfigError, match="worker rank 1 already lost"):
        KVClient(cfg, 1, TABLES).start()


def test_the_start_barrier_name_is_the_communicators():
    assert START_BARRIER == "fleetx.ps.start"


def test_a_worker_whose_connection_broke_reconnects_to_the_same_server(cluster, caplog):
    """Failover's reconnection also covers a server that never died: the worker's rank is
    away on it until the new link's HELLO, and training goes on."""
    cfg, servers, clients = cluster()
    push(clients[1], 1.0).wait(10)
    with caplog.at_level(logging.WARNING, logger="fleetx.ps"):
        clients[1]._links[0].sock.shutdown(socket.SHUT_RDWR)  # the connection breaks
        push(clients[1], 1.0).wait(15)  # answered once the worker reconnected
    assert "kept running and kept its tables, only the connection broke" in caplog.text
    assert "rejoined after" in caplog.text
    assert all(s.stats()["workers"] == {0: "active", 1: "active"} for s in servers)
    np.testing.assert_allclose(dense_of(clients[0]), INITIAL - 2.0, rtol=1e-6)


def test_a_restarted_process_counts_its_applied_pushes_afresh(cluster):
    """What a server reports lost after its own restart compares the worker's count of
    answered pushes with the snapshot's: a new process of the rank starts both at 0."""
    cfg, servers, clients = cluster()
    for _ in range(3):
        push(clients[1], 0.1).wait(10)
    assert servers[0]._pushes[1] == 3
    crash(clients[1])
    assert states(servers[0], 1, "away")
    clients[1] = KVClient(cfg, 1, TABLES)
    clients[1]._hello_meta = lambda meta=clients[1]._hello_meta(): {**meta, "pid": -1}
    clients[1].start()  # another process of rank 1
    push(clients[1], 0.1).wait(10)
    assert servers[0]._pushes[1] == 1 == clients[1]._failover.acked[0]
