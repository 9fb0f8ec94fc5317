"""Table growth control on scripted id streams: admission (count and probability entries),
eviction of unseen rows, show/click decay and score deletion, exact counts, in both kernel
backends. The show/click arithmetic is checked against an independent float64 implementation
of Paddle's ``CtrCommonAccessor::Shrink`` / ``ShowClickScore``
(paddle/fluid/distributed/ps/table/ctr_accessor.cc)."""
import sys
from pathlib import Path

import numpy as np
import pytest

from fleetx.ps.api import (AccessorConfig, CountFilterEntry, InitConfig, PSConfigError,
                           ProbabilityEntry, RuleConfig, ShowClickEntry, SparseTableSpec)
from fleetx.ps.growth import ADMITTED, RowStats
from fleetx.ps.initializers import initial_rows
from fleetx.ps.partition import server_of
from fleetx.ps.rules import make_rule
from fleetx.ps.table import SparseTable

sys.path.insert(0, str(Path(__file__).parent))
from ps_backends import backend  # noqa: E402,F401 (a fixture)

DIM = 4
INIT = InitConfig("uniform", seed=5)


def table(entry=None, accessor=None, lr=0.5):
    spec = SparseTableSpec("t", DIM, RuleConfig("sgd", lr=lr), INIT, entry=entry,
                           accessor=accessor)
    return SparseTable(spec, make_rule(spec.rule), capacity=4)


def step(t, ids, grad=1.0, show_click=None):
    """One training step of a worker: a pull (create), then a push of the same ids."""
    ids = np.asarray(ids, np.int64)
    got = t.pull(ids)
    g = np.full((len(ids), DIM), grad, np.float32)
    t.push(ids, g if show_click is None else np.hstack([g, show_click]).astype(np.float32))
    return got


def test_count_filter_admits_at_the_nth_sighting_and_creates_the_row_at_the_next_update(
        backend):
    t = table(CountFilterEntry(3))
    ids = np.array([11, 22])
    for k in range(2):  # two sightings: no row; zeros read; gradients dropped
        assert (step(t, ids) == 0).all()
        assert len(t) == 0
    assert t.counters["dropped_updates"] == 4 and len(t.admission) == 2
    got = step(t, [11])  # third sighting of 11: admitted; this pull still reads zeros ...
    assert (got == 0).all()
    assert len(t) == 1 and t.counters["created"] == 1  # ... and its update created the row
    np.testing.assert_allclose(t.pull(np.array([11]), create=False),
                               initial_rows(np.array([11]), DIM, INIT) - 0.5)
    assert t.admission.counters == {"sighted": 5, "admitted": 1, "not_counted": 0,
                                    "forgotten": 0}
    assert len(t.admission) == 1  # 22 still waits, with 2 sightings


def test_evaluation_never_counts_or_admits(backend):
    t = table(CountFilterEntry(1))
    for _ in range(5):
        assert (t.pull(np.array([7, 8]), create=False) == 0).all()
    assert len(t) == 0 and len(t.admission) == 0
    t.push(np.array([7]), np.ones((1, DIM), np.float32))  # never sighted: dropped
    assert len(t) == 0 and t.counters["dropped_updates"] == 1


def test_every_pull_request_counts_an_id_once(backend):
    t = table(CountFilterEntry(2))
    t.pull(np.array([5, 5, 5]))  # one request: one sighting, however often it holds the id
    t.push(np.array([5]), np.ones((1, DIM), np.float32))
    assert len(t) == 0
    t.pull(np.array([5]))
    t.push(np.array([5]), np.ones((1, DIM), np.float32))
    assert len(t) == 1


