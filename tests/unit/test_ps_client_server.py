"""Client and server in one process (servers on threads, real loopback sockets): requests,
initial values, lr changes, errors, save/load round trips, GEO with one worker, async merging."""
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from fleetx.ps import (CommunicatorConfig, PSConfigError, DenseTableSpec, InitConfig, KVClient,
                       PSConfig, PSServer, RuleConfig, SparseTableSpec, Tables)
from fleetx.ps_torch import make_communicator
from fleetx.checkpoint import SaveWriter
from fleetx.ps.initializers import initial_rows

INIT = InitConfig("uniform", low=-1, high=1, seed=5)


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import free_ports  # noqa: E402  (tests/helpers.py)


def make_tables(sparse_rule=RuleConfig("sgd", lr=0.5), dense_rule=RuleConfig("sgd", lr=0.5),
                dim=3, numel=10, bounded=None):
    return Tables((SparseTableSpec("emb", dim, sparse_rule, INIT),
                   SparseTableSpec("small", 2, sparse_rule, InitConfig("constant"), bounded)),
                  (DenseTableSpec("dense", numel, dense_rule),))


class Cluster:
    def __init__(self, tables, servers=2, workers=1, mode="async", load=None, save_root=None):
        self.config = PSConfig([f"127.0.0.1:{p}" for p in free_ports(servers)], workers,
                               mode=mode, heartbeat_interval=0.2, dead_after=3.0, timeout=20,
                               save_root=save_root)
        self.tables = tables
        self.servers = [PSServer(self.config, i, tables, load_dir=load).start()
                        for i in range(servers)]

    def client(self, rank=0):
        c = KVClient(self.config, rank, self.tables)
        c.start()
        return c

    def stop(self):
        for s in self.servers:
            s.stop()


def save(client, dirname):
    """What a communicator's save does without the dense copy: the servers write, we commit."""
    writer = SaveWriter(dirname)
    rows, files = client.save(writer.dirname, writer.save_id).wait()
    writer.add(files)
    writer.commit()
    return rows


@pytest.fixture
def cluster(tmp_path):
    made = []

    def make(*a, **k):
        made.append(Cluster(*a, **{"save_root": str(tmp_path), **k}))
        return made[-1]
    yield make
    for c in made:
        c.stop()


def test_pull_push_and_dense_push_pull_in_one_round_trip(cluster):
    c = cluster(make_tables()).client()
    ids = np.array([[7, -2], [7, 10 ** 15]])
    first = c.pull({"emb": ids}).wait().sparse["emb"]
    np.testing.assert_array_equal(first.expand()[0, 0], initial_rows(np.array([7]), 3, INIT)[0])
    assert first.expand().shape == (2, 2, 3)
    c.init(dense={"dense": np.arange(10, dtype=np.float32)}).wait()
    flat, _ = c.push({"emb": (ids.reshape(-1), np.ones((4, 3), np.float32))},
                     {"dense": np.ones(10, np.float32)}, pull_dense=["dense"]).wait()
    np.testing.assert_allclose(flat["dense"], np.arange(10) - 0.5)
    after = c.pull({"emb": ids}).wait().sparse["emb"].expand()
    np.testing.assert_allclose(after[0, 0], first.expand()[0, 0] - 2 * 0.5)  # id 7 twice
    np.testing.assert_allclose(after[1, 1], first.expand()[1, 1] - 0.5)
    stats = c.stats().wait()
    assert sum(s["rows"]["emb"] for s in stats) == 3
    c.stop()


def test_init_is_kept_by_servers_that_loaded_a_checkpoint_and_set_lr_reaches_them(cluster,
                                                                                   tmp_path):
    tables = make_tables()
    c = cluster(tables).client()
    assert c.init(dense={"dense": np.ones(10, np.float32)}).wait() == {"dense"}
    c.set_lr(0.25).wait()
    flat, _ = c.push(dense={"dense": np.ones(10, np.float32)}, pull_dense=["dense"]).wait()
    np.testing.assert_allclose(flat["dense"], 0.75)
    save(c, tmp_path / "ckpt")
    c.stop()

    c2 = cluster(tables, load=str(tmp_path / "ckpt")).client()
    assert "dense" in c2.initialized
    assert c2.init(dense={"dense": np.zeros(10, np.float32)}).wait() == set()
    np.testing.assert_allclose(c2.pull(dense=["dense"]).wait().dense["dense"], 0.75)
    c2.stop()


