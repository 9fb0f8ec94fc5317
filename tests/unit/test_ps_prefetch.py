"""Prefetch: the queue that matches pulls requested ahead to the lookups that use them, the loader
one batch ahead, and what ``ids_of`` may return. Pure logic, with a fake communicator."""
import logging

import numpy as np
import pytest
import torch
from torch import nn

from fleetx.nn import SparseEmbedding
from fleetx.ps import PSConfigError
from fleetx.ps_torch.layout import ModelLayout
from fleetx.ps_torch.prefetch import PrefetchLoader, PrefetchQueue, table_ids


class FakeHandle:
    def __init__(self, ids):
        self.ids, self.waited = ids, 0

    def wait(self, timeout=None):
        self.waited += 1
        return type("R", (), {"sparse": {n: ("rows of", tuple(i)) for n, i in self.ids.items()}})


class FakePull:
    """Records every pull sent (``ids``, ``create``)."""

    def __init__(self):
        self.sent = []

    def __call__(self, ids, create=True):
        self.sent.append((ids, create))
        return FakeHandle(ids)


def test_a_lookup_takes_the_pull_requested_with_exactly_its_ids():
    pull = FakePull()
    q = PrefetchQueue(pull, exact_after_step=False)
    q.add({"emb": np.array([[3, 1], [3, 2]])})
    assert len(pull.sent) == 1 and pull.sent[0][0]["emb"].tolist() == [3, 1, 3, 2]
    got = q.take({"emb": np.array([3, 1, 3, 2]), "other": np.array([5])}, create=True)
    assert got == {"emb": ("rows of", (3, 1, 3, 2))}  # "other" was not prefetched: pull it
    assert (q.hits, q.misses) == (1, 0)
    assert q.take({"emb": np.array([3, 1, 3, 2])}, create=True) == {}  # consumed


def test_other_ids_or_an_evaluation_lookup_do_not_take_it(caplog):
    q = PrefetchQueue(FakePull(), exact_after_step=False)
    q.add({"emb": np.array([1, 2])})
    assert q.take({"emb": np.array([2, 1])}, create=True) == {}  # same ids, another order
    assert q.take({"emb": np.array([1, 2])}, create=False) == {}  # evaluation: no rows created
    assert q.take({"emb": np.array([1, 2])}, create=True) != {}  # still there for training
    for _ in range(3):
        q.add({"emb": np.array([7])})
        with caplog.at_level(logging.WARNING, logger="fleetx.ps"):
            q.take({"emb": np.array([8])}, create=True)
    assert "did not match the ids the forward looked up in ['emb']" in caplog.text


def test_a_newer_match_drops_the_older_entries():
    q = PrefetchQueue(FakePull(), exact_after_step=False)
    for ids in ([1], [2], [3]):
        q.add({"emb": np.array(ids)})
    assert q.take({"emb": np.array([2])}, create=True)
    assert q.take({"emb": np.array([1])}, create=True) == {}  # dropped: it was older
    assert q.take({"emb": np.array([3])}, create=True)


def test_async_keeps_rows_read_before_a_step():
    pull = FakePull()
    q = PrefetchQueue(pull, exact_after_step=False)
    q.add({"emb": np.array([1])}, after_step=True)  # sent at once
    assert len(pull.sent) == 1
    q.stepped()
    assert q.take({"emb": np.array([1])}, create=True)


def test_sync_sends_a_request_for_after_the_step_only_once_the_step_returned():
    pull = FakePull()
    q = PrefetchQueue(pull, exact_after_step=True)
    q.add({"emb": np.array([1])})                    # for this forward: sent now
    q.add({"emb": np.array([2])}, after_step=True)   # for the next one: held
    assert [s[0]["emb"].tolist() for s in pull.sent] == [[1]]
    assert q.take({"emb": np.array([1])}, create=True)
    q.stepped()
    assert [s[0]["emb"].tolist() for s in pull.sent] == [[1], [2]]
    assert q.take({"emb": np.array([2])}, create=True)


def test_sync_never_uses_rows_read_before_the_last_step():
    pull = FakePull()
    q = PrefetchQueue(pull, exact_after_step=True)
    q.add({"emb": np.array([1])})
    q.stepped()                                      # read before this step's update
    assert q.take({"emb": np.array([1])}, create=True) == {}
    q.add({"emb": np.array([4])}, after_step=True)   # held, and no step came (accumulation)
    assert q.take({"emb": np.array([4])}, create=True) == {}  # pulled as usual, not held
    assert len(pull.sent) == 1


