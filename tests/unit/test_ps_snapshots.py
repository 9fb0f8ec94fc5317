"""A server's failover snapshots without a running cluster: what a restarted server does with
a damaged snapshot, and the checks of loading a server's own folder of a save."""
import sys
from pathlib import Path

import numpy as np
import pytest

from fleetx.checkpoint import Checkpoint, CheckpointError
from fleetx.ps import (DenseTableSpec, InitConfig, PSConfig, PSServer, RuleConfig,
                       SparseTableSpec, Tables)
from fleetx.ps.checkpoint import load_server_folder
from fleetx.ps.partition import server_of
from fleetx.ps.snapshots import Snapshots

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import free_ports  # noqa: E402  (tests/helpers.py)

TABLES = Tables((SparseTableSpec("emb", 3, RuleConfig("adagrad", lr=0.5),
                                 InitConfig("uniform", low=-1, high=1, seed=5)),),
                (DenseTableSpec("dense", 10, RuleConfig("adagrad", lr=0.5)),))
IDS = np.arange(40, dtype=np.int64)


def config(tmp_path, restart=0, job="job-a", shard_num=None):
    ports = free_ports(2)
    return PSConfig([f"127.0.0.1:{p}" for p in ports], 1, mode="async",
                    snapshot_dir=str(tmp_path), snapshot_interval=3600.0, snapshot_job=job,
                    restart_count=restart, **({"shard_num": shard_num} if shard_num else {}))


def snapshot(tmp_path, **kw) -> tuple[PSConfig, PSServer, Snapshots]:
    """Server 0 (not started) with some rows and a trained dense slice, snapshotted."""
    cfg = config(tmp_path, **kw)
    server = PSServer(cfg, 0, TABLES)
    own = IDS[server_of(IDS, 2, cfg.shard_num) == 0][:5]
    server.shard.sparse["emb"].assign(own, np.full((len(own), 3), 0.25, np.float32))
    dense = server.shard.dense["dense"]
    dense.assign(np.arange(dense.numel, dtype=np.float32))
    server.shard.initialized.add("dense")
    snaps = Snapshots(cfg, 0)
    snaps.take(server.shard, {0: 7})
    return cfg, server, snaps


def test_a_damaged_snapshot_manifest_stops_the_restarted_server_naming_the_file(tmp_path):
    """Not "restarted before its first snapshot": the workers would not send their initial
    values again, so starting from the initializers would silently lose the job."""
    cfg, _, snaps = snapshot(tmp_path)
    manifest = Path(snaps.dirname) / "manifest.json"
    manifest.write_bytes(b"{ not json")
    with pytest.raises(CheckpointError, match=f"checksum mismatch: {manifest}"):
        snaps.available()
    with pytest.raises(CheckpointError, match=str(manifest)):
        PSServer(config(tmp_path, restart=1), 0, TABLES)


def test_no_snapshot_or_another_jobs_is_not_available(tmp_path):
    assert not Snapshots(config(tmp_path), 0).available()
    snapshot(tmp_path)
    assert not Snapshots(config(tmp_path, job="job-b"), 0).available()
    assert Snapshots(config(tmp_path), 0).available()


def test_a_restored_server_holds_the_snapshot(tmp_path):
    cfg, server, _ = snapshot(tmp_path)
    restarted = PSServer(config(tmp_path, restart=1), 0, TABLES)
    assert restarted.restored.pushes == {0: 7}
    assert restarted.shard.initialized == {"dense"}
    np.testing.assert_array_equal(restarted.shard.dense["dense"].slab,
                                  server.shard.dense["dense"].slab)
    before, after = server.shard.sparse["emb"], restarted.shard.sparse["emb"]
    assert len(after) == len(before) == 5
    keys = before.index.keys[:5]
    np.testing.assert_array_equal(after.slab[after.index.find(keys)],
                                  before.slab[before.index.find(keys)])


def test_a_folder_of_another_cluster_shape_is_refused_naming_its_metadata(tmp_path):
    cfg, server, snaps = snapshot(tmp_path, shard_num=4)
    with pytest.raises(CheckpointError, match=r"server-0-of-2/meta.json: written by server 0 of "
                                              r"2 \(shard_num 4\), this is server 0 of 2 "
                                              r"\(shard_num 8\)"):
        load_server_folder(Checkpoint(snaps.dirname), 0, 2, 8, server.shard.sparse,
                           server.shard.dense)
