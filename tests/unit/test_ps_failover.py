"""Server failover in one process (servers on threads, real loopback sockets): snapshots, a
restarted server loading its latest one, a worker reconnecting and resending what was not
answered, and what it reports lost; the flags and variables that turn failover on."""
import logging
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from fleetx.checkpoint import CheckpointError
from fleetx.launch.api import ConfigError
from fleetx.launch.config import LaunchConfig
from fleetx.launch.ps import plan
from fleetx.ps import (DenseTableSpec, InitConfig, KVClient, PSConfig, PSConfigError, PSServer,
                       RuleConfig, SparseTableSpec, Tables)
from fleetx.ps.api import PeerLostError, settings_from_env
from fleetx.ps.partition import server_of
from fleetx.ps.snapshots import Snapshots

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import free_ports  # noqa: E402  (tests/helpers.py)

TABLES = Tables((SparseTableSpec("emb", 3, RuleConfig("adagrad", lr=0.5),
                                 InitConfig("uniform", low=-1, high=1, seed=5)),),
                (DenseTableSpec("dense", 10, RuleConfig("adagrad", lr=0.5)),))
IDS = np.arange(40, dtype=np.int64)


def config(tmp_path, restart=0, job="job-a", **kw):
    ports = kw.pop("ports", None) or free_ports(2)
    return PSConfig([f"127.0.0.1:{p}" for p in ports], 1, mode="async", heartbeat_interval=0.2,
                    dead_after=2.0, timeout=kw.pop("timeout", 20), snapshot_dir=str(tmp_path),
                    snapshot_interval=kw.pop("interval", 3600.0), snapshot_job=job,
                    restart_count=restart, **kw)


def push(client, k=1.0):
    grads = np.full((len(IDS), 3), k, np.float32)
    client.push({"emb": (IDS, grads)}, {"dense": np.full(10, k, np.float32)}).wait(10)


def pulled(client):
    r = client.pull({"emb": IDS}, ["dense"]).wait(10)
    return r.sparse["emb"].expand().copy(), r.dense["dense"].copy()


@pytest.fixture
def job(tmp_path):
    cfg = config(tmp_path)
    servers = [PSServer(cfg, i, TABLES).start() for i in range(2)]
    client = KVClient(cfg, 0, TABLES)
    client.start()
    client.init(dense={"dense": np.linspace(0, 1, 10, dtype=np.float32)}).wait(10)
    yield cfg, servers, client
    client._failover.stopping = True
    client.stop()
    for s in servers:
        s.stop()


def restart(tmp_path, cfg, servers, index):
    """What fleetrun does to a server killed by a signal: the process is gone, a new one with
    the same endpoint and TORCHELASTIC_RESTART_COUNT=1 starts and serves."""
    servers[index].stop()
    ports = [int(e.rpartition(":")[2]) for e in cfg.servers]
    again = config(tmp_path, restart=1, ports=ports)
    servers[index] = PSServer(again, index, TABLES).start()
    return servers[index]


def test_a_restarted_server_serves_its_snapshot_and_the_worker_reports_the_lost_pushes(
        tmp_path, job, caplog):
    cfg, servers, client = job
    push(client)
    servers[0]._snapshot()  # the handler's periodic snapshot, taken now
    at_snapshot = pulled(client)
    push(client, 2.0)
    push(client, 3.0)  # two pushes server 0 takes with it
    after = pulled(client)
    with caplog.at_level(logging.WARNING, logger="fleetx.ps"):
        server = restart(tmp_path, cfg, servers, 0)
        rows, dense = pulled(client)  # waits for the reconnection, then is answered
    lo, hi = server.shard.dense["dense"].start, server.shard.dense["dense"].stop
    # server 0's part is the snapshot's; server 1's part kept the later pushes
    np.testing.assert_array_equal(dense[lo:hi], at_snapshot[1][lo:hi])
    np.testing.assert_array_equal(dense[hi:], after[1][hi:])
    assert not np.array_equal(at_snapshot[1][lo:hi], after[1][lo:hi])
    owned = server_of(IDS, cfg.num_servers, cfg.shard_num) == 0
    assert owned.any() and not owned.all()
    np.testing.assert_array_equal(rows[owned], at_snapshot[0][owned])
    np.testing.assert_array_equal(rows[~owned], after[0][~owned])
    text = caplog.text
    assert "lost server 0" in text and "failover: reconnecting" in text
    assert "push(es) of this worker it had applied after that are lost" in text
    assert "2 push(es)" in text, text
    assert server.restored is not None
    push(client, 1.0)  # training goes on against the restarted server


