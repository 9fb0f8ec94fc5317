"""Request checks (fleetx.ps.requests) with their exact messages, and the sync-round / barrier
bookkeeping that finds a stalled worker (fleetx.ps.rounds); pure functions, no sockets."""
import re

import numpy as np
import pytest

from fleetx.ps import DenseTableSpec, PSConfig, RuleConfig, SparseTableSpec, Tables
from fleetx.ps.api import RequestError
from fleetx.ps import requests as rq
from fleetx.ps.rounds import Stall, Waiting, Waits, stalled
from fleetx.ps.shard import Shard

TABLES = Tables((SparseTableSpec("emb", 3, RuleConfig("sgd")),
                 SparseTableSpec("small", 2, RuleConfig("sgd"), num_embeddings=10)),
                (DenseTableSpec("dense", 10, RuleConfig("sgd")),))
SHARD = Shard(PSConfig(["h:1", "h:2"], 1), 0, TABLES)  # holds dense[0:5]
I64, F32 = np.int64, np.float32


def push(meta, bufs, kind="PUSH"):
    return rq.parse_push(kind, meta, bufs, SHARD.sparse, SHARD.dense)


def test_a_valid_push_is_split_into_tables():
    p = push({"sparse": ["emb"], "dense": ["dense"]},
             [np.array([1, 2], I64), np.ones(6, F32), np.ones(5, F32)])
    assert [(n, ids.tolist(), v.shape) for n, ids, v in p.sparse] == [("emb", [1, 2], (2, 3))]
    assert [(n, v.shape) for n, v in p.dense] == [("dense", (5,))] and p.nonfinite == []


@pytest.mark.parametrize("meta, bufs, message", [
    ({"sparse": ["emb"]}, [np.arange(5, dtype=I64), np.ones(4, F32)],
     r"PUSH: table 'emb': got 4 values, expected 15 \(5 ids x dim 3\)"),
    ({"sparse": ["emb"]}, [np.arange(2, dtype=np.float64), np.ones(6, F32)],
     r"PUSH: table 'emb': ids must be int64, got float64"),
    ({"sparse": ["emb"]}, [np.arange(2, dtype=I64), np.ones(6, np.float64)],
     r"PUSH: table 'emb': values must be float32, got float64"),
    ({"sparse": ["nope"]}, [np.arange(2, dtype=I64), np.ones(6, F32)],
     r"PUSH: unknown sparse table 'nope'; known sparse tables: emb, small"),
    ({"sparse": ["dense"]}, [np.arange(2, dtype=I64), np.ones(6, F32)],
     r"PUSH: unknown sparse table 'dense'"),
    ({"dense": ["emb"]}, [np.ones(5, F32)], r"PUSH: unknown dense table 'emb'; known dense "
                                            r"tables: dense"),
    ({"sparse": ["emb", "emb"]}, [], r"PUSH: 'sparse' names a table twice"),
    ({"sparse": "emb"}, [], r"PUSH: 'sparse' must be a list of table names, got 'emb'"),
    ({"sparse": [7]}, [], r"PUSH: 'sparse' must be a list of table names"),
    ({"sparse": ["emb"]}, [np.arange(2, dtype=I64)],
     r"PUSH: 1 sparse and 0 dense tables need 2 buffers, got 1"),
    ({"dense": ["dense"]}, [np.ones(4, F32)],
     r"PUSH: table 'dense': got 4 values, expected 5 \(this server's slice"),
    ({"sparse": ["small"]}, [np.array([3, 10], I64), np.ones(4, F32)],
     r"PUSH: table 'small': ids must be in \[0, 10\); got \[3, 10\]"),
])
def test_malformed_pushes_are_refused_naming_the_table(meta, bufs, message):
    with pytest.raises(RequestError, match=message):
        push(meta, bufs)


def test_non_finite_values_are_found_per_table():
    g = np.ones(6, F32)
    g[4] = np.nan
    p = push({"sparse": ["emb"], "dense": ["dense"]},
             [np.array([1, 2], I64), g, np.array([1, np.inf, 1, 1, -np.inf], F32)])
    assert p.nonfinite == ["emb", "dense"]
    assert str(rq.nonfinite_error("PUSH", p, "gradients")) == (
        "PUSH: non-finite (NaN or inf) gradients refused in table 'emb' (1), 'dense' (2)")


