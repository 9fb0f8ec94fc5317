"""Id index, sparse/dense tables, per-id initialisation, and the partition function."""
import sys
from pathlib import Path

import numpy as np
import pytest

from fleetx.ps import checkpoint, client, kernels, partition
from fleetx.ps.api import PSConfigError, InitConfig, RuleConfig, SparseTableSpec
from fleetx.ps.initializers import initial_rows
from fleetx.ps.partition import dense_ranges, route, server_of, shard_of
from fleetx.ps.rules import make_rule
from fleetx.ps.index import IdIndex
from fleetx.ps.table import SparseTable

sys.path.insert(0, str(Path(__file__).parent))
from ps_backends import backend  # noqa: E402,F401 (a fixture)


def sgd_table(dim=4, init=InitConfig("uniform", seed=7), num_embeddings=None, capacity=16):
    spec = SparseTableSpec("emb", dim, RuleConfig("sgd", lr=0.5), init, num_embeddings)
    return SparseTable(spec, make_rule(spec.rule), capacity)


def test_index_maps_any_int64_and_grows(backend):
    rng = np.random.default_rng(0)
    keys = np.unique(np.concatenate([rng.integers(-2 ** 63, 2 ** 63 - 1, 5000, np.int64),
                                     [-(2 ** 63), 2 ** 63 - 1, -1, 0, 1]]))
    rng.shuffle(keys)
    ix = IdIndex(capacity=4)
    rows, first = ix.insert(keys[:100])
    assert first == 0 and rows.tolist() == list(range(100))
    rows, first = ix.insert(np.concatenate([keys, keys[:10]]))  # repeats within a batch
    assert first == 100 and len(ix) == len(keys)
    assert rows[:len(keys)].tolist() == list(range(len(keys)))
    assert rows[len(keys):].tolist() == list(range(10))
    np.testing.assert_array_equal(ix.find(keys), np.arange(len(keys)))
    np.testing.assert_array_equal(ix.keys, keys)
    assert (ix.find(np.array([12345, -12345])) == -1).all() or 12345 in keys


def test_rows_are_created_on_first_touch_from_seed_and_id(backend):
    t = sgd_table()
    ids = np.array([3, 2 ** 40, -7], np.int64)
    np.testing.assert_array_equal(t.pull(ids), initial_rows(ids, 4, t.spec.init))
    assert len(t) == 3
    t.push(ids[:1], np.ones((1, 4), np.float32))
    np.testing.assert_allclose(t.pull(ids[:1]), initial_rows(ids[:1], 4, t.spec.init) - 0.5)


def test_read_only_pull_does_not_create_rows(backend):
    t = sgd_table()
    t.pull(np.array([1]))
    out = t.pull(np.array([1, 99]), create=False)
    assert len(t) == 1
    np.testing.assert_array_equal(out[1], initial_rows(np.array([99]), 4, t.spec.init)[0])


def test_bounded_table_refuses_ids_out_of_range():
    t = sgd_table(num_embeddings=10)
    with pytest.raises(PSConfigError,
                       match=r"table 'emb': ids must be in \[0, 10\); got \[-1, 3\]"):
        t.pull(np.array([3, -1]))


def test_initial_rows_are_deterministic_and_well_shaped():
    ids = np.arange(20000, dtype=np.int64)
    u = initial_rows(ids, 8, InitConfig("uniform", low=-0.5, high=0.5, seed=3))
    assert u.dtype == np.float32 and u.min() >= -0.5 and u.max() < 0.5
    assert abs(u.mean()) < 0.01 and abs(u.std() - 1 / np.sqrt(12)) < 0.01
    z = initial_rows(ids, 7, InitConfig("normal", mean=1.0, std=2.0, seed=3))
    assert abs(z.mean() - 1.0) < 0.03 and abs(z.std() - 2.0) < 0.03
    again = initial_rows(ids[::-1].copy(), 7, InitConfig("normal", mean=1.0, std=2.0, seed=3))
    np.testing.assert_array_equal(again[::-1], z)
    other = initial_rows(ids, 7, InitConfig("normal", mean=1.0, std=2.0, seed=4))
    assert not np.allclose(other, z)
    assert (initial_rows(ids[:3], 2, InitConfig("constant", value=0.25)) == 0.25).all()


@pytest.mark.parametrize("num_servers", [1, 2, 3, 4])
def test_rows_do_not_depend_on_the_number_of_servers(num_servers):
    """Every server creates the rows it owns; together they equal a single table's rows."""
    rng = np.random.default_rng(1)
    ids = np.unique(rng.integers(-10 ** 12, 10 ** 12, 500))
    reference = sgd_table().pull(ids)
    owner = server_of(ids, num_servers, 1000)
    got = np.empty_like(reference)
    for s in range(num_servers):
        mine = owner == s
        got[mine] = sgd_table().pull(ids[mine])
    np.testing.assert_array_equal(got, reference)


def test_partition_is_pinned_and_balanced():
    """The partition is part of the checkpoint format: its values must never change."""
    def splitmix64(x):  # the reference finaliser, in plain Python integers
        m = (1 << 64) - 1
        z = (x + 0x9E3779B97F4A7C15) & m
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
        return z ^ (z >> 31)

    ids = [0, 1, 2, 12345, -1, 2 ** 62, -(2 ** 63)]
    expected = [splitmix64(i % (1 << 64)) % 1000 for i in ids]
    assert shard_of(np.array(ids, np.int64), 1000).tolist() == expected
    assert expected[:4] == [535, 465, 110, 944]
    many = server_of(np.arange(100000), 3, 1000)
    counts = np.bincount(many, minlength=3)
    assert counts.min() > 0.3 * 100000 and set(many.tolist()) == {0, 1, 2}
    shards = shard_of(np.arange(100000), 1000)
    assert (shards * 3 // 1000 == many).all()  # contiguous shard blocks per server


def test_route_groups_unique_ids_by_server():
    ids = np.array([[5, 9, 5], [77, 9, -3]])
    r = route(ids, 3, 1000)
    np.testing.assert_array_equal(r.ids[r.inverse], ids.reshape(-1))
    assert len(r.ids) == 4
    for s in range(3):
        assert (server_of(r.part(s), 3, 1000) == s).all()


def test_client_and_server_share_one_partition_function():
    assert client.route is partition.route
    assert checkpoint.server_of is partition.server_of


def test_dense_ranges_split_evenly():
    assert dense_ranges(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert dense_ranges(2, 3) == [(0, 1), (1, 2), (2, 2)]


def test_segment_sum_and_unique(backend):
    ids = np.array([4, 1, 4, 4, 9])
    uniq, inv = kernels.unique_inverse(ids)
    g = np.arange(10, dtype=np.float32).reshape(5, 2)
    out = kernels.segment_sum(inv, g, len(uniq))
    assert uniq.tolist() == [1, 4, 9]
    assert out.tolist() == [[2, 3], [0 + 4 + 6, 1 + 5 + 7], [8, 9]]
