"""Parameter-server checkpoints you can trust: every kind of file of a real two-server save
is corrupted on disk in each way (a flipped byte, a missing file, a NaN row, a duplicated key,
a wrong row count in meta.json, files of another save), and loading refuses, naming the file.
Where the damage keeps the bytes consistent with a re-made manifest (a tool or a person that
edited the files and re-hashed them), the data checks catch it."""
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fleetx.checkpoint import Checkpoint, CheckpointError, FileEntry, Manifest, SaveWriter
from fleetx.checkpoint.manifest import write_manifest
from fleetx.ps import PSConfigError, DenseTableSpec, PSConfig, RuleConfig, SparseTableSpec, Tables
from fleetx.ps.checkpoint import load_dense, save_dense
from fleetx.ps.partition import dense_ranges, server_of
from fleetx.ps.requests import Push
from fleetx.ps.shard import Shard

ROOT = Path(__file__).resolve().parents[2]
TABLES = Tables((SparseTableSpec("emb", 3, RuleConfig("adam", lr=0.1)),),
                (DenseTableSpec("dense", 10, RuleConfig("adam", lr=0.1)),))
CONFIG = PSConfig(["127.0.0.1:1", "127.0.0.1:2"], 1, shard_num=10)
IDS = np.arange(-20, 20, dtype=np.int64)
S0 = "server-0-of-2"


def trained_shards(value: float) -> list:
    """Both servers' shards after an INIT and one Adam step (so the rows carry state)."""
    shards = []
    for index in range(2):
        shard = Shard(CONFIG, index, TABLES)
        mine = IDS[server_of(IDS, 2, 10) == index]
        start, stop = dense_ranges(10, 2)[index]
        rows = np.full((len(mine), 3), value, np.float32)
        shard.init(Push([("emb", mine, rows)], [("dense", np.full(stop - start, value,
                                                                    np.float32))], []), True)
        shard.apply(Push([("emb", mine, rows)], [("dense", np.ones(stop - start, np.float32))],
                         []))
        shards.append(shard)
    return shards


def make_save(dirname: Path, value: float = 1.0) -> Manifest:
    writer = SaveWriter(dirname)
    for shard in trained_shards(value):
        shard.save(writer)
    save_dense(writer, {"dense": np.full(10, value, np.float32)})
    return writer.commit()


def load(dirname: Path) -> list:
    return [Shard(CONFIG, i, TABLES, load_dir=str(dirname)) for i in range(2)]


def rehash(dirname: Path) -> None:
    """Re-make the manifest from the files as they are now (hashes consistent again)."""
    body = json.loads((dirname / "manifest.json").read_text())
    folder = dirname / body["folder"]
    files = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            rel = path.relative_to(folder).as_posix()
            data = path.read_bytes()
            files[rel] = FileEntry(rel, hashlib.sha256(data).hexdigest(), len(data))
    write_manifest(str(dirname), Manifest(body["save_id"], body["folder"], files))


def folder(dirname: Path) -> Path:
    return next(dirname.glob("save-*"))


FILES = [f"{S0}/sparse-emb.keys.npy", f"{S0}/sparse-emb.rows.npy", f"{S0}/dense-dense.npy",
         f"{S0}/meta.json", "dense.json", "dense-dense.npy"]


def test_a_save_loads_back_exactly(tmp_path):
    make_save(tmp_path / "c")
    for before, after in zip(trained_shards(1.0), load(tmp_path / "c")):
        np.testing.assert_array_equal(after.sparse["emb"].slab, before.sparse["emb"].slab)
        np.testing.assert_array_equal(after.dense["dense"].slab, before.dense["dense"].slab)
    np.testing.assert_array_equal(load_dense(str(tmp_path / "c"))["dense"], np.ones(10))


@pytest.mark.parametrize("rel", FILES)
def test_a_flipped_byte_in_any_file_is_a_checksum_mismatch_naming_it(tmp_path, rel):
    make_save(tmp_path / "c")
    path = folder(tmp_path / "c") / rel
    data = bytearray(path.read_bytes())
    data[-2] ^= 0x10  # in the last value (or the JSON's last characters)
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum mismatch") as e:
        load(tmp_path / "c")
    assert e.value.path == str(path), e.value


@pytest.mark.parametrize("rel", FILES)
def test_a_missing_file_is_refused_naming_it(tmp_path, rel):
    make_save(tmp_path / "c")
    path = folder(tmp_path / "c") / rel
    path.unlink()
    with pytest.raises(CheckpointError, match="missing file") as e:
        load(tmp_path / "c")
    assert e.value.path == str(path)


def edit_array(path: Path, fn) -> None:
    a = np.load(path)
    fn(a)
    np.save(path, a)


@pytest.mark.parametrize("rel, edit, message", [
    (f"{S0}/sparse-emb.rows.npy", lambda a: a.__setitem__((2, 0), np.nan),
     r"1 rows hold NaN or inf \(the first: key -?\d+\)"),
    (f"{S0}/sparse-emb.rows.npy", lambda a: a.__setitem__((0, 5), np.inf),
     r"1 rows hold NaN or inf"),
    (f"{S0}/dense-dense.npy", lambda a: a.__setitem__(1, np.nan), r"1 values are NaN or inf"),
    ("dense-dense.npy", lambda a: a.__setitem__(9, -np.inf), r"1 values are NaN or inf"),
    (f"{S0}/sparse-emb.keys.npy", lambda a: a.__setitem__(1, a[0]), r"duplicated key -?\d+"),
], ids=["nan-row", "inf-state", "nan-dense-slice", "inf-worker-dense", "duplicated-key"])
def test_bad_values_are_refused_even_with_a_consistent_manifest(tmp_path, rel, edit, message):
    make_save(tmp_path / "c")
    path = folder(tmp_path / "c") / rel
    edit_array(path, edit)
    rehash(tmp_path / "c")
    with pytest.raises(CheckpointError, match=message) as e:
        load(tmp_path / "c")
    assert e.value.path == str(path)


