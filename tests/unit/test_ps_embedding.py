"""SparseEmbedding and the model layout: torch models on the parameter server.

Two workers (threads, each with its own model copy and communicator) train a model whose
``nn.Embedding(sparse=True)`` was moved to a server, in sync mode; they end equal to one torch
process training the original model on the union batch."""
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from fleetx.nn import SparseEmbedding
from fleetx.ps import InitConfig, PSConfig, PSServer, RuleConfig
from fleetx.ps_torch import make_communicator
from fleetx.ps.initializers import initial_rows
from fleetx.ps_torch.layout import LocalSparseBackend, ModelLayout, RemoteSparseBackend


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(12, 4, sparse=True)
        self.head = nn.Sequential(nn.Linear(8, 5), nn.Tanh(), nn.Linear(5, 1))

    def forward(self, ids):
        return self.head(self.emb(ids).reshape(len(ids), -1)).squeeze(1)


def data(step):
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 12, (8, 2), generator=g), torch.rand(8, generator=g)


def loss_fn(model, ids, y):
    return nn.functional.binary_cross_entropy_with_logits(model(ids), y)


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import free_port  # noqa: E402  (tests/helpers.py)


def test_layout_converts_sparse_embeddings_and_groups_dense_parameters():
    model = Net()
    opt = torch.optim.Adagrad([{"params": model.emb.parameters(), "lr": 0.3},
                               {"params": model.head.parameters()}], lr=0.1)
    layout = ModelLayout.of(model, opt)
    assert isinstance(model.emb, SparseEmbedding) and model.emb.num_embeddings == 12
    (emb,) = layout.tables.sparse
    assert (emb.name, emb.dim, emb.rule.lr, emb.num_embeddings) == ("emb", 4, 0.3, 12)
    (dense,) = layout.tables.dense
    assert (dense.name, dense.numel, dense.rule.name) == ("dense.1", 8 * 5 + 5 + 5 + 1, "adagrad")
    ids, rows = layout.initial_sparse()["emb"]
    assert ids.tolist() == list(range(12)) and rows.shape == (12, 4)


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
def test_sync_workers_equal_one_process_on_the_union_batch():
    torch.manual_seed(0)
    reference = Net()
    copies = [Net() for _ in range(2)]
    for c in copies:
        c.load_state_dict(reference.state_dict())
    layouts = [ModelLayout.of(c, torch.optim.Adagrad(c.parameters(), lr=0.2)) for c in copies]
    config = PSConfig([f"127.0.0.1:{free_port()}"], 2, mode="sync", heartbeat_interval=0.2,
                      dead_after=5, timeout=20)
    server = PSServer(config, 0, layouts[0].tables).start()
    errors, rows = [], []

    def worker(rank):
        try:
            layout, model = layouts[rank], copies[rank]
            comm = make_communicator(config, rank, layout.tables)
            backend = RemoteSparseBackend(comm)
            layout.bind(backend)
            layout.load_dense(comm.start(layout.dense_values(), layout.initial_sparse()))
            for step in range(4):
                ids, y = data(step)
                ids, y = ids[rank::2], y[rank::2]
                backend.prefetch({"emb": ids})
                model.zero_grad()
                loss_fn(model, ids, y).backward()
                params = layout.dense_values()
                comm.step(params, layout.dense_grads(), layout.sparse_grads())
                layout.load_dense(params)
                backend.clear()
            if rank == 0:
                rows.append(comm.pull_sparse({"emb": np.arange(12)}).wait().sparse["emb"])
            comm.stop()
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    server.stop()
    assert not errors, errors

    opt = torch.optim.Adagrad(reference.parameters(), lr=0.2)
    for step in range(4):
        ids, y = data(step)
        opt.zero_grad()
        loss_fn(reference, ids, y).backward()
        opt.step()
    for model in copies:
        for p, q in zip(model.head.parameters(), reference.head.parameters()):
            np.testing.assert_allclose(p.detach().numpy(), q.detach().numpy(), atol=1e-5)
    np.testing.assert_allclose(rows[0].expand(), reference.emb.weight.detach().numpy(),
                               atol=1e-5)


def test_unbounded_table_in_one_process_equals_nn_embedding():
    init = InitConfig("uniform", low=-0.1, high=0.1, seed=3)
    emb = SparseEmbedding(3, name="e", init=init, rule=RuleConfig("sgd", lr=0.5))
    layout = ModelLayout.of(nn.ModuleDict({"e": emb}), torch.optim.SGD([nn.Parameter(
        torch.zeros(1))], lr=0.5))
    backend = LocalSparseBackend(layout.tables)
    layout.bind(backend)
    vocab = np.array([10 ** 12, -4, 77])
    ref = nn.Embedding(3, 3, sparse=True)
    ref.weight.data = torch.from_numpy(initial_rows(vocab, 3, init))
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in range(3):
        idx = torch.tensor([[step % 3, 1], [1, 2]])
        emb(torch.from_numpy(vocab[idx.numpy()])).pow(2).sum().backward()
        backend.step(layout.sparse_grads())
        opt.zero_grad()
        ref(idx).pow(2).sum().backward()
        opt.step()
    got = backend.lookup("e", vocab).expand()
    np.testing.assert_allclose(got, ref.weight.detach().numpy(), rtol=1e-6, atol=1e-7)


def test_padding_rows_get_no_gradient_and_eval_creates_nothing():
    emb = SparseEmbedding(2, name="p", padding_idx=0, num_embeddings=5,
                          rule=RuleConfig("sgd"))
    layout = ModelLayout.of(nn.ModuleDict({"p": emb}), torch.optim.SGD(
        [nn.Parameter(torch.zeros(1))], lr=1.0))
    layout.bind(LocalSparseBackend(layout.tables))
    emb(torch.tensor([0, 3, 0])).sum().backward()
    (ids, grads), = emb.pop_gradients()
    assert dict(zip(ids.tolist(), grads.sum(1).tolist())) == {0: 0.0, 3: 2.0}
    emb.eval()
    emb(torch.tensor([4]))
    assert emb.pop_gradients() == []
    with pytest.raises(RuntimeError, match="not bound"):
        SparseEmbedding(2)(torch.tensor([1]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_lookups_gradient_sums_every_occurrence_as_index_select_does(dtype):
    """The lookup's own backward (a segment sum, not index_select's sort) gives each unique id
    the sum of its occurrences' gradients: the same values as index_select's backward (float32
    through the C kernel, other dtypes through index_add)."""
    from fleetx.nn.sparse_embedding import _Occurrences
    rng = np.random.default_rng(0)
    inverse = rng.integers(0, 50, 3000)
    rows = torch.from_numpy(rng.standard_normal((50, 16))).to(dtype)
    upstream = torch.from_numpy(rng.standard_normal((3000, 16))).to(dtype)
    leaf, ref = rows.clone().requires_grad_(True), rows.clone().requires_grad_(True)
    out = _Occurrences.apply(leaf, inverse)
    assert torch.equal(out, ref.index_select(0, torch.from_numpy(inverse)))
    (out * upstream).sum().backward()
    (ref.index_select(0, torch.from_numpy(inverse)) * upstream).sum().backward()
    assert leaf.grad.dtype == dtype
    torch.testing.assert_close(leaf.grad, ref.grad, rtol=1e-6, atol=1e-6)
