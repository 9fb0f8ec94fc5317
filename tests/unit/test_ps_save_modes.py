"""Save modes on the servers' shards: 0 everything, 1 a base (weights), 2 deltas (changed rows
and removed ids). A base plus its deltas replayed in order rebuilds the tables exactly, on the
same number of servers or another; chains are checked (a delta without its base, of another
chain, out of order, or after a full save is refused naming the manifests); mode 0 keeps the
pending admission counts, every mode the statistics; ``var_names`` loads only some tables."""
import json

import numpy as np
import pytest

from fleetx.checkpoint import Checkpoint, CheckpointError, SaveWriter
from fleetx.ps import PSConfig, PSConfigError, RuleConfig, SparseTableSpec, Tables
from fleetx.ps.api import AccessorConfig, CountFilterEntry, DenseTableSpec, RequestError
from fleetx.ps.checkpoint import save_dense
from fleetx.ps.partition import dense_ranges, server_of
from fleetx.ps.requests import Push
from fleetx.ps.shard import Shard

TABLES = Tables((SparseTableSpec("emb", 3, RuleConfig("sgd", lr=0.5),
                                 accessor=AccessorConfig(delete_after_unseen_days=0)),
                 SparseTableSpec("tag", 2, RuleConfig("adagrad", lr=0.1))),
                (DenseTableSpec("dense", 6, RuleConfig("sgd", lr=0.5)),))


def config(n):
    return PSConfig([f"127.0.0.1:{i + 1}" for i in range(n)], 1, shard_num=10)


class Job:
    """Two servers' shards, updated through pushes as a worker would."""

    def __init__(self, n=2, load=None, tables=TABLES, var_names=None):
        self.n, self.tables = n, tables
        self.shards = [Shard(config(n), i, tables, load_dir=load, load_tables=var_names)
                       for i in range(n)]

    def push(self, name, ids, grads):
        ids = np.asarray(ids, np.int64)
        for i, shard in enumerate(self.shards):
            mine = server_of(ids, self.n, 10) == i
            if mine.any():
                shard.apply(Push([(name, ids[mine], grads[mine])], [], []))

    def dense_step(self, g):
        for i, shard in enumerate(self.shards):
            start, stop = dense_ranges(6, self.n)[i]
            shard.apply(Push([], [("dense", np.full(stop - start, g, np.float32))], []))

    def save(self, dirname, mode):
        writer = SaveWriter(dirname)
        chains = [shard.save(writer, mode).get("chain") for shard in self.shards]
        if self.tables.dense:
            save_dense(writer, {"dense": self.dense()}, mode)
        info = {"mode": mode}
        if mode == 2:
            info.update(base_save_id=chains[0]["base"], prev_save_id=chains[0]["prev"])
        return writer.commit(info)

    def shrink(self):
        return [s.shrink(None) for s in self.shards]

    def rows(self, name):
        """{id: weights} over every server."""
        out = {}
        for shard in self.shards:
            t = shard.sparse[name]
            out.update(zip(t.index.keys.tolist(), t.slab[:, :t.dim].tolist()))
        return out

    def dense(self):
        return np.concatenate([s.dense["dense"].pull() for s in self.shards])


def train(job, rng, ids, steps=1):
    for _ in range(steps):
        job.push("emb", ids, rng.standard_normal((len(ids), 3)).astype(np.float32))
        job.push("tag", ids, rng.standard_normal((len(ids), 2)).astype(np.float32))
        job.dense_step(float(rng.standard_normal()))


@pytest.fixture
def chain(tmp_path):
    """A job saved as a base, then two deltas with training and evictions between them."""
    rng = np.random.default_rng(0)
    job = Job()
    train(job, rng, np.arange(0, 60))
    job.shrink()
    base = job.save(tmp_path / "base", 1)
    train(job, rng, np.arange(30, 90))  # rows 0-29 unseen in this pass: evicted below
    assert sum(r["emb"]["removed"] for r in job.shrink()) == 30
    d1 = job.save(tmp_path / "d1", 2)
    train(job, rng, np.arange(80, 100))
    train(job, rng, np.arange(0, 5))  # evicted ids come back
    d2 = job.save(tmp_path / "d2", 2)
    return job, [tmp_path / "base", tmp_path / "d1", tmp_path / "d2"], (base, d1, d2)


@pytest.mark.parametrize("servers", [2, 3])
def test_a_base_and_its_deltas_rebuild_the_tables(chain, servers):
    job, dirs, _ = chain
    again = Job(servers, load=[str(d) for d in dirs])
    assert again.rows("emb") == job.rows("emb")  # weights exactly, removed rows absent
    assert again.rows("tag") == job.rows("tag")
    np.testing.assert_array_equal(again.dense(), job.dense())
    assert sorted(again.rows("emb")) == list(range(0, 5)) + list(range(30, 100))


