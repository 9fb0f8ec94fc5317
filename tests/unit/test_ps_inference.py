"""Inference on the servers (servers on threads, real loopback sockets): a read-only server
refuses every write and every new row naming the mode, and accepts only reading workers; a
worker that turned to inference (INFER) has its writes refused, leaves the sync rounds (which
go on without it) and still takes part in barriers. And ``DistributedInfer`` in one process:
refused in a collective job, building the tables itself, refusing to load into a started job."""
import dataclasses
import time

import numpy as np
import pytest
import torch
from torch import nn

from fleetx.fleet import Fleet, FleetError, PaddleCloudRoleMaker
from fleetx.fleet.ps_util import DistributedInfer
from fleetx.ps import (DenseTableSpec, InitConfig, KVClient, PSConfig, PSConfigError, PSServer,
                       RemoteError, RuleConfig, SparseTableSpec, Tables)
from fleetx.ps.api import StateError
from fleetx.ps.rounds import Waiting, Waits, stalled

TABLES = Tables((SparseTableSpec("emb", 2, RuleConfig("sgd", lr=1.0),
                                 InitConfig("constant", value=1.0)),),
                (DenseTableSpec("dense", 4, RuleConfig("sgd", lr=1.0)),))
F32 = np.float32
GRAD = {"emb": (np.array([1, 2]), np.ones((2, 2), F32))}


@pytest.fixture
def cluster(tmp_path):
    servers, clients = [], []

    def make(workers=1, read_only=False, infer=(), connect=None, **kw):
        cfg = PSConfig(["127.0.0.1:0"], workers, heartbeat_interval=0.3, dead_after=5.0,
                       timeout=30.0, save_root=str(tmp_path), **kw)
        servers.append(PSServer(cfg, 0, TABLES, read_only=read_only).start())
        cfg = dataclasses.replace(cfg, servers=(servers[-1].endpoint,))
        made = [KVClient(cfg, r, TABLES, infer=r in infer)
                for r in range(workers if connect is None else connect)]
        for c in made:
            c.start()
        clients.extend(made)
        return servers[-1], made
    yield make
    for c in clients:
        c.stop()
    for s in servers:
        s.stop()


def rows(client, ids=(1, 2)):
    return client.pull({"emb": np.array(ids)}, create=False).wait(10).sparse["emb"].values.copy()


def test_a_read_only_server_refuses_every_write_naming_the_mode(cluster):
    server, (c,) = cluster(read_only=True, infer=(0,))
    mode = r"serves an inference-only job \(read-only tables: no updates, no new rows\)"
    for call, what in ((lambda: c.push(GRAD), "PUSH"),
                       (lambda: c.push({}, {"dense": np.ones(4, F32)}), "PUSH"),
                       (lambda: c.init(GRAD, force=True), "INIT"),
                       (lambda: c.set_lr(0.5), "SET_LR"),
                       (lambda: c.pull({"emb": np.array([7])}, create=True),
                        r"a PULL that may create rows \(create=true\)")):
        with pytest.raises(RemoteError, match=f"RequestError: {what} refused: server 0 "
                                              f"\\(.*\\) {mode}"):
            call().wait(10)
    np.testing.assert_array_equal(rows(c), np.ones((2, 2)))  # reads: initial rows, not created
    assert server.stats()["rows"] == {"emb": 0}
    c.pull(dense=["dense"]).wait(10)  # a PULL of dense tables creates nothing: allowed


def test_a_read_only_server_turns_away_a_training_worker(cluster):
    server, _ = cluster(workers=2, read_only=True, infer=(0,), connect=1)
    cfg = dataclasses.replace(server.config, servers=(server.endpoint,))
    trainer = KVClient(cfg, 1, TABLES)
    with pytest.raises(PSConfigError, match=r"worker 1 wants to train, but server 0 \(.*\) "
                                            r"serves an inference-only job"):
        trainer.start()
    trainer.stop()