@pytest.mark.parametrize("load_servers", [2, 3])
def test_save_then_load_restores_rows_and_optimizer_state(cluster, tmp_path, load_servers):
    """Adam rows and dense slices survive a save/load (also onto another number of servers):
    continuing after the load equals continuing without it."""
    tables = make_tables(RuleConfig("adam", lr=0.1), RuleConfig("adam", lr=0.1))
    rng = np.random.default_rng(0)
    ids = rng.integers(-10 ** 9, 10 ** 9, 200)
    grads = [rng.standard_normal((200, 3)).astype(np.float32) for _ in range(3)]
    first = cluster(tables, servers=2)
    c = first.client()
    c.init(dense={"dense": np.arange(10, dtype=np.float32)}).wait()
    for g in grads[:2]:
        c.push({"emb": (ids, g)}, {"dense": g[0, :1].repeat(10)}).wait()
    assert save(c, tmp_path / "ckpt") == {"emb": 200, "small": 0}
    c.push({"emb": (ids, grads[2])}, {"dense": grads[2][0, :1].repeat(10)}).wait()
    expected = c.pull({"emb": ids}, dense=["dense"]).wait()
    c.stop()

    c2 = cluster(tables, servers=load_servers, load=str(tmp_path / "ckpt")).client()
    c2.push({"emb": (ids, grads[2])}, {"dense": grads[2][0, :1].repeat(10)}).wait()
    got = c2.pull({"emb": ids}, dense=["dense"]).wait()
    np.testing.assert_array_equal(got.sparse["emb"].expand(), expected.sparse["emb"].expand())
    np.testing.assert_array_equal(got.dense["dense"], expected.dense["dense"])
    c2.stop()


def test_layout_and_mode_mismatches_are_refused_at_hello(cluster):
    cl = cluster(make_tables())
    other = KVClient(cl.config, 0, make_tables(dim=4))
    with pytest.raises(PSConfigError,
                       match=r"server \d \(127.0.0.1:\d+\): worker 0 has another table layout"):
        other.start()
    other.stop()
    wrong = KVClient(PSConfig(cl.config.servers, 1, mode="sync", timeout=5), 0, cl.tables)
    with pytest.raises(PSConfigError, match="worker 0 runs mode 'sync', this server runs 'async'"):
        wrong.start()
    wrong.stop()


def test_bounded_ids_and_read_only_pulls(cluster):
    c = cluster(make_tables(bounded=4)).client()
    with pytest.raises(PSConfigError,
                       match=r"table 'small': ids must be in \[0, 4\); got \[0, 4\]"):
        c.pull({"small": np.array([0, 4])})
    c.pull({"emb": np.array([1])}).wait()
    c.pull({"emb": np.array([1, 2, 3])}, create=False).wait()
    assert sum(s["rows"]["emb"] for s in c.stats().wait()) == 1
    c.stop()


def test_barrier_waits_for_every_worker(cluster):
    cl = cluster(make_tables(), workers=2)
    c0, c1 = cl.client(0), cl.client(1)
    h = c0.barrier("x")
    assert not h.done()
    threading.Timer(0.3, lambda: c1.barrier("x").wait()).start()
    h.wait(5)
    c0.stop()
    c1.stop()


def local_reference(steps, lr, numel=6):
    """The GEO test model trained by torch SGD in one process."""
    emb = torch.nn.Parameter(torch.from_numpy(initial_rows(np.arange(5), 3, INIT)))
    w = torch.nn.Parameter(torch.from_numpy(np.linspace(-1, 1, numel, dtype=np.float32)))
    opt = torch.optim.SGD([emb, w], lr=lr)
    for s in range(steps):
        ids = torch.tensor([s % 5, (2 * s) % 5, 1])
        loss = ((emb[ids].sum(0) * w[:3]).sum() + w[3:].pow(2).sum()) ** 2
        opt.zero_grad()
        loss.backward()
        opt.step()
    return emb.detach().numpy(), w.detach().numpy()