def test_a_delta_holds_only_what_changed(chain):
    _, dirs, (base, d1, d2) = chain
    assert (d1.info, d2.info) == ({"mode": 2, "base_save_id": base.save_id,
                                   "prev_save_id": base.save_id},
                                  {"mode": 2, "base_save_id": base.save_id,
                                   "prev_save_id": d1.save_id})
    ck = Checkpoint(str(dirs[2]))
    keys = np.concatenate([ck.read_array(f"server-{i}-of-2/sparse-emb.keys.npy")
                           for i in range(2)])
    deleted = np.concatenate([ck.read_array(f"server-{i}-of-2/sparse-emb.deleted.npy")
                              for i in range(2)])
    assert sorted(keys.tolist()) == list(range(5)) + list(range(80, 100))
    assert deleted.tolist() == [] or set(deleted.tolist()) <= set(range(30, 80))
    ck1 = Checkpoint(str(dirs[1]))
    gone = np.concatenate([ck1.read_array(f"server-{i}-of-2/sparse-emb.deleted.npy")
                           for i in range(2)])
    assert sorted(gone.tolist()) == list(range(30))
    rows = ck1.read_array("server-0-of-2/sparse-tag.rows.npy")
    assert rows.shape[1] == 2  # a base's chain carries weights only (no Adagrad sums)


def test_chains_are_checked_naming_the_manifests(chain, tmp_path):
    job, (base, d1, d2), _ = chain
    with pytest.raises(CheckpointError, match=rf"{d1}/manifest.json: save .* is a delta \(mode "
                                              r"2\) of base save .*, which is missing"):
        Job(load=[str(d1)])
    with pytest.raises(CheckpointError, match=rf"{d2}/manifest.json: delta that follows save "
                                              rf".*, but the save given before it "
                                              rf"\({base}/manifest.json\) is"):
        Job(load=[str(base), str(d2)])
    other = Job()
    other.save(tmp_path / "other", 1)
    with pytest.raises(CheckpointError, match=rf"{d1}/manifest.json: delta of base save .*, "
                                              r"but the base given .* it belongs to another "
                                              r"chain"):
        Job(load=[str(tmp_path / "other"), str(d1)])
    with pytest.raises(CheckpointError, match=r"only deltas \(mode 2\) may follow"):
        Job(load=[str(base), str(tmp_path / "other")])


def test_a_delta_needs_a_base_and_continues_a_loaded_chain(chain, tmp_path):
    job, dirs, (_, _, d2) = chain
    writer = SaveWriter(tmp_path / "orphan")
    with pytest.raises(RequestError, match=r"a delta \(mode 2\) needs a base"):
        Job().shards[0].save(writer, 2)
    resumed = Job(load=[str(d) for d in dirs])
    rng = np.random.default_rng(5)
    train(resumed, rng, np.arange(95, 110))
    train(job, np.random.default_rng(5), np.arange(95, 110))
    d3 = resumed.save(tmp_path / "d3", 2)
    assert d3.info["prev_save_id"] == d2.save_id
    # SGD rows go on exactly (a mode-1 chain restarts Adagrad's sums: weights only)
    assert Job(load=[str(d) for d in dirs] + [str(tmp_path / "d3")]).rows("emb") == \
        job.rows("emb")


def test_a_mode0_chain_carries_optimizer_state_statistics_and_pending_counts(tmp_path):
    tables = Tables((SparseTableSpec("emb", 3, RuleConfig("adagrad", lr=0.1),
                                     entry=CountFilterEntry(3),
                                     accessor=AccessorConfig(delete_after_unseen_days=5)),))
    job = Job(tables=tables)
    ids = np.arange(20)
    for shard in job.shards:
        for _ in range(3):
            shard.pull({"sparse": ["emb"], "create": True}, [ids[server_of(ids, 2, 10) ==
                                                                 shard.index]])
    job.push("emb", ids, np.ones((20, 3), np.float32))  # admitted at the third sighting
    for shard in job.shards:
        shard.pull({"sparse": ["emb"], "create": True},
                   [np.array([i for i in (500, 501) if server_of(np.array([i]), 2, 10)[0] ==
                              shard.index], np.int64)])
    job.shrink()
    job.save(tmp_path / "full", 0)
    job.push("emb", ids[:5], np.ones((5, 3), np.float32))
    job.save(tmp_path / "delta", 2)
    again = Job(3, load=[str(tmp_path / "full"), str(tmp_path / "delta")], tables=tables)

    def state(j):
        out = {}
        for s in j.shards:
            t = s.sparse["emb"]
            out.update(zip(t.index.keys.tolist(), t.slab.tolist()))
        return out
    assert state(again) == state(job)  # weights and Adagrad sums
    pending = sorted(k for s in again.shards for k in s.sparse["emb"].admission.index.keys
                     .tolist())
    assert pending == [500, 501]
    # the delta carries the statistics of the rows it holds: rows 0-4 were updated in the
    # current pass, the others one pass before
    stats = np.concatenate([s.sparse["emb"].row_stats(ids[server_of(ids, 3, 10) == s.index])
                            for s in again.shards])
    keys = np.concatenate([ids[server_of(ids, 3, 10) == s.index] for s in again.shards])
    assert dict(zip(keys.tolist(), stats[:, 0].tolist())) == {i: float(i >= 5) for i in ids}


