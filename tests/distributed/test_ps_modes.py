"""Sync and async modes on real processes over loopback (numpy-only servers and workers).

* sync: 2 servers + 2 workers, each worker training on half of every batch, end with the same
  dense weights and rows as one torch process training on the union batch (1e-5), with Adam on
  the dense table and Adagrad on the sparse table; over the TCP links and over the ZeroMQ
  transport kept for comparison (``FLEETX_PS_TRANSPORT=zmq``, needs pyzmq).
* async: gradients that do not depend on the weights, merged by the communicator, add up on
  the servers to exactly the sum of every worker's gradients.
* a worker that stops early does not block the others: their sync steps go on with it
  excluded, and reads never wait.
"""
import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from ps_cluster import (DIM, NUMEL, SLOTS, VOCAB, batch, finish, free_ports,  # noqa: E402
                        initial_dense, start_server, start_worker, write_cluster)

from fleetx.ps import DenseTableSpec, InitConfig, RuleConfig, SparseTableSpec, Tables  # noqa
from fleetx.ps.initializers import initial_rows  # noqa: E402

INIT = InitConfig("uniform", low=-0.5, high=0.5, seed=11)
TRANSPORTS = ["tcp", pytest.param("zmq", marks=pytest.mark.skipif(
    importlib.util.find_spec("zmq") is None, reason="pyzmq not installed (the bench extra)"))]


def cluster(tmp_path, mode, servers, workers, sparse_rule, dense_rule, transport="tcp"):
    tables = Tables((SparseTableSpec("emb", DIM, sparse_rule, INIT),),
                    (DenseTableSpec("dense", NUMEL, dense_rule),))
    config = {"servers": [f"127.0.0.1:{p}" for p in free_ports(servers)],
              "num_workers": workers, "mode": mode, "heartbeat_interval": 0.5,
              "dead_after": 5.0, "timeout": 30.0, "transport": transport}
    return write_cluster(tmp_path / "cluster.json", config, tables.to_json())


def run_job(path, servers, workers, *args, timeout=60):
    procs = [start_server(path, i) for i in range(servers)]
    procs += [start_worker(path, r, path.parent / f"w{r}.npz", *args) for r in range(workers)]
    results = finish(procs[servers:] + procs[:servers], timeout)
    for rc, err in results:
        assert rc == 0, err
    return [np.load(path.parent / f"w{r}.npz") for r in range(workers)]


def torch_reference(steps):
    """One process, the union batch, torch's own Adagrad (embedding) and Adam (dense)."""
    emb = torch.nn.Parameter(torch.from_numpy(initial_rows(VOCAB, DIM, INIT)))
    w = torch.nn.Parameter(torch.from_numpy(initial_dense()))
    opts = [torch.optim.Adagrad([emb], lr=0.1), torch.optim.Adam([w], lr=0.05)]
    index = {int(v): i for i, v in enumerate(VOCAB)}
    for step in range(steps):
        ids, x, y = batch(step)
        idx = torch.tensor([[index[int(v)] for v in row] for row in ids])
        feats = torch.cat([emb[idx].reshape(len(y), SLOTS * DIM), torch.from_numpy(x)], 1)
        z = feats @ w[:-1] + w[-1]
        loss = torch.nn.functional.binary_cross_entropy_with_logits(z, torch.from_numpy(y))
        for o in opts:
            o.zero_grad()
        loss.backward()
        for o in opts:
            o.step()
    return emb.detach().numpy(), w.detach().numpy()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_sync_equals_one_process_on_the_union_batch(tmp_path, transport):
    path = cluster(tmp_path, "sync", 2, 2, RuleConfig.from_param_group("Adagrad", {"lr": 0.1}),
                   RuleConfig.from_param_group("Adam", {"lr": 0.05}), transport)
    out = run_job(path, 2, 2, "--steps", "5")
    emb, w = torch_reference(5)
    for o in out:
        np.testing.assert_allclose(o["dense"], w, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(o["rows"], emb, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(o["local"], o["dense"])  # the step returned fresh weights
    assert not np.allclose(w, initial_dense(), atol=1e-3)  # it did train


def test_async_merged_pushes_add_up_exactly(tmp_path):
    lr = 0.5
    path = cluster(tmp_path, "async", 2, 2, RuleConfig("sgd", lr=lr), RuleConfig("sgd", lr=lr))
    steps = 6
    out = run_job(path, 2, 2, "--steps", str(steps), "--constant-grads", "--max-merge", "4")
    dense = initial_dense() - lr * sum(0.01 * (r + 1) * (s + 1) for r in range(2)
                                       for s in range(steps))
    np.testing.assert_allclose(out[0]["dense"], dense, rtol=1e-5)
    counts = np.zeros(len(VOCAB))  # how often each vocabulary id was pushed, with weight r+1
    for r in range(2):
        for s in range(steps):
            ids = batch(s)[0][r::2].reshape(-1)
            np.add.at(counts, np.searchsorted(np.sort(VOCAB), ids), r + 1)
    order = np.argsort(VOCAB)
    expected = initial_rows(VOCAB, DIM, INIT)
    expected[order] -= lr * counts[:, None]
    np.testing.assert_allclose(out[0]["rows"], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_stopped_worker_blocks_nobody(tmp_path, mode):
    path = cluster(tmp_path, mode, 1, 2, RuleConfig("sgd", lr=0.1), RuleConfig("sgd", lr=0.1))
    procs = [start_server(path, 0),
             start_worker(path, 0, tmp_path / "w0.npz", "--steps", "6", "--sleep-before", "1"),
             start_worker(path, 1, tmp_path / "w1.npz", "--steps", "6", "--stop-after", "2")]
    for rc, err in finish(procs[1:] + procs[:1], 60):
        assert rc == 0, err
    assert np.load(tmp_path / "w0.npz")["rows"].shape == (len(VOCAB), DIM)