@pytest.mark.parametrize("lr", [0, -0.1, float("nan"), float("inf"), 1e30, 10.5, True, "0.1",
                                None])
def test_learning_rates_must_be_finite_positive_and_at_most_the_maximum(lr):
    expected = (f"SET_LR: learning rate {lr!r} refused: expected a finite number in (0, 10] "
                "(the maximum is FLEETX_PS_MAX_LR)")
    with pytest.raises(RequestError, match=re.escape(expected)):
        rq.parse_set_lr({"lr": lr}, {**SHARD.sparse, **SHARD.dense}, 10.0)


def test_set_lr_names_known_tables_or_means_all():
    every = {**SHARD.sparse, **SHARD.dense}
    assert rq.parse_set_lr({"lr": 10}, every, 10.0) == (10.0, ["emb", "small", "dense"])
    assert rq.parse_set_lr({"lr": 0.5, "tables": ["dense"]}, every, 10.0) == (0.5, ["dense"])
    with pytest.raises(RequestError, match="SET_LR: unknown table 'x'; known tables: dense, "
                                           "emb, small"):
        rq.parse_set_lr({"lr": 0.5, "tables": ["x"]}, every, 10.0)


def test_other_fields():
    with pytest.raises(RequestError, match="PULL: the meta block must be a JSON object, got "
                                           "list"):
        rq.check_meta("PULL", [1, 2])
    with pytest.raises(RequestError, match="PULL: 'create' must be true or false, got 'yes'"):
        rq.parse_pull({"sparse": [], "create": "yes"}, [], SHARD.sparse, SHARD.dense)
    with pytest.raises(RequestError, match="PULL: 1 sparse tables but 0 id buffers"):
        rq.parse_pull({"sparse": ["emb"]}, [], SHARD.sparse, SHARD.dense)
    with pytest.raises(RequestError, match="BARRIER: 'name' must be a string of at most 200"):
        rq.parse_barrier({"name": 5})
    with pytest.raises(RequestError, match="SAVE: 'dirname' must be a path of 1-4096 "):
        rq.parse_save({"dirname": ["/tmp"], "save_id": "a"})
    with pytest.raises(RequestError, match="SAVE: 'save_id' must be a string, got None"):
        rq.parse_save({"dirname": "ckpt"})
    with pytest.raises(RequestError, match="INIT: 'force' must be true or false, got 1"):
        rq.optional_bool("INIT", {"force": 1}, "force")


def w(since):
    return Waiting(None, None, None, since)


def test_rounds_complete_in_order_and_barriers_by_name():
    waits = Waits()
    waits.push(0, w(1.0))
    waits.push(0, w(2.0))
    assert waits.next_round([0, 1]) is None
    waits.push(1, w(3.0))
    assert [e.since for e in waits.next_round([0, 1])] == [1.0, 3.0]
    assert waits.next_round([0, 1]) is None  # worker 0's second push waits for worker 1
    waits.enter("end", 1, w(4.0))
    assert waits.complete_barriers([0, 1]) == [] and len(waits.complete_barriers([1])) == 1
    assert [e.since for e in waits.drain()] == [2.0] and waits.oldest() == []


def test_a_worker_silent_longer_than_the_timeout_stalls_a_wait():
    waits = Waits()
    waits.push(0, w(100.0))  # worker 0 waits in a round from t=100
    last = {0: 100.0, 1: 90.0, 2: 110.0}  # last requests
    assert stalled(waits, last, [0, 1, 2], now=119.0, timeout=20) == []  # not 20 s yet
    assert stalled(waits, last, [0, 1, 2], now=121.0, timeout=20) == [
        Stall(1, 31.0, "a sync round", (0,))]  # worker 2 spoke 11 s ago: busy, not stuck
    assert stalled(waits, {**last, 1: 105.0}, [0, 1, 2], now=121.0, timeout=20) == []
    assert stalled(waits, last, [0, 2], now=121.0, timeout=20) == []  # 1 stopped: not awaited
    waits = Waits()
    waits.enter("end", 2, w(110.0))
    assert [(s.rank, s.what, s.arrived) for s in stalled(waits, last, [0, 1, 2], now=131.0,
                                                          timeout=20)] == [
        (0, "barrier 'end'", (2,)), (1, "barrier 'end'", (2,))]