def test_var_names_loads_only_the_named_tables(chain):
    job, dirs, _ = chain
    again = Job(load=[str(d) for d in dirs], var_names=["tag"])
    assert again.rows("tag") == job.rows("tag") and again.rows("emb") == {}
    assert (again.dense() == 0).all()
    with pytest.raises(PSConfigError, match=r"var_names: no table 'nope' in this job; its "
                                            r"tables: dense, emb, tag"):
        Job(load=str(dirs[0]), var_names=["nope"])


def test_var_names_on_a_chain_replays_it_for_those_tables_and_a_delta_then_refuses(chain,
                                                                                   tmp_path):
    """Loading some tables of a base and its deltas replays the whole chain for them; a delta
    after that would claim the chain's rows for the tables not loaded, so it is refused naming
    them until a full save starts a chain again, which deltas then continue."""
    job, dirs, (base, _, d2) = chain
    again = Job(load=[str(d) for d in dirs], var_names=["tag", "dense"])
    assert again.rows("tag") == job.rows("tag") and again.rows("emb") == {}
    assert all(s.chain.base == base.save_id and s.chain.prev == d2.save_id
               for s in again.shards)
    with pytest.raises(RequestError, match=r"SAVE: a delta \(mode 2\) cannot continue the "
                       rf"chain of base save {base.save_id}: its table\(s\) 'emb' were not "
                       r"loaded .* make a full save \(mode 0 or 1\) first"):
        again.save(tmp_path / "d3", 2)
    rng = np.random.default_rng(5)
    again.save(tmp_path / "new", 1)
    train(again, rng, np.arange(10, 20))
    again.save(tmp_path / "new-d", 2)
    back = Job(load=[str(tmp_path / "new"), str(tmp_path / "new-d")])
    assert back.rows("emb") == again.rows("emb") and back.rows("tag") == again.rows("tag")


def test_a_one_process_job_refuses_a_delta_after_loading_some_tables_only(chain, tmp_path):
    from fleetx.ps.checkpoint import load_server
    from fleetx.ps.rules import make_rule
    from fleetx.ps.table import SparseTable
    from fleetx.ps.api import StateError
    from fleetx.ps_torch.saving import LocalChain
    _, dirs, _ = chain
    tables = {t.name: SparseTable(t, make_rule(t.rule)) for t in TABLES.sparse}
    loaded = load_server([str(d) for d in dirs], 0, 1, 1, tables, {}, ["emb"])
    assert loaded.chain.skipped == ("tag",)
    with pytest.raises(StateError, match=r"save_persistables\(mode=2\): a delta .* its "
                                         r"table\(s\) 'tag' were not loaded"):
        LocalChain(tables, loaded.chain).save(str(tmp_path / "d"), 2, {}, ())
    full = load_server([str(d) for d in dirs], 0, 1, 1, tables, {})
    assert full.chain.skipped == ()
    LocalChain(tables, full.chain).save(str(tmp_path / "d"), 2, {}, ())


def test_manifest_info_must_agree_with_the_server_folders(chain):
    _, (base, _, _), _ = chain
    path = base / "manifest.json"
    body = json.loads(path.read_text())
    body["info"] = {"mode": 0}
    from fleetx.checkpoint.manifest import write_manifest
    from fleetx.checkpoint.api import FileEntry, Manifest
    write_manifest(str(base), Manifest(body["save_id"], body["folder"], {
        k: FileEntry.from_json(k, v) for k, v in body["files"].items()}, body["created"],
        body["info"]))
    with pytest.raises(CheckpointError, match=rf"{base}/manifest.json: its info .* disagrees "
                                              r"with the server folders \(mode 1"):
        Job(load=str(base))


@pytest.mark.parametrize("name", ["sparse-emb.deleted.npy", "sparse-emb.keys.npy",
                                  "meta.json"])
def test_a_damaged_file_of_a_delta_is_refused_naming_it(chain, name):
    _, dirs, _ = chain
    path = next(dirs[1].glob("save-*")) / "server-1-of-2" / name
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"checksum mismatch: {path} has SHA-256"):
        Job(load=[str(d) for d in dirs])
