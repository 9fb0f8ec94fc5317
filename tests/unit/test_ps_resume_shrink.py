"""A job resumed from a save shrinks as the uninterrupted job does.

Every save mode that holds rows (0, 1, and the deltas of either) holds their statistics (show,
click, passes unseen) and the table's pass counter, and a delta replays the show/click decay of
the shrinks since the save before it on the rows it does not hold. So after resuming from mode
0, mode 1, or a base and its deltas, each later shrink removes exactly the rows the
uninterrupted job's removes, and the statistics are the same bits.
"""
import numpy as np
import pytest

from fleetx.ps import RuleConfig, SparseTableSpec, Tables
from fleetx.ps.api import AccessorConfig, CountFilterEntry, ShowClickEntry
from fleetx.ps.partition import server_of

from test_ps_save_modes import Job

UNSEEN = SparseTableSpec("unseen", 3, RuleConfig("sgd", lr=0.5),
                         accessor=AccessorConfig(delete_after_unseen_days=2))
CTR = SparseTableSpec("ctr", 2, RuleConfig("adagrad", lr=0.1), entry=ShowClickEntry(),
                      accessor=AccessorConfig(show_click_decay_rate=0.9, delete_threshold=0.35,
                                              delete_after_unseen_days=3))
ADMIT = SparseTableSpec("admit", 2, RuleConfig("sgd", lr=0.5), entry=CountFilterEntry(2),
                        accessor=AccessorConfig(delete_after_unseen_days=1))
TABLES = Tables((UNSEEN, CTR), ())


def one_pass(job, rng, tables=(UNSEEN, CTR)):
    """One pass of training on random ids of every table; then a shrink (returns its report)."""
    for spec in tables:
        ids = np.unique(rng.integers(0, 80, 30))
        if spec.admission:
            for shard in job.shards:
                mine = ids[server_of(ids, job.n, 10) == shard.index]
                shard.pull({"sparse": [spec.name], "create": True}, [mine])
        values = rng.standard_normal((len(ids), spec.push_width)).astype(np.float32)
        if spec.show_click:
            values[:, -2] = rng.integers(0, 3, len(ids))  # show
            values[:, -1] = rng.integers(0, 2, len(ids)) * (values[:, -2] > 0)  # click
        job.push(spec.name, ids, values)
    reports = job.shrink()
    return {n: sum(r[n]["removed"] for r in reports) for n in reports[0]}


def state(job, name):
    """{id: [show, click,] passes unseen} over every server, and the table's pass counter."""
    out, passes = {}, set()
    for shard in job.shards:
        t = shard.sparse[name]
        keys = t.index.keys.copy()
        out.update(zip(keys.tolist(), t.row_stats(keys).tolist()))
        passes.add(t.passes)
    return out, passes


def same_future(live, resumed, rng_seed, tables=(UNSEEN, CTR), passes=5):
    """Train both jobs alike for ``passes`` passes: every shrink removes the same rows."""
    for spec in tables:
        assert state(resumed, spec.name) == state(live, spec.name), spec.name
    a, b = np.random.default_rng(rng_seed), np.random.default_rng(rng_seed)
    removed = 0
    for _ in range(passes):
        got, want = one_pass(resumed, a, tables), one_pass(live, b, tables)
        assert got == want
        removed += sum(want.values())
        for spec in tables:
            assert state(resumed, spec.name) == state(live, spec.name), spec.name
    assert removed > 0  # the comparison covered evictions


@pytest.mark.parametrize("mode", [0, 1])
def test_resuming_from_a_full_save_then_shrinking_removes_the_same_rows(tmp_path, mode):
    rng = np.random.default_rng(1)
    live = Job(tables=TABLES)
    for _ in range(6):
        one_pass(live, rng)
    live.save(tmp_path / "s", mode)
    same_future(live, Job(3, load=str(tmp_path / "s"), tables=TABLES), 7)


@pytest.mark.parametrize("base_mode", [0, 1])
def test_resuming_from_a_base_and_deltas_then_shrinking_removes_the_same_rows(tmp_path,
                                                                              base_mode):
    rng = np.random.default_rng(2)
    live = Job(tables=TABLES)
    for _ in range(3):
        one_pass(live, rng)
    dirs = [tmp_path / "base"]
    live.save(dirs[0], base_mode)
    for k in range(2):  # several shrinks between saves: rows not in a delta decay meanwhile
        for _ in range(3):
            one_pass(live, rng)
        dirs.append(tmp_path / f"d{k}")
        live.save(dirs[-1], 2)
    same_future(live, Job(2, load=[str(d) for d in dirs], tables=TABLES), 8)


def test_a_mode0_chain_resumes_admission_and_its_shrinks(tmp_path):
    """Pending ids travel with the state of a mode 0 chain: a delta's set replaces the base's
    (ids admitted or forgotten since are gone), so admissions continue alike too."""
    tables = Tables((ADMIT,), ())
    rng = np.random.default_rng(3)
    live = Job(tables=tables)
    for _ in range(3):
        one_pass(live, rng, (ADMIT,))
    live.save(tmp_path / "base", 0)
    for _ in range(3):
        one_pass(live, rng, (ADMIT,))
    live.save(tmp_path / "d", 2)
    resumed = Job(load=[str(tmp_path / "base"), str(tmp_path / "d")], tables=tables)

    def pending(job):
        return sorted((int(k), c.tolist()) for s in job.shards
                      for k, c in zip(*s.sparse["admit"].admission.state()))
    assert pending(resumed) == pending(live) and pending(live)
    same_future(live, resumed, 9, (ADMIT,))


def test_a_save_without_statistics_counts_its_rows_as_seen_in_its_last_pass(tmp_path):
    """Rows of a table saved without an accessor, loaded into one with an accessor, are not
    evicted by the first shrink after resuming."""
    plain = Tables((SparseTableSpec("unseen", 3, RuleConfig("sgd", lr=0.5)),), ())
    job = Job(tables=plain)
    job.push("unseen", np.arange(10), np.ones((10, 3), np.float32))
    for _ in range(4):
        job.shrink()
    job.save(tmp_path / "s", 1)
    resumed = Job(load=str(tmp_path / "s"), tables=Tables((UNSEEN,), ()))
    rows, passes = state(resumed, "unseen")
    assert passes == {4} and set(rows) == set(range(10))
    assert all(v == [0.0] for v in rows.values())
    assert sum(r["unseen"]["removed"] for r in resumed.shrink()) == 0