@pytest.mark.parametrize("k_steps", [1, 3])
def test_geo_with_one_worker_equals_local_training(cluster, k_steps):
    lr, steps = 0.05, 7
    tables = make_tables(RuleConfig("sgd", lr=lr), RuleConfig("sgd", lr=lr), numel=6)
    cl = cluster(tables, mode="geo")
    comm = make_communicator(cl.config, 0, tables, CommunicatorConfig(k_steps=k_steps))
    w = comm.start(dense={"dense": np.linspace(-1, 1, 6, dtype=np.float32)})["dense"].copy()
    for s in range(steps):
        ids = np.array([s % 5, (2 * s) % 5, 1])
        rows = torch.from_numpy(comm.pull_sparse({"emb": ids}).wait().sparse["emb"].expand())
        rows.requires_grad_()
        wt = torch.from_numpy(w.copy()).requires_grad_()
        loss = ((rows.sum(0) * wt[:3]).sum() + wt[3:].pow(2).sum()) ** 2
        loss.backward()
        w -= lr * wt.grad.numpy()  # the user's optimizer, locally
        params = {"dense": w}
        comm.step(params, {"dense": wt.grad.numpy()}, {"emb": (ids, rows.grad.numpy())})
    comm.flush()
    server = comm.client.pull({"emb": np.arange(5)}, dense=["dense"]).wait()
    comm.stop()
    emb, dense = local_reference(steps, lr)
    np.testing.assert_allclose(server.dense["dense"], dense, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(server.sparse["emb"].expand(), emb, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(w, dense, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("recv", [{}, {"independent_recv_thread": True,
                                        "min_send_grad_num_before_recv": 2}])
def test_async_communicator_merges_queued_steps(cluster, recv):
    tables = make_tables(RuleConfig("sgd", lr=1.0), RuleConfig("sgd", lr=1.0))
    cl = cluster(tables, servers=1)
    comm = make_communicator(cl.config, 0, tables, CommunicatorConfig(
        max_merge_var_num=8, send_wait_times=20, send_queue_size=32, **recv))
    comm.start(dense={"dense": np.zeros(10, np.float32)})
    sent = []
    push = comm.client.push
    comm.client.push = lambda *a, **k: sent.append(bool(k["pull_dense"])) or push(*a, **k)
    params = {"dense": np.zeros(10, np.float32)}
    for step in range(20):
        comm.step(params, {"dense": np.ones(10, np.float32)},
                  {"emb": (np.array([1, 1, 2]), np.ones((3, 3), np.float32))})
    comm.flush()
    assert len(sent) < 20  # steps were merged into fewer pushes
    every = 2 if recv else 1  # a merged push counts once
    assert sent == [(i + 1) % every == 0 for i in range(len(sent))]
    got = comm.client.pull({"emb": np.array([1, 2])}, dense=["dense"]).wait()
    np.testing.assert_allclose(got.dense["dense"], -20.0)
    np.testing.assert_allclose(got.sparse["emb"].values - initial_rows(got.sparse["emb"].ids, 3,
                                                                      INIT),
                               [[-40.0] * 3, [-20.0] * 3], rtol=1e-6)
    comm.stop()


@pytest.mark.parametrize("independent, every", [(False, 1), (True, 1), (True, 3)])
def test_async_dense_weights_come_back_every_min_send_grad_num_before_recv_pushes(
        cluster, independent, every):
    """independent_recv_thread + min_send_grad_num_before_recv: only every k-th push's reply
    carries the dense weights (without independent_recv_thread, every push's); the servers
    still apply every push, and the weights a step hands over are the servers' at that push."""
    tables = make_tables(RuleConfig("sgd", lr=1.0), RuleConfig("sgd", lr=1.0))
    cl = cluster(tables, servers=2)
    comm = make_communicator(cl.config, 0, tables, CommunicatorConfig(
        independent_recv_thread=independent, min_send_grad_num_before_recv=every))
    comm.start(dense={"dense": np.zeros(10, np.float32)})
    asked = []
    push = comm.client.push
    comm.client.push = lambda *a, **k: asked.append(bool(k["pull_dense"])) or push(*a, **k)
    params = {"dense": np.zeros(10, np.float32)}
    seen = []
    for step in range(9):
        comm.step(params, {"dense": np.ones(10, np.float32)}, {})
        comm.flush()  # one push per step: its reply has landed before the next step
        seen.append(float(params["dense"][0]))
    comm.step(params, {"dense": np.zeros(10, np.float32)}, {})
    seen.append(float(params["dense"][0]))
    comm.flush()
    assert asked == [(i + 1) % every == 0 for i in range(10)]
    # the weights after push i (i + 1 unit gradients) reach params at the step after it
    want, latest = [0.0], 0.0
    for i in range(9):
        latest = -(i + 1.0) if asked[i] else latest
        want.append(latest)
    assert seen == want[:10]
    got = comm.client.pull(dense=["dense"]).wait()
    np.testing.assert_allclose(got.dense["dense"], -9.0)  # every push was applied
    comm.stop()


def test_async_refresh_drops_an_older_reply_so_the_next_step_keeps_the_pulled_weights(cluster):
    """A reply not yet handed over when refresh() pulls newer weights must not take the model
    back at the next step."""
    tables = make_tables(RuleConfig("sgd", lr=1.0), RuleConfig("sgd", lr=1.0))
    cl = cluster(tables, servers=1, workers=2)
    comm = make_communicator(cl.config, 0, tables, CommunicatorConfig(
        independent_recv_thread=True, min_send_grad_num_before_recv=2))
    comm.start(dense={"dense": np.zeros(10, np.float32)}, meet=False)
    params = {"dense": np.zeros(10, np.float32)}
    for _ in range(2):
        comm.step(params, {"dense": np.ones(10, np.float32)}, {})
        comm.flush()  # the second push's reply (weights -2) waits to be handed over
    other = cl.client(rank=1)
    other.push(dense={"dense": np.ones(10, np.float32)}).wait()  # the servers move on: -3
    params["dense"] = comm.refresh(["dense"])["dense"]
    np.testing.assert_allclose(params["dense"], -3.0)
    comm.step(params, {"dense": np.zeros(10, np.float32)}, {})
    np.testing.assert_allclose(params["dense"], -3.0)  # not the older reply's -2
    comm.flush()
    other.stop()
    comm.stop()


def test_an_async_session_ends_with_the_servers_weights_when_replies_skip_them(cluster):
    """stop_worker leaves the model holding the servers' final dense weights even when the
    last pushes' replies carried none (independent_recv_thread)."""
    from fleetx.ps_torch.layout import ModelLayout
    from fleetx.ps_torch.sessions import RemoteSession
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    layout = ModelLayout.of(model, opt)
    cl = cluster(layout.tables, servers=2)
    session = RemoteSession(layout, cl.config, 0, CommunicatorConfig(
        independent_recv_thread=True, min_send_grad_num_before_recv=4))
    x = torch.randn(8, 4)
    for _ in range(3):  # three pushes, none of whose replies brings the weights back
        opt.zero_grad()
        model(x).square().mean().backward()
        session.step(opt)
    before = [p.detach().clone() for p in model.parameters()]
    session.stop()
    # the servers' values, read in their process (a job whose workers all stopped takes no
    # new connection): each server holds its slice of every dense table, in server order
    servers = np.concatenate([np.concatenate([s.shard.table(t.name).pull() for s in cl.servers])
                              for t in layout.tables.dense])
    flat = np.concatenate([p.detach().numpy().reshape(-1) for p in model.parameters()])
    np.testing.assert_allclose(servers, flat, rtol=1e-6)
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_min_send_grad_num_before_recv_is_read_from_the_strategy():
    from fleetx.strategy.algorithms.a_sync import AsyncConfig
    c = AsyncConfig(independent_recv_thread=True, min_send_grad_num_before_recv=4)
    comm = CommunicatorConfig.from_a_sync_configs(c.to_dict())
    assert (comm.independent_recv_thread, comm.recv_every) == (True, 4)
    assert CommunicatorConfig.from_a_sync_configs(
        {"min_send_grad_num_before_recv": 4}).recv_every == 1  # Paddle: needs the thread
    with pytest.raises(PSConfigError, match="independent_recv_thread"):
        CommunicatorConfig(independent_recv_thread=1)


def test_servers_log_rows_memory_and_request_rate(caplog):
    tables = make_tables()
    config = PSConfig([f"127.0.0.1:{free_ports(1)[0]}"], 1, log_interval=0.3, timeout=20)
    server = PSServer(config, 0, tables).start()
    with caplog.at_level("INFO", logger="fleetx.ps"):
        c = KVClient(config, 0, tables)
        c.start()
        c.pull({"emb": np.arange(5)}).wait()
        deadline = threading.Event()
        deadline.wait(0.8)
        c.stop()
    server.stop()
    lines = [r.getMessage() for r in caplog.records if "requests/s" in r.getMessage()]
    assert lines and "emb 5 rows" in lines[-1] and "MiB" in lines[-1], caplog.text


def test_first_worker_saves_dense_values_beside_the_server_shards(cluster, tmp_path):
    from fleetx.ps.checkpoint import load_dense
    tables = make_tables()
    cl = cluster(tables, mode="sync")
    comm = make_communicator(cl.config, 0, tables)
    params = comm.start(dense={"dense": np.ones(10, np.float32)})
    comm.step(params, {"dense": np.ones(10, np.float32)},
              {"emb": (np.array([3, 4]), np.ones((2, 3), np.float32))})
    assert comm.save(tmp_path / "ckpt") == {"emb": 2, "small": 0}
    np.testing.assert_allclose(load_dense(tmp_path / "ckpt")["dense"], 0.5)
    np.testing.assert_allclose(params["dense"], 0.5)
    ckpt = tmp_path / "ckpt"
    save_folder, = ckpt.glob("save-*")
    assert sorted(p.name for p in ckpt.iterdir()) == ["manifest.json", save_folder.name]
    assert sorted(p.name for p in save_folder.iterdir()) == [
        "dense-dense.npy", "dense.json", "server-0-of-2", "server-1-of-2"]
    comm.stop()
