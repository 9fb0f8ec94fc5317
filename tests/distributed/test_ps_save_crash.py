"""Saving again to the same folder replaces a parameter-server checkpoint atomically: a first
worker killed (SIGKILL) after the servers wrote their shards of a second save, but before it
committed that save, leaves the first save whole, and new servers start from it."""
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

from fleetx.checkpoint import Checkpoint
from fleetx.ps import (DenseTableSpec, KVClient, PSConfig, PSServer, RuleConfig,
                       SparseTableSpec, Tables)

ROOT = Path(__file__).resolve().parents[2]
TABLES = Tables((SparseTableSpec("emb", 4, RuleConfig("adam", lr=0.1)),),
                (DenseTableSpec("dense", 6, RuleConfig("adam", lr=0.1)),))

_WORKER = textwrap.dedent("""
    import json, os, signal, sys
    import numpy as np
    from fleetx.checkpoint import SaveWriter
    from fleetx.ps import PSConfig, Tables
    from fleetx.ps_torch import make_communicator
    cfg, tables, ckpt, out = (PSConfig(**json.loads(sys.argv[1])), Tables.from_json(sys.argv[2]),
                              sys.argv[3], sys.argv[4])
    comm = make_communicator(cfg, 0, tables)
    params = comm.start(dense={"dense": np.arange(6, dtype=np.float32)})
    ids = np.arange(-30, 30)

    def step(k):
        rng = np.random.default_rng(k)
        comm.step(params, {"dense": rng.standard_normal(6).astype(np.float32)},
                  {"emb": (ids, rng.standard_normal((60, 4)).astype(np.float32))})

    step(0)
    comm.save(ckpt)                                  # the first save, committed
    rows = comm.pull_sparse({"emb": ids}, create=False).wait().sparse["emb"].expand()
    np.savez(out, rows=rows, dense=params["dense"])
    step(1)
    writer = SaveWriter(ckpt)                        # the second save: the servers write...
    comm.client.save(writer.dirname, writer.save_id).wait()
    print("servers wrote", writer.save_id, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)             # ...and the worker dies before its commit
""")


def test_a_worker_killed_before_committing_a_second_save_leaves_the_first(tmp_path):
    cfg = PSConfig(["127.0.0.1:0", "127.0.0.1:0"], 1, mode="sync", heartbeat_interval=0.3,
                   dead_after=3.0, timeout=30.0, save_root=str(tmp_path))
    servers = [PSServer(cfg, i, TABLES).start() for i in range(2)]
    cfg = PSConfig(**{**cfg.to_dict(), "servers": [s.endpoint for s in servers]})
    ckpt, out = tmp_path / "ckpt", tmp_path / "first.npz"
    p = subprocess.run([sys.executable, "-c", _WORKER, json.dumps(cfg.to_dict()),
                        TABLES.to_json(), str(ckpt), str(out)], capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    for s in servers:
        s.stop()
    assert p.returncode == -signal.SIGKILL, p.stderr
    second = p.stdout.split()[-1]
    first = Checkpoint(ckpt)
    assert first.save_id != second and (ckpt / f"save-{second}" / "server-1-of-2").is_dir()

    resumed = [PSServer(cfg, i, TABLES, load_dir=str(ckpt)).start() for i in range(2)]
    cfg = PSConfig(**{**cfg.to_dict(), "servers": [s.endpoint for s in resumed]})
    client = KVClient(cfg, 0, TABLES)
    client.start()
    expected = np.load(out)
    got = client.pull({"emb": np.arange(-30, 30)}, dense=["dense"], create=False).wait()
    np.testing.assert_array_equal(got.sparse["emb"].expand(), expected["rows"])
    np.testing.assert_array_equal(got.dense["dense"], expected["dense"])
    client.stop()
    for s in resumed:
        s.stop()