def test_requests_sent_while_the_server_is_down_are_answered_by_the_restarted_one(tmp_path,
                                                                                     job):
    cfg, servers, client = job
    servers[0]._snapshot()
    servers[0].stop()
    time.sleep(0.3)  # the worker saw the loss: what it sends now waits for the reconnection
    handle = client.pull(dense=["dense"])
    assert not handle.done()
    ports = [int(e.rpartition(":")[2]) for e in cfg.servers]
    servers[0] = PSServer(config(tmp_path, restart=1, ports=ports), 0, TABLES).start()
    assert handle.wait(15).dense["dense"].shape == (10,)


class _BrokenSends:
    """A socket whose sends fail as on a peer that died (EPIPE); everything else is the real
    socket's."""

    def __init__(self, sock):
        self._sock = sock

    def sendmsg(self, *args):
        raise BrokenPipeError(32, "Broken pipe")

    def __getattr__(self, name):
        return getattr(self._sock, name)


@pytest.mark.parametrize("broken", ["first send", "resend"])
def test_a_loss_the_worker_sees_on_its_own_send_reconnects_instead_of_hanging(tmp_path, job,
                                                                              broken):
    """The worker's send, not its receive thread, notices the dead server first (EPIPE): it
    must start the reconnection, not wait on its own lock. Likewise when the restarted server
    dies again while the worker sends it the requests of the last loss."""
    cfg, servers, client = job
    servers[0]._snapshot()
    died_again = threading.Event()
    if broken == "first send":
        client._links[0].sock = _BrokenSends(client._links[0].sock)
    else:
        servers[0].stop()
        time.sleep(0.3)  # lost; the push below waits for the reconnection
        failover, report = client._failover, client._failover._report

        def dies_before_the_resends(*args):
            report(*args)
            failover._report = report
            servers[0].stop()
            client._links[0].sock = _BrokenSends(client._links[0].sock)
            died_again.set()
        failover._report = dies_before_the_resends
    done = []
    thread = threading.Thread(target=lambda: done.append(push(client)), daemon=True)
    thread.start()
    if broken == "first send":
        thread.join(1.0)  # the push is sent: on a link whose sends fail
        servers[0].stop()
    else:
        restart(tmp_path, cfg, servers, 0)
        assert died_again.wait(15)
    restart(tmp_path, cfg, servers, 0)
    thread.join(30)
    assert done == [None], "the push never finished: the worker hangs"
    # the push may have been answered by the first server 0 already (the worker's rank was
    # away there and rejoined on its new link): then the worker reconnects once more, to the
    # restarted server
    deadline = time.monotonic() + 15
    while any(client._failover._down) and time.monotonic() < deadline:
        time.sleep(0.05)
    push(client)  # answered by the restarted server
    assert client._failover.acked[0] >= 1 and not any(client._failover._down)


def test_a_server_that_does_not_come_back_is_named_after_the_timeout(tmp_path):
    cfg = config(tmp_path, timeout=2)
    servers = [PSServer(cfg, i, TABLES).start() for i in range(2)]
    client = KVClient(cfg, 0, TABLES)
    client.start()
    try:
        servers[0].stop()
        with pytest.raises(PeerLostError, match=r"server 0 .*not back within 2 s"):
            client.pull(dense=["dense"]).wait(20)
    finally:
        client.stop()
        servers[1].stop()


def test_a_restart_before_the_first_snapshot_starts_afresh_and_says_so(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="fleetx.ps"):
        server = PSServer(config(tmp_path, restart=1), 0, TABLES)
    assert server.restored is None and not server.shard.initialized
    assert "before its first snapshot" in caplog.text


def test_an_init_is_answered_once_a_snapshot_holds_it(tmp_path, job):
    cfg, servers, client = job
    for i in range(2):  # INIT took a snapshot on each server before answering
        assert Snapshots(cfg, i).available()


def test_another_jobs_snapshot_is_not_loaded(tmp_path, job):
    cfg, servers, client = job
    servers[0]._snapshot()
    other = PSServer(config(tmp_path, restart=1, job="job-b"), 0, TABLES)
    assert other.restored is None
    same = PSServer(config(tmp_path, restart=1), 0, TABLES)
    assert same.restored is not None and same.shard.initialized == {"dense"}