def test_the_loader_requests_each_batch_while_yielding_the_one_before():
    requested = []
    loader = PrefetchLoader(iter([10, 11, 12]), lambda b: {"emb": [b]},
                            lambda ids, ahead: requested.append((ids["emb"][0], ahead)))
    seen = []
    for b in loader:
        seen.append((b, list(requested)))
    assert seen == [(10, [(10, False), (11, True)]),
                    (11, [(10, False), (11, True), (12, True)]),
                    (12, [(10, False), (11, True), (12, True)])]
    assert list(PrefetchLoader([], lambda b: {}, lambda *a: None)) == []
    assert len(PrefetchLoader([1, 2], lambda b: {}, lambda *a: None)) == 2
    with pytest.raises(TypeError, match="ids_of must be a function of a batch"):
        PrefetchLoader([1], {"emb": 1}, lambda *a: None)


def test_ids_of_may_name_a_table_by_module_or_name_with_several_lookups_concatenated():
    emb, other = SparseEmbedding(2, name="user"), SparseEmbedding(2, name="item")
    layout = ModelLayout.of(nn.ModuleDict({"u": emb, "i": other}),
                            torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1))
    got = table_ids(layout, {emb: torch.tensor([[1, 2]]), "item": [np.array([5]), [6, 7]]})
    assert {n: v.tolist() for n, v in got.items()} == {"user": [1, 2], "item": [5, 6, 7]}
    assert got["user"].dtype == np.int64
    with pytest.raises(PSConfigError, match=r"'tags' is not a sparse table of the model; its "
                                            r"tables are \['item', 'user'\]"):
        table_ids(layout, {"tags": [1]})
    with pytest.raises(PSConfigError, match="is not a sparse table"):
        table_ids(layout, {nn.Linear(1, 1): [1]})
    with pytest.raises(PSConfigError, match="must return a dict"):
        table_ids(layout, [1, 2])


# -- through the backend, the layout and the fleet ------------------------------------------------
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import Done  # noqa: E402  (tests/helpers.py)
from ps_fleet_model import batch, loss_of, make_model, reference  # noqa: E402
from test_ps_strategy import CountingComm, ps_fleet  # noqa: E402

from fleetx.fleet import Fleet  # noqa: E402
from fleetx.ps.api import StateError  # noqa: E402
from fleetx.ps_torch.layout import RemoteSparseBackend  # noqa: E402


def test_a_forward_uses_the_prefetched_rows_and_pulls_only_what_was_not_prefetched():
    model = make_model()
    layout = ModelLayout.of(model, torch.optim.SGD(model.parameters(), lr=0.1))
    comm = CountingComm(layout.tables)
    backend = RemoteSparseBackend(comm)
    layout.bind(backend)
    ids, tags, x, y = batch(0)
    backend.prefetch(table_ids(layout, {model.emb: ids, "tags": tags}))
    assert len(comm.pulls) == 1
    expected = loss_of(model, ids, tags, x, y)   # served by the prefetch: no second pull
    assert len(comm.pulls) == 1 and backend.prefetched.hits == 1
    backend.clear()
    backend.prefetch(table_ids(layout, {"emb": ids}))          # tags not prefetched
    assert torch.equal(loss_of(model, ids, tags, x, y), expected)
    assert [sorted(p) for p in comm.pulls] == [["emb", "tags"], ["emb"], ["tags"]]


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
def test_without_servers_prefetch_yields_the_batches_and_training_is_unchanged():
    f, model, opt = ps_fleet(servers=None)
    batches = [batch(step) for step in range(5)]
    seen = 0
    for b in f.prefetch(batches, lambda b: {"emb": b[0], "tags": b[1]}):
        opt.minimize(loss_of(model, *b))
        seen += 1
    assert seen == 5
    f.stop_worker()
    expected = reference(5)
    for key, value in model.module.mlp.state_dict().items():
        np.testing.assert_allclose(value.numpy(), expected[f"mlp.{key}"], rtol=1e-5, atol=1e-6)


def test_prefetch_before_init_worker_says_so_and_a_collective_job_gets_its_batches_back():
    f, model, opt = ps_fleet()
    with pytest.raises(StateError, match=r"fleet.prefetch: call fleet.init_worker\(\) first"):
        next(iter(f.prefetch([batch(0)], lambda b: {"emb": b[0]})))
    g = Fleet()
    g.init(is_collective=True)
    g.distributed_optimizer(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))
    data = [1, 2, 3]
    with pytest.warns(UserWarning, match=r"prefetch\(\) function doesn't work"):
        assert g.prefetch(data, lambda b: {}) is data


