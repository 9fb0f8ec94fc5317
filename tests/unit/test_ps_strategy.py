"""The parameter-server strategy and runtime in one process: the plan's verdicts, what reaches
the communicator, local training (no servers) against plain torch, local save and load, the
learning rate reaching the rules, lookups batched into one pull, and the errors of misuse."""
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from fleetx.fleet import Fleet, PaddleCloudRoleMaker, Role, UserDefinedRoleMaker
from fleetx.nn import SparseEmbedding, SparseEmbeddingBag
from fleetx.ps.api import CommunicatorConfig, StateError
from fleetx.ps_torch.layout import LocalSparseBackend, ModelLayout, RemoteSparseBackend
from fleetx.strategy.api import StrategyError
from fleetx.strategy.distributed_strategy import DistributedStrategy

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from ps_fleet_model import TAGS, VOCAB, batch, loss_of, make_model, reference  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks")
SERVERS = ["127.0.0.1:1", "127.0.0.1:2"]  # nothing listens: planning and wrapping never connect


def ps_fleet(role=Role.WORKER, current_id=0, workers=2, servers=SERVERS, strategy=None,
             model=None, lr=0.1):
    f = Fleet()
    if servers:
        f.init(UserDefinedRoleMaker(current_id=current_id, role=role, worker_num=workers,
                                    server_endpoints=servers))
    else:  # no launcher: a one-process job
        f.init(PaddleCloudRoleMaker(is_collective=False, environ={}))
    model = f.distributed_model(model or make_model())
    opt = f.distributed_optimizer(torch.optim.Adagrad(model.parameters(), lr=lr),
                                  strategy or DistributedStrategy())
    return f, model, opt


def strategy(a_sync=True, **configs):
    s = DistributedStrategy()
    s.a_sync = a_sync
    if configs:
        s.a_sync_configs = configs
    return s


# -- the plan ------------------------------------------------------------------------------------
def test_ps_jobs_plan_the_parameter_server_in_the_mode_asked_for(capsys):
    f, model, _ = ps_fleet(strategy=strategy(True, k_steps=5))
    assert f.applied_strategies() == ("parameter_server",)
    f.explain()
    assert ("parameter_server           applied   geo mode, k_steps=5: 2 server(s), 2 "
            "worker(s); sparse tables: emb, tags") in capsys.readouterr().out
    assert isinstance(model.module.emb, SparseEmbedding)
    assert isinstance(model.module.tags, SparseEmbeddingBag)


def test_sync_with_k_steps_is_refused_naming_the_strategy():
    s = DistributedStrategy()
    s.a_sync = False
    s.a_sync_configs = {"k_steps": 3}
    with pytest.raises(StrategyError, match="parameter_server: a_sync=False .sync. cannot be "
                                            "combined with a_sync_configs.'k_steps'.=3"):
        ps_fleet(strategy=s)


def test_collective_plans_skip_it():
    f = Fleet()
    f.init(is_collective=True)
    f.distributed_optimizer(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))
    entry = next(e for e in f.plan.entries if e.name == "parameter_server")
    assert not entry.applied and entry.reason.startswith("collective mode")


def test_a_sync_configs_and_the_environment_reach_the_communicator(monkeypatch):
    monkeypatch.setenv("FLEETX_TIMEOUT", "42")
    monkeypatch.setenv("FLEETX_PS_DEAD_AFTER", "7.5")
    f, _, _ = ps_fleet(strategy=strategy(True, send_queue_size=3, max_merge_var_num=5,
                                         thread_pool_size=2, send_wait_times=0))
    runtime = f._ctx.runtime
    assert runtime.comm == CommunicatorConfig(k_steps=100, send_queue_size=3,
                                              max_merge_var_num=5, thread_pool_size=2,
                                              send_wait_times=0)
    c = runtime.config
    assert (c.servers, c.num_workers, c.mode.value, c.timeout, c.dead_after) == \
        (tuple(SERVERS), 2, "async", 42.0, 7.5)


def test_servers_and_workers_lay_out_the_same_tables():
    worker = ps_fleet()[0]._ctx.runtime
    server = ps_fleet(role=Role.SERVER, current_id=1)[0]._ctx.runtime
    assert server.is_server and server.index == 1
    assert server.layout.tables.fingerprint() == worker.layout.tables.fingerprint()
    (dense,) = worker.layout.tables.dense  # the embeddings left the optimizer's groups
    assert dense.numel == sum(p.numel() for p in make_model().mlp.parameters())