def test_a_damaged_snapshot_is_an_error_naming_the_file(tmp_path, job):
    cfg, servers, client = job
    servers[0]._snapshot()
    snap = Snapshots(cfg, 0)
    folder = next(p for p in Path(snap.dirname).iterdir() if p.name.startswith("save-"))
    victim = next(folder.rglob("dense-dense.npy"))
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"checksum mismatch: .*dense-dense\.npy"):
        PSServer(config(tmp_path, restart=1), 0, TABLES)


SGD = Tables((SparseTableSpec("emb", 2, RuleConfig("sgd", lr=1.0),
                              InitConfig("uniform", low=-1, high=1, seed=5)),),
             (DenseTableSpec("dense", 10, RuleConfig("sgd", lr=1.0)),))


def two_workers(tmp_path, mode, tables):
    ports = free_ports(2)
    cfg = PSConfig([f"127.0.0.1:{p}" for p in ports], 2, mode=mode, heartbeat_interval=0.2,
                   dead_after=2.0, timeout=20, snapshot_dir=str(tmp_path),
                   snapshot_interval=3600.0, snapshot_job="job-m")
    servers = [PSServer(cfg, i, tables).start() for i in range(2)]
    clients = [KVClient(cfg, r, tables) for r in range(2)]
    for c in clients:
        c.start()
    return cfg, ports, servers, clients


def stop_all(servers, clients):
    for c in clients:
        c._failover.stopping = True
        c.stop()
    for s in servers:
        s.stop()


def restarted(tmp_path, cfg, ports, servers, tables, index=0):
    servers[index].stop()
    again = PSConfig(cfg.servers, 2, mode=cfg.mode, heartbeat_interval=0.2, dead_after=2.0,
                     timeout=20, snapshot_dir=str(tmp_path), snapshot_interval=3600.0,
                     snapshot_job="job-m", restart_count=1)
    servers[index] = PSServer(again, index, tables).start()
    return servers[index]


def test_a_sync_server_restarts_from_its_snapshot_and_the_waiting_round_completes(tmp_path):
    """Sync: round 2 (after the snapshot) is lost on server 0 only; round 3, pushed while
    server 0 is down, waits and is applied by the restarted server, as the mean of both."""
    cfg, ports, servers, clients = two_workers(tmp_path, "sync", SGD)
    try:
        start = np.linspace(0, 1, 10, dtype=np.float32)
        clients[0].init(dense={"dense": start}).wait(10)

        def round_of(k):  # worker r pushes k + r everywhere: the round's mean is k + 0.5
            handles = [c.push(dense={"dense": np.full(10, k + r, np.float32)})
                       for r, c in enumerate(clients)]
            return handles
        for h in round_of(1):
            h.wait(10)
        servers[0]._snapshot()
        for h in round_of(2):
            h.wait(10)
        servers[0].stop()
        time.sleep(0.3)
        pending = round_of(3)
        assert not any(h.done() for h in pending)
        restarted(tmp_path, cfg, ports, servers, SGD)
        for h in pending:
            h.wait(15)
        dense = clients[1].pull(dense=["dense"]).wait(10).dense["dense"]
        lo, hi = servers[0].shard.dense["dense"].start, servers[0].shard.dense["dense"].stop
        np.testing.assert_allclose(dense[lo:hi], start[lo:hi] - 1.5 - 3.5, rtol=1e-6)
        np.testing.assert_allclose(dense[hi:], start[hi:] - 1.5 - 2.5 - 3.5, rtol=1e-6)
        for h in round_of(4):  # the rounds go on
            h.wait(10)
    finally:
        stop_all(servers, clients)


def test_a_geo_server_restarts_and_every_worker_gets_back_all_its_rows(tmp_path):
    """GEO: the restarted server holds the snapshot's rows; each worker's next exchange
    brings back every row of that server (not only rows changed since its last exchange),
    so no worker keeps values the server lost."""
    cfg, ports, servers, clients = two_workers(tmp_path, "geo", SGD)
    try:
        ids = np.arange(30, dtype=np.int64)
        mine = server_of(ids, cfg.num_servers, cfg.shard_num) == 0
        assert mine.any() and not mine.all()

        def exchange(c, k=None):  # k None: a worker that changed no row asks what changed
            sparse = {} if k is None else {"emb": (ids, np.full((30, 2), k, np.float32))}
            return c.push(sparse, delta=True, geo_pull=["emb"]).wait(10)[1]["emb"]
        exchange(clients[0], 1.0)
        exchange(clients[1])
        assert len(exchange(clients[1])[0]) == 0  # worker 1 is up to date
        servers[0]._snapshot()
        at_snapshot = servers[0].shard.sparse["emb"].pull(ids[mine], create=False).copy()
        exchange(clients[0], 2.0)  # lost on server 0 with it
        restarted(tmp_path, cfg, ports, servers, SGD)
        got_ids, rows = exchange(clients[1])
        back = np.isin(ids, got_ids)
        assert back[mine].all()  # every row of the restarted server, changed or not
        order = np.argsort(got_ids)
        served = dict(zip(got_ids[order].tolist(), rows[order]))
        np.testing.assert_array_equal(np.stack([served[i] for i in ids[mine]]), at_snapshot)
        assert len(exchange(clients[1])[0]) == 0  # then only changed rows again
    finally:
        stop_all(servers, clients)