def test_flat_dense_values_are_the_model_and_new_storage_is_noticed():
    model = make_model()
    layout = ModelLayout.of(model, torch.optim.SGD(model.parameters(), lr=0.1))
    before = {k: v.clone() for k, v in model.mlp.state_dict().items()}
    layout.flatten_dense()
    for k, v in model.mlp.state_dict().items():
        assert torch.equal(v, before[k])             # same values, now views of one array
    (name, flat), = layout.dense_values().items()
    flat[:] = 0.5                                     # writing the array writes the model
    assert all(bool((p == 0.5).all()) for p in model.mlp.parameters())
    assert layout.dense_values()[name] is not flat and np.shares_memory(
        layout.dense_values()[name], flat)
    layout.load_dense({name: flat})                   # its own memory: nothing to copy
    first = model.mlp[0].weight
    first.data = torch.full_like(first, 2.0)          # new storage for one parameter
    again = layout.dense_values()[name]
    assert not np.shares_memory(again, flat) and again[:first.numel()].tolist() == \
        [2.0] * first.numel()
    layout.load_dense({name: np.arange(len(again), dtype=np.float32)})
    assert first.view(-1)[:3].tolist() == [0.0, 1.0, 2.0]
    assert np.shares_memory(layout.dense_values()[name], first.detach().numpy())
    given = np.full(len(again), 3.0, np.float32)      # an array given up (async's reply)
    layout.load_dense({name: given}, adopt=True)      # becomes the model's storage: no copy
    assert np.shares_memory(first.detach().numpy(), given) and float(first[0, 0]) == 3.0
    strided = np.full(2 * len(again), 4.0, np.float32)[::2]
    layout.load_dense({name: strided}, adopt=True)    # not contiguous: copied into the model
    assert not np.shares_memory(first.detach().numpy(), strided) and float(first[0, 0]) == 4.0


# -- requests made as their lookups will be: evaluation, admission tables ------------------------
from fleetx.ps import kernels  # noqa: E402
from fleetx.ps.api import CountFilterEntry, RuleConfig, SparseTableSpec  # noqa: E402
from fleetx.ps.client import PullResult, SparseRows  # noqa: E402
from fleetx.ps.rules import make_rule  # noqa: E402
from fleetx.ps.table import SparseTable  # noqa: E402
from fleetx.ps_torch.prefetch import prefetch_groups  # noqa: E402


class TableComm:
    """A communicator over one in-process server table (what RemoteSparseBackend calls)."""

    def __init__(self, table):
        self.table = table

    def pull_sparse(self, ids, create=True):
        out = {}
        for name, flat in ids.items():
            uniq, inv = kernels.unique_inverse(flat)
            out[name] = SparseRows(uniq, self.table.pull(uniq, create), inv, np.shape(flat))
        return Done(PullResult(out, {}))


def admission_table(n=2):
    spec = SparseTableSpec("t", 4, RuleConfig("sgd"), entry=CountFilterEntry(n))
    return SparseTable(spec, make_rule(spec.rule))


def test_requests_are_made_as_the_lookups_will_be_and_admission_tables_pull_on_demand():
    plain, gated = SparseEmbedding(4), SparseEmbedding(4, entry=CountFilterEntry(2))
    modules = {"plain": plain, "gated": gated}
    ids = {"plain": np.array([1, 2]), "gated": np.array([3])}
    assert prefetch_groups(modules, ids) == {True: {"plain": ids["plain"]}}
    with torch.no_grad():
        assert list(prefetch_groups(modules, ids)) == [False]
        assert sorted(prefetch_groups(modules, ids)[False]) == ["gated", "plain"]
    plain.eval(), gated.eval()
    assert sorted(prefetch_groups(modules, ids)[False]) == ["gated", "plain"]


def test_an_evaluation_loop_with_prefetch_counts_no_sighting_and_creates_no_row():
    table = admission_table()
    backend = RemoteSparseBackend(TableComm(table), create=True)   # a training worker's backend
    emb = SparseEmbedding(4, entry=CountFilterEntry(2)).eval()
    for b in (np.array([7, 8]), np.array([7, 9])):
        for create, group in prefetch_groups({"t": emb}, {"t": b}).items():
            backend.prefetch(group, create=create)
        backend.lookup("t", b, create=False)                        # the evaluation forward
    assert backend.prefetched.hits == 2
    assert table.admission.counters["sighted"] == 0 and len(table) == 0


def test_a_training_batch_of_an_admission_table_counts_each_sighting_once():
    table = admission_table()
    backend = RemoteSparseBackend(TableComm(table), create=True)
    emb = SparseEmbedding(4, entry=CountFilterEntry(2))
    for create, group in prefetch_groups({"t": emb}, {"t": np.array([1, 2])}).items():
        backend.prefetch(group, create=create)
    backend.lookup("t", np.array([2, 1]), create=True)   # another order: a miss, pulled anew
    assert table.admission.counters["sighted"] == 2       # ids 1 and 2 once each, not twice
