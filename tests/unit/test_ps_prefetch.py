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