def test_a_wrong_row_count_in_meta_json_is_refused(tmp_path):
    make_save(tmp_path / "c")
    meta = folder(tmp_path / "c") / S0 / "meta.json"
    body = json.loads(meta.read_text())
    body["tables"]["emb"]["rows"] += 1
    meta.write_text(json.dumps(body))
    rehash(tmp_path / "c")
    with pytest.raises(CheckpointError, match=r"meta\.json: wrong row count: table 'emb' has "
                                              r"(\d+) rows here, but .* holds \d+ keys") as e:
        load(tmp_path / "c")
    assert e.value.path == str(meta)


@pytest.mark.parametrize("moved", [[S0], ["dense.json", "dense-dense.npy"]],
                         ids=["a-server-folder", "the-worker-dense-files"])
def test_files_of_different_saves_are_refused(tmp_path, moved):
    make_save(tmp_path / "a", 1.0)
    make_save(tmp_path / "b", 2.0)
    for rel in moved:  # same shapes, consistent hashes: only the save ids tell them apart
        src, dst = folder(tmp_path / "b") / rel, folder(tmp_path / "a") / rel
        shutil.rmtree(dst) if dst.is_dir() else dst.unlink()
        shutil.copytree(src, dst) if src.is_dir() else shutil.copy(src, dst)
    rehash(tmp_path / "a")
    with pytest.raises(CheckpointError, match="belongs to save '.*', but the manifest is of "
                                              "save '.*': files of different saves are mixed"):
        load(tmp_path / "a")


def test_keys_of_another_server_are_refused(tmp_path):
    make_save(tmp_path / "c")
    f = folder(tmp_path / "c")
    for name in ("sparse-emb.keys.npy", "sparse-emb.rows.npy"):  # swap the two servers' rows
        a, b = f / S0 / name, f / "server-1-of-2" / name
        data = a.read_bytes()
        a.write_bytes(b.read_bytes())
        b.write_bytes(data)
    for server in (0, 1):  # and fix the row counts, so only the keys' owners are wrong
        meta = f / f"server-{server}-of-2" / "meta.json"
        body = json.loads(meta.read_text())
        body["tables"]["emb"]["rows"] = len(np.load(f / f"server-{server}-of-2" /
                                                    "sparse-emb.keys.npy"))
        meta.write_text(json.dumps(body))
    rehash(tmp_path / "c")
    with pytest.raises(CheckpointError, match=r"key -?\d+ belongs to another server than "
                                              r"server 0 of 2"):
        load(tmp_path / "c")


def test_a_nan_table_is_not_saved_and_the_previous_checkpoint_stays(tmp_path):
    first = make_save(tmp_path / "c")
    shard = trained_shards(1.0)[0]
    shard.sparse["emb"].slab[3, 1] = np.nan
    writer = SaveWriter(tmp_path / "c")
    with pytest.raises(CheckpointError, match="table 'emb': 1 rows hold NaN or inf; not saving"):
        shard.save(writer)
    assert Checkpoint(tmp_path / "c").save_id == first.save_id
    load(tmp_path / "c")


def test_a_server_process_refuses_a_damaged_checkpoint_naming_the_file(tmp_path):
    make_save(tmp_path / "c")
    rows = folder(tmp_path / "c") / S0 / "sparse-emb.rows.npy"
    data = bytearray(rows.read_bytes())
    data[200] ^= 0xFF
    rows.write_bytes(bytes(data))
    cluster = tmp_path / "cluster.json"
    cluster.write_text(json.dumps({"config": {**CONFIG.to_dict(), "servers": ["127.0.0.1:0"] * 2},
                                   "tables": json.loads(TABLES.to_json())}))
    res = subprocess.run([sys.executable, "-m", "fleetx.ps", "serve", "--cluster", str(cluster),
                          "--index", "0", "--load", "c"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=60, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert res.returncode == 1, res.stderr
    assert f"fleetx.ps server 0: checksum mismatch: {rows} has SHA-256" in res.stderr, res.stderr


def test_loading_outside_the_save_root_is_refused_naming_both(tmp_path):
    from fleetx.ps import PSServer
    make_save(tmp_path / "c")
    config = PSConfig(CONFIG.servers, 1, shard_num=10, save_root=str(tmp_path / "root"))
    (tmp_path / "root").mkdir()
    for path in (str(tmp_path / "c"), "../c"):
        with pytest.raises(PSConfigError, match=rf"checkpoint folder '{path}' is outside the save "
                                              rf"root '{tmp_path / 'root'}'"):
            PSServer(config, 0, TABLES, load_dir=path)
    shutil.move(str(tmp_path / "c"), str(tmp_path / "root" / "c"))
    for path in (str(tmp_path / "root" / "c"), "c"):  # absolute or relative: both work
        PSServer(config, 0, TABLES, load_dir=path)