FAILOVER = ("snapshot_dir", "snapshot_interval", "snapshot_job", "restart_count")


def test_the_variables_fleetrun_writes_turn_failover_on():
    off = settings_from_env({"TORCHELASTIC_RESTART_COUNT": "3", "FLEETX_PS_JOB_ID": "j"})
    assert off.snapshot_dir is None and not off.config(("127.0.0.1:1",), 1).failover
    assert (off.restart_count, off.snapshot_job) == (0, "")  # read only with failover on
    got = settings_from_env({"FLEETX_PS_CHECKPOINT_DIR": "/s", "FLEETX_PS_CHECKPOINT_INTERVAL":
                             "2.5", "FLEETX_PS_JOB_ID": "j", "TORCHELASTIC_RESTART_COUNT": "1"})
    assert {k: getattr(got, k) for k in FAILOVER} == {
        "snapshot_dir": "/s", "snapshot_interval": 2.5, "snapshot_job": "j", "restart_count": 1}


def _plan(tmp_path, **kw):
    cfg = LaunchConfig(training_script=__file__, server_num=1, worker_num=1,
                       log_dir=str(tmp_path / "log"), **kw)
    return plan(cfg, is_local=lambda a: True, free_ports=lambda n: free_ports(n),
                make_secret=lambda: "s" * 64)


def test_max_restarts_turns_failover_on_for_every_process(tmp_path):
    p = _plan(tmp_path, max_restarts=2, checkpoint_interval="2m")
    assert p.max_restarts == 2
    for proc in p.local:
        assert proc.env["FLEETX_PS_CHECKPOINT_DIR"] == str(tmp_path / "log" / "ps_snapshots")
        assert proc.env["FLEETX_PS_CHECKPOINT_INTERVAL"] == "120"
        assert proc.env["FLEETX_PS_JOB_ID"]
    assert "failover" in p.describe()
    p = _plan(tmp_path, max_restarts=1, checkpoint_dir=str(tmp_path / "snaps"))
    assert p.local[0].env["FLEETX_PS_CHECKPOINT_DIR"] == str(tmp_path / "snaps")
    assert p.local[0].env["FLEETX_PS_CHECKPOINT_INTERVAL"] == "30"
    assert "FLEETX_PS_CHECKPOINT_DIR" not in _plan(tmp_path).local[0].env


@pytest.mark.parametrize("kw, flag, message", [
    ({"checkpoint_interval": "10"}, "--checkpoint_interval", "give --max_restarts"),
    ({"checkpoint_dir": "x"}, "--checkpoint_dir", "give --max_restarts"),
])
def test_snapshot_flags_without_max_restarts_are_refused(tmp_path, kw, flag, message):
    with pytest.raises(ConfigError, match=message) as e:
        _plan(tmp_path, **kw)
    assert flag in str(e.value)


@pytest.mark.parametrize("text, seconds", [("30", 30.0), ("30s", 30.0), ("2.5m", 150.0),
                                           ("1h", 3600.0)])
def test_the_interval_syntax(tmp_path, text, seconds):
    assert _plan(tmp_path, max_restarts=1, checkpoint_interval=text).local[0].env[
        "FLEETX_PS_CHECKPOINT_INTERVAL"] == f"{seconds:g}"


@pytest.mark.parametrize("text", ["soon", "0", "-1s", "inf"])
def test_a_bad_interval_names_the_flag_and_the_syntax(text):
    with pytest.raises(ConfigError, match="--checkpoint_interval"):
        LaunchConfig(training_script=__file__, server_num=1, worker_num=1, max_restarts=1,
                     checkpoint_interval=text)