def test_a_worker_that_turned_to_inference_cannot_write(cluster):
    server, (c0, c1) = cluster(workers=2, mode="async")
    c0.push(GRAD).wait(10)
    c0.turn_to_inference().wait(10)
    with pytest.raises(RemoteError, match=r"PUSH refused: worker 0 \(pid \d+ on .*\) turned to "
                                          r"inference .*read-only for it"):
        c0.push(GRAD).wait(10)
    with pytest.raises(RemoteError, match="PULL that may create rows"):
        c0.pull({"emb": np.array([99])}, create=True).wait(10)
    c1.push(GRAD).wait(10)  # the other worker still trains
    np.testing.assert_array_equal(rows(c0), np.full((2, 2), -1.0))
    assert server.stats()["rows"] == {"emb": 2}


def test_sync_rounds_go_on_without_a_worker_in_inference_and_barriers_wait_for_it(cluster):
    server, (c0, c1) = cluster(workers=2, mode="sync")
    c0.push(GRAD), c1.push(GRAD).wait(10)  # one round with both
    pending = c1.push(GRAD)
    time.sleep(0.3)
    assert not pending.done()  # waits for worker 0's push of this step
    c0.turn_to_inference().wait(10)
    pending.wait(10)  # now the round is worker 1 alone
    np.testing.assert_array_equal(rows(c0), np.full((2, 2), -1.0))  # 1 - mean(1,1) - 1
    barrier = c1.barrier("b")
    time.sleep(0.3)
    assert not barrier.done()  # worker 0 reads, but it is still a member of the job
    c0.barrier("b").wait(10)
    barrier.wait(10)


def test_a_stalled_sync_round_does_not_blame_a_worker_in_inference():
    waits = Waits()
    waits.push(1, Waiting(None, None, None, since=0.0))
    last = {0: 0.0, 1: 0.0}
    assert [s.rank for s in stalled(waits, last, [0, 1], 100.0, 10.0)] == [0]
    assert stalled(waits, last, [0, 1], 100.0, 10.0, round_expected=[1]) == []


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 2, sparse=True)
        self.mlp = nn.Linear(4, 1)

    def forward(self, ids):
        return self.mlp(self.emb(ids).flatten(1))


def test_distributed_inference_is_for_parameter_server_jobs():
    f = Fleet()
    f.init(is_collective=True)
    with pytest.raises(FleetError, match="DistributedInfer serves parameter-server jobs"):
        DistributedInfer(nn.Linear(1, 1), fleet=f).init_distributed_infer_env()


def test_distributed_inference_without_servers_needs_a_trained_or_loaded_model(one_process):
    f = Fleet()
    f.init(PaddleCloudRoleMaker(is_collective=False, environ={}))
    torch.manual_seed(0)
    infer = DistributedInfer(Net(), fleet=f)
    infer.init_distributed_infer_env()  # builds the tables itself: no optimizer was given
    model = infer.get_dist_infer_program()
    assert not model.training
    with pytest.raises(StateError, match="evaluating a model that was neither trained nor "
                                         "loaded"):
        model(torch.tensor([[1, 2]]))
    with pytest.raises(StateError, match="optimizer step in inference mode"):
        f._ctx.runtime.step()


def test_a_started_one_process_job_cannot_load_a_save_for_inference(one_process):
    f = Fleet()
    f.init(PaddleCloudRoleMaker(is_collective=False, environ={}))
    torch.manual_seed(0)
    model = f.distributed_model(Net())
    opt = f.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    opt.minimize(model(torch.tensor([[1, 2]])).sum())
    with pytest.raises(StateError, match="init_server.. after the job started"):
        DistributedInfer(model, fleet=f).init_distributed_infer_env(dirname="ckpt")
    DistributedInfer(model, fleet=f).init_distributed_infer_env()  # what it trained: fine
    assert model.eval()(torch.tensor([[1, 2]])).shape == (1, 1)


def test_an_inference_only_job_waits_for_no_heter_worker(tmp_path):
    import threading
    cfg = PSConfig(["127.0.0.1:0"], 1, heartbeat_interval=0.3, dead_after=5.0, timeout=30.0,
                   save_root=str(tmp_path), heter_workers=("127.0.0.1:9",))
    server = PSServer(cfg, 0, TABLES, read_only=True).start()
    done = threading.Thread(target=server.run, daemon=True)
    done.start()
    reader = KVClient(dataclasses.replace(cfg, servers=(server.endpoint,)), 0, TABLES, infer=True)
    reader.start()
    reader.stop()
    done.join(10)
    assert not done.is_alive()  # finished once its one worker stopped: no heter rank awaited