def _splitmix64(x: int) -> int:
    m = (1 << 64) - 1
    z = (x + 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def _draw(seed: int, i: int, k: int) -> float:
    """The k-th sighting's draw, written independently in plain Python integers."""
    m = (1 << 64) - 1
    base = _splitmix64((i % (1 << 64)) ^ _splitmix64(seed ^ 0xA0761D6478BD642F))
    return (_splitmix64((base + k * 0x9E3779B97F4A7C15) & m) >> 40) / float(1 << 24)


def test_probability_admission_is_a_pure_function_of_seed_id_and_sighting(backend):
    ids = np.arange(-200, 200, dtype=np.int64)
    p, seed = 0.3, 11
    t = table(ProbabilityEntry(p, seed=seed))
    admitted_at = {}
    for k in (1, 2, 3):
        step(t, ids)
        for i in ids.tolist():
            if i not in admitted_at and _draw(seed, i, k) < p:
                admitted_at[i] = k
    assert sorted(t.index.keys.tolist()) == sorted(admitted_at)
    assert 0.5 < len(admitted_at) / len(ids) < 0.8  # 1 - 0.7**3 = 0.657 expected
    # the same ids split over 3 servers (in another order) admit the same set
    owner = server_of(ids, 3, 1000)
    parts = [table(ProbabilityEntry(p, seed=seed)) for _ in range(3)]
    for _ in range(3):
        for s, part in enumerate(parts):
            step(part, ids[owner == s][::-1])
    assert sorted(k for part in parts for k in part.index.keys.tolist()) == sorted(admitted_at)


def test_rows_unseen_for_more_than_the_limit_are_evicted_at_shrink(backend):
    t = table(accessor=AccessorConfig(delete_after_unseen_days=1))
    step(t, [1, 2, 3])                                # pass 0: all seen
    assert t.shrink() == {"removed": 0, "forgotten": 0}
    step(t, [1])                                      # pass 1: 2 and 3 unseen once
    assert t.shrink()["removed"] == 0
    # passes since the last update, as the next shrink counts them (pass 2 is current)
    assert t.row_stats(np.array([1, 2, 3]))[:, -1].tolist() == [1, 2, 2]
    t.pull(np.array([2]))                             # pass 2: a pull is not an update
    assert t.shrink()["removed"] == 2                 # 2 and 3: unseen twice > 1
    assert sorted(t.index.keys.tolist()) == [1]
    np.testing.assert_allclose(t.pull(np.array([1]), create=False),
                               initial_rows(np.array([1]), DIM, INIT) - 1.0)
    assert t.counters == {"created": 3, "removed": 2, "dropped_updates": 0}
    assert t.passes == 3
    assert t.shrink(threshold=0)["removed"] == 1     # threshold replaces the limit: unseen 1 > 0


def test_removal_keeps_every_other_row_exact(backend):
    t = table(accessor=AccessorConfig(delete_after_unseen_days=0))
    rng = np.random.default_rng(0)
    ids = rng.permutation(np.arange(1000, 1300))
    t.pull(ids)
    grads = rng.standard_normal((len(ids), DIM)).astype(np.float32)
    t.push(ids, grads)
    before = {int(i): row for i, row in zip(ids, t.pull(ids, create=False))}
    t.shrink()
    keep = ids[::3]
    t.push(keep, np.zeros((len(keep), DIM), np.float32))  # seen in pass 1
    assert t.shrink()["removed"] == len(ids) - len(keep)
    got = t.pull(keep, create=False)
    np.testing.assert_array_equal(got, np.array([before[int(i)] for i in keep]))
    assert (t.index.find(np.setdiff1d(ids, keep)) == -1).all()
    again = t.pull(ids[1:3])  # evicted ids come back fresh, from their initial value
    np.testing.assert_array_equal(again, initial_rows(ids[1:3], DIM, INIT))


def _paddle_shrink(show, click, unseen, a: AccessorConfig, limit):
    """CtrCommonAccessor::Shrink in float64: decay, then delete on a low score or unseen days."""
    show, click = show * a.show_click_decay_rate, click * a.show_click_decay_rate
    score = (show - click) * a.nonclk_coeff + click * a.click_coeff
    return show, click, (score < a.delete_threshold) | (unseen > limit)


def test_show_click_decay_and_score_deletion_follow_paddles_accessor(backend):
    acc = AccessorConfig(nonclk_coeff=0.1, click_coeff=1.0, show_click_decay_rate=0.9,
                         delete_threshold=0.5, delete_after_unseen_days=2)
    t = table(ShowClickEntry("show", "click"), acc)
    assert t.spec.push_width == DIM + 2 and t.stats.width == 3
    rng = np.random.default_rng(1)
    ids = np.arange(40, dtype=np.int64)
    show, click, unseen = np.zeros(40), np.zeros(40), np.zeros(40)
    alive = np.zeros(40, bool)  # a row exists once an update reached its id
    for p in range(4):
        seen = ids[rng.random(40) < 0.6]
        sc = np.stack([rng.integers(1, 6, len(seen)), rng.integers(0, 2, len(seen))], 1)
        step(t, seen, show_click=sc.astype(np.float32))
        fresh = seen[~alive[seen]]
        show[fresh], click[fresh] = 0, 0
        alive[seen] = True
        show[seen] += sc[:, 0]
        click[seen] += sc[:, 1]
        unseen += 1
        unseen[seen] = 0
        show, click, drop = _paddle_shrink(show, click, unseen, acc, 2)
        drop &= alive
        assert t.shrink()["removed"] == int(drop.sum())
        alive &= ~drop
        got = t.row_stats(ids)
        assert (np.isnan(got[:, 0]) == ~alive).all()
        np.testing.assert_allclose(got[alive, 0], show[alive], rtol=1e-6)
        np.testing.assert_allclose(got[alive, 1], click[alive], rtol=1e-6)
        # after the shrink a new pass is current: the next shrink counts one pass more
        assert got[alive, 2].tolist() == (unseen[alive] + 1).tolist()
    assert 0 < alive.sum() < 40  # rows were deleted, and some are left


def test_pending_ids_are_bounded_and_forgotten_when_unseen_for_a_pass(backend):
    t = table(CountFilterEntry(3, max_pending=5))
    t.pull(np.arange(8))  # room for 5: 3 new ids are not counted
    assert len(t.admission) == 5 and t.admission.counters["not_counted"] == 3
    t.pull(np.arange(2))
    assert t.shrink()["forgotten"] == 0  # all 5 were sighted in pass 0
    t.pull(np.arange(1))
    assert t.shrink()["forgotten"] == 4  # only id 0 was sighted in pass 1
    assert t.admission.index.keys.tolist() == [0]
    t.push(np.array([0]), np.ones((1, DIM), np.float32))
    assert len(t) == 1  # three sightings over the passes: admitted


def test_memory_report_counts_only_what_a_table_enables():
    plain, evicting = table(), table(accessor=AccessorConfig())
    shows = table(ShowClickEntry())
    for t in (plain, evicting, shows):
        t.pull(np.arange(1000))
    assert plain.memory()["stats"] == 0 and plain.memory()["pending"] == 0
    assert evicting.memory()["stats"] == 1000 * 4 and shows.memory()["stats"] == 1000 * 12
    assert plain.memory()["values"] == 1000 * DIM * 4
    counting = table(CountFilterEntry(2))
    counting.pull(np.arange(1000))
    assert len(counting) == 0 and counting.memory()["pending"] > 1000 * 16


def test_growth_settings_are_checked():
    with pytest.raises(PSConfigError, match=r"CountFilterEntry.count_filter=0: expected an int"):
        CountFilterEntry(0)
    with pytest.raises(PSConfigError, match=r"ProbabilityEntry.probability=1.5: expected a "
                                            r"number in \(0, 1\]"):
        ProbabilityEntry(1.5)
    with pytest.raises(PSConfigError, match=r"show_click_decay_rate=2: expected a number in"):
        AccessorConfig(show_click_decay_rate=2)
    with pytest.raises(PSConfigError, match=r"entry='x': expected None, CountFilterEntry"):
        SparseTableSpec("t", 4, RuleConfig("sgd"), entry="x")
    assert SparseTableSpec("t", 4, RuleConfig("sgd"), entry=ShowClickEntry()).accessor == \
        AccessorConfig()
    assert ADMITTED > 2 ** 20  # above any count_filter


def test_geo_mode_refuses_entries_naming_the_table():
    from fleetx.ps.api import PSConfig, Tables
    from fleetx.ps.shard import Shard
    cfg = PSConfig(["127.0.0.1:1"], 1, mode="geo")
    spec = SparseTableSpec("clicks", DIM, RuleConfig("sgd"), entry=CountFilterEntry(2))
    with pytest.raises(PSConfigError, match=r"sparse table 'clicks': entry=CountFilterEntry"
                                            r"\(\.\.\.\) needs sync or async mode"):
        Shard(cfg, 0, Tables((spec,)))
    evicting = SparseTableSpec("e", DIM, RuleConfig("sgd"), accessor=AccessorConfig())
    assert Shard(cfg, 0, Tables((evicting,))).sparse["e"].stats is not None


def test_a_sync_round_sums_show_and_click_and_averages_gradients():
    from fleetx.ps.api import PSConfig, Tables
    from fleetx.ps.requests import Push
    from fleetx.ps.shard import Shard
    spec = SparseTableSpec("t", 2, RuleConfig("sgd", lr=1.0), InitConfig("constant"),
                           entry=ShowClickEntry())
    shard = Shard(PSConfig(["127.0.0.1:1"], 2, mode="sync"), 0, Tables((spec,)))
    ids = np.array([5], np.int64)
    shard.apply_mean([Push([("t", ids, np.array([[2.0, 4.0, 1.0, 1.0]], np.float32))], [], []),
                      Push([("t", ids, np.array([[4.0, 8.0, 1.0, 0.0]], np.float32))], [], [])])
    t = shard.sparse["t"]
    np.testing.assert_array_equal(t.pull(ids, create=False), [[-3.0, -6.0]])  # mean gradient
    assert t.row_stats(ids).tolist() == [[2.0, 1.0, 0.0]]  # summed show and click


def test_sparse_embedding_feeds_show_and_click_per_id():
    import torch
    from fleetx.nn import SparseEmbedding
    from fleetx.ps.api import Tables
    from fleetx.ps_torch.layout import LocalSparseBackend
    emb = SparseEmbedding(DIM, name="t", entry=ShowClickEntry("show", "click"))
    plain = SparseEmbedding(DIM, name="p")
    backend = LocalSparseBackend(Tables((SparseTableSpec("t", DIM, RuleConfig("sgd"),
                                                         entry=ShowClickEntry()),
                                         SparseTableSpec("p", DIM, RuleConfig("sgd")))))
    emb.bind(backend)
    plain.bind(backend)
    ids = torch.tensor([[3, 9], [3, 3]])
    out = emb(ids, show=torch.ones(2, 1), click=torch.tensor([[1.0], [0.0]]))
    out.sum().backward()
    (got_ids, grads), = emb.pop_gradients()
    assert got_ids.tolist() == [3, 9]
    assert grads[:, DIM:].tolist() == [[3.0, 1.0], [1.0, 1.0]]  # show, click summed per id
    assert grads[:, :DIM].tolist() == [[3.0] * DIM, [1.0] * DIM]
    with pytest.raises(ValueError, match=r"table 't' keeps show/click statistics \(entry="
                                         r"ShowClickEntry\): pass show= and click="):
        emb(ids)
    with pytest.raises(ValueError, match="table 'p' has no ShowClickEntry"):
        plain(ids, show=torch.ones(2, 1), click=torch.ones(2, 1))
    emb.eval()
    with torch.no_grad():
        emb(ids)  # evaluation lookups need no show or click


def test_an_export_is_not_a_checkpoint(tmp_path):
    from fleetx.checkpoint import CheckpointError, SaveWriter
    from fleetx.ps.chain import open_chain
    from fleetx.ps.checkpoint import save_server
    t = table()
    t.pull(np.arange(3))
    writer = SaveWriter(tmp_path / "x")
    save_server(writer, 0, 1, 1, {"t": t}, {}, "export")
    writer.commit({"mode": "export"})
    with pytest.raises(CheckpointError, match=r"an export for serving \(save_inference_model\), "
                                              r"not a checkpoint"):
        open_chain(str(tmp_path / "x"))


@pytest.mark.parametrize("passes", [1, 63, 64, 65, 200, 3000])
def test_replayed_decay_is_the_shrinks_bit_for_bit(passes):
    """A delta's load replays the decay of the shrinks since the save before (in chunks, up to
    the fixed point): the same float32 values as that many shrinks, past the fixed point too
    (3,000 passes of 0.97 take every show below the smallest denormal)."""
    spec = SparseTableSpec("t", DIM, RuleConfig("sgd"), entry=ShowClickEntry(),
                           accessor=AccessorConfig(show_click_decay_rate=0.97))
    replayed, shrunk = RowStats(spec), RowStats(spec)
    rng = np.random.default_rng(3)
    values = np.concatenate([rng.uniform(0, 1e4, (50, 2)), [[1e-45, 3e-45], [0.0, 0.0]]])
    for stats in (replayed, shrunk):
        stats.reserve(len(values), 0)
        stats.created(0, len(values), 0)
        stats.cols.array[:len(values), :2] = values.astype(np.float32)
    replayed.decay(len(values), passes)
    for p in range(passes):
        shrunk.shrink(len(values), p + 1, 10 ** 9)
    np.testing.assert_array_equal(replayed.cols.array[:len(values), :2],
                                  shrunk.cols.array[:len(values), :2])