# -- misuse --------------------------------------------------------------------------------------
def test_misuse_says_what_to_call_first():
    f, model, opt = ps_fleet()
    with pytest.raises(StateError, match=r"call fleet.init_worker\(\) first"):
        model(*batch(0)[:3])
    with pytest.raises(StateError, match="init_server.. runs on servers"):
        f.init_server()
    server = ps_fleet(role=Role.SERVER)[0]
    with pytest.raises(StateError, match="init_worker.. runs on workers"):
        server.init_worker()
    g = Fleet()
    g.init(UserDefinedRoleMaker(role=Role.WORKER, worker_num=1, server_endpoints=SERVERS))
    g.distributed_optimizer(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))
    with pytest.raises(StateError, match=r"call fleet.distributed_model\(model\) before"):
        g.init_worker()


# -- one process, no servers -----------------------------------------------------------------
def test_without_servers_the_same_script_trains_locally_like_torch():
    f, model, opt = ps_fleet(servers=None)
    assert not f.is_server() and f.server_num() == 0
    for step in range(5):  # no init_worker: a local job starts at its first forward
        opt.minimize(loss_of(model, *batch(step)))
    f.stop_worker()
    expected = reference(5)
    with torch.no_grad():
        model.eval()
        np.testing.assert_allclose(model.module.emb(torch.arange(VOCAB)).numpy(),
                                   expected["emb"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(model.module.tags(torch.arange(TAGS).view(-1, 1)).numpy(),
                                   expected["tags"], rtol=1e-5, atol=1e-6)
    for key, value in model.module.mlp.state_dict().items():
        np.testing.assert_allclose(value.numpy(), expected[f"mlp.{key}"], rtol=1e-5, atol=1e-6)


def test_local_save_persistables_then_init_server_resumes(tmp_path):
    f, model, opt = ps_fleet(servers=None)
    f.init_worker()
    for step in range(3):
        opt.minimize(loss_of(model, *batch(step)))
    f.save_persistables(str(tmp_path))
    g, resumed, _ = ps_fleet(servers=None)
    g.init_server(str(tmp_path))
    g.init_worker()
    with torch.no_grad():
        ids = torch.arange(VOCAB)
        np.testing.assert_array_equal(resumed.module.emb(ids).numpy(),
                                      model.module.emb(ids).numpy())
    for p, q in zip(resumed.module.mlp.parameters(), model.module.mlp.parameters()):
        np.testing.assert_array_equal(p.detach().numpy(), q.detach().numpy())


def test_set_lr_and_schedulers_reach_the_sparse_rules():
    f, model, opt = ps_fleet(servers=None)
    f.init_worker()
    rules = f._ctx.runtime._session.backend.tables
    f.set_lr(0.05)
    assert rules["emb"].rule.config.lr == rules["tags"].rule.config.lr == 0.05
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    opt.minimize(loss_of(model, *batch(0)))
    scheduler.step()
    opt.minimize(loss_of(model, *batch(1)))  # the step sends the changed rate first
    assert opt.get_lr() == 0.025 and rules["emb"].rule.config.lr == 0.025


def test_zero_grad_drops_sparse_gradients_not_sent():
    f, model, opt = ps_fleet(servers=None)
    loss_of(model, *batch(0)).backward()
    opt.zero_grad()
    assert f._ctx.runtime.layout.sparse_grads() == {}


# -- lookups -------------------------------------------------------------------------------------
class CountingComm:
    """A communicator stand-in: serves pulls from local tables and counts them."""

    def __init__(self, tables):
        self.local, self.pulls = LocalSparseBackend(tables), []

    def pull_sparse(self, ids, create=True):
        from fleetx.ps.client import PullResult
        from fleetx.ps.tracker import Handle
        self.pulls.append({n: np.asarray(i).copy() for n, i in ids.items()})
        return Handle.resolved(PullResult({n: self.local.lookup(n, i) for n, i in ids.items()},
                                          {}))


def test_the_lookups_of_a_forward_travel_in_one_pull():  # the client de-duplicates them
    model = make_model()
    layout = ModelLayout.of(model, torch.optim.SGD(model.parameters(), lr=0.1))
    comm = CountingComm(layout.tables)
    layout.bind(RemoteSparseBackend(comm))
    ids, tags, x, y = batch(0)
    out = model.emb(ids)
    assert out.shape == (len(ids), 2, 4) and not comm.pulls  # shape known, nothing fetched yet
    loss_of(model, ids, tags, x, y).backward()
    assert len(comm.pulls) == 1
    (pull,) = comm.pulls
    assert sorted(pull) == ["emb", "tags"]
    assert sorted(set(pull["emb"].tolist())) == sorted(set(ids.view(-1).tolist()))
    assert sorted(layout.sparse_grads()) == ["emb", "tags"]


def test_sparse_embedding_bag_matches_nn_embedding_bag():
    torch.manual_seed(1)
    holder = nn.ModuleDict({"bag": nn.EmbeddingBag(10, 3, mode="sum", sparse=True,
                                                   padding_idx=2)})
    want_bag = nn.EmbeddingBag(10, 3, mode="sum", padding_idx=2)
    want_bag.weight.data.copy_(holder["bag"].weight.data)
    layout = ModelLayout.of(holder, torch.optim.SGD(holder.parameters(), lr=0.1))
    backend = LocalSparseBackend(layout.tables)
    backend.assign(layout.initial_sparse())
    layout.bind(backend)
    bag = holder["bag"]
    flat, offsets = torch.tensor([1, 2, 4, 4, 9]), torch.tensor([0, 2])
    weights = torch.tensor([1.0, 2.0, 0.5, 0.5, 3.0])
    got = bag(flat, offsets, per_sample_weights=weights)
    want = want_bag(flat, offsets, per_sample_weights=weights)
    torch.testing.assert_close(got, want)
    got.sum().backward()
    want.sum().backward()
    (ids, grads), = bag.pop_gradients()
    torch.testing.assert_close(torch.from_numpy(grads), want_bag.weight.grad[ids])


def test_deferred_rows_fetch_once_at_first_real_use():
    from fleetx.nn.deferred import DeferredRows
    calls, w = [], torch.arange(6.0).view(2, 3).requires_grad_()

    def produce():
        calls.append(1)
        return w * 2

    d = DeferredRows((2, 3), torch.float32, torch.device("cpu"), produce)
    flat = d.flatten()[1:]  # rearranging keeps it deferred
    assert (d.shape, d.dim(), len(d), flat.shape, d.dtype) == \
        ((2, 3), 2, 2, (5,), torch.float32) and not calls
    total = (flat * 1).sum() + d[1].sum()
    assert calls == [1] and type(total) is torch.Tensor and total.item() == 2 * (15 + 12)
    total.backward()
    assert w.grad.tolist() == [[0, 2, 2], [4, 4, 4]]


def test_an_optimizer_without_a_server_rule_is_refused_when_planning():
    f = Fleet()
    f.init(UserDefinedRoleMaker(role=Role.WORKER, worker_num=1, server_endpoints=SERVERS))
    model = f.distributed_model(make_model())
    with pytest.raises(StrategyError, match="parameter_server: optimizer 'RMSprop' has no "
                                            "parameter-server rule; supported: Adagrad, Adam"):
        f.distributed_optimizer(torch.optim.RMSprop(model.parameters(), lr=0.1))
    with pytest.raises(StrategyError, match=r"Adam\(amsgrad=True\) is not supported"):
        f.distributed_optimizer(torch.optim.Adam(model.parameters(), amsgrad=True))


def test_a_connected_worker_sends_lr_changes_and_is_done_after_stop_worker():
    import socket

    from fleetx.ps import PSServer
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        endpoint = f"127.0.0.1:{s.getsockname()[1]}"
    f, model, opt = ps_fleet(servers=[endpoint], workers=1, strategy=strategy(False))
    runtime = f._ctx.runtime
    server = PSServer(runtime.config, 0, runtime.layout.tables).start()
    try:
        f.init_worker()
        opt.minimize(loss_of(model, *batch(0)))
        f.set_lr(0.02)
        assert [server.shard.table(n).rule.config.lr for n in ("emb", "tags", "dense.0")] == \
            [0.02] * 3
        f.stop_worker()
        with pytest.raises(StateError, match=r"called fleet.stop_worker\(\) and is disconnected"):
            model(*batch(1)[:3])
    finally:
        server.stop()


def test_two_lookups_of_one_table_share_the_pull_and_keep_their_own_rows():
    torch.manual_seed(2)
    holder = nn.ModuleDict({"e": nn.Embedding(8, 3, sparse=True)})
    want = holder["e"].weight.detach().clone()
    layout = ModelLayout.of(holder, torch.optim.SGD(holder.parameters(), lr=0.1))
    comm = CountingComm(layout.tables)
    comm.local.assign(layout.initial_sparse())
    layout.bind(RemoteSparseBackend(comm))
    a, b = torch.tensor([[1, 2], [2, 2]]), torch.tensor([5, 2])
    scale = torch.arange(18.0)
    out = (torch.cat([holder["e"](a).flatten(), holder["e"](b).flatten()]) * scale).sum()
    assert len(comm.pulls) == 1 and comm.pulls[0]["e"].tolist() == [1, 2, 2, 2, 5, 2]
    torch.testing.assert_close(out, (torch.cat([want[a].flatten(), want[b].flatten()])
                                     * scale).sum())
    out.backward()
    grads = holder["e"].pop_gradients()
    assert [ids.tolist() for ids, _ in grads] == [[1, 2], [2, 5]]  # each lookup its own rows
