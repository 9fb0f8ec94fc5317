"""fleet.util collectives on 2 processes, lazy joining, and a missing peer named on timeout."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spawn import free_port, run  # noqa: E402


def _collectives(rank: int, world: int, out: str) -> None:
    from fleetx import fleet
    from fleetx.role_maker import UserDefinedRoleMaker
    import os
    endpoints = [f"127.0.0.1:{os.environ['MASTER_PORT']}", "127.0.0.1:1"]
    # A user-defined role opens no connection at init; the first collective joins.
    fleet.init(UserDefinedRoleMaker(is_collective=True, current_id=rank,
                                    worker_endpoints=endpoints))
    joined_at_init = fleet._fleet._comm is not None
    u = fleet.util
    r = {
        "joined_at_init": joined_at_init,
        "sum_int": u.all_reduce(rank + 3),
        "max_float": u.all_reduce(float(rank) + 0.5, "max"),
        "min_np": u.all_reduce(np.array([[rank, 10 - rank]]), "min"),
        "sum_tensor": u.all_reduce(torch.tensor([1.0, rank])),
        "gather": u.all_gather(rank),
        "gather_shapes": u.all_gather(np.arange(rank + 2)),
        "bcast": u.broadcast(np.array([rank * 7.0]), src=1),
        "a2a": u.all_to_all([np.array([rank, 0]), np.arange(rank + 1) + 10 * rank]),
        "endpoints": fleet.worker_endpoints(),
        "num": fleet.worker_num(),
    }
    try:  # worker 1 would send 824 bytes: every worker refuses, before any data moves
        u.all_to_all([np.zeros(3), np.zeros(rank * 100)], max_bytes=800)
    except ValueError as e:
        r["a2a_cap"] = str(e)
    r["a2a_after"] = u.all_to_all([np.array([rank]), np.array([rank])])  # still in step
    fleet.barrier_worker()
    torch.save(r, f"{out}/rank{rank}.pt")


def test_util_collectives(tmp_path):
    run(_collectives, 2, str(tmp_path))
    for rank in range(2):
        r = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert r["joined_at_init"] is False
        assert r["sum_int"] == 7 and isinstance(r["sum_int"], int)
        assert r["max_float"] == 1.5
        assert r["min_np"].tolist() == [[0, 9]]
        assert r["sum_tensor"].tolist() == [2.0, 1.0]
        assert r["gather"] == [0, 1]
        assert [a.tolist() for a in r["gather_shapes"]] == [[0, 1], [0, 1, 2]]
        assert r["bcast"].tolist() == [7.0]
        # worker w sent [w, 0] to worker 0 and [10w .. 10w + w] to worker 1
        assert [a.tolist() for a in r["a2a"]] == ([[0, 0], [1, 0]] if rank == 0 else
                                                  [[0], [10, 11]])
        assert r["num"] == 2
        assert r["a2a_cap"] == ("fleet.util.all_to_all: worker 1 sends 824 bytes in one "
                                "exchange, more than max_bytes=800; exchange in several parts")
        assert [a.tolist() for a in r["a2a_after"]] == [[0], [1]]


def test_missing_peer_is_named(monkeypatch):
    from fleetx.comm.groups import CommError, ProcessGroups
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    start = time.monotonic()
    with pytest.raises(CommError) as err:
        ProcessGroups.join(rank=0, world_size=3, endpoints=["127.0.0.1:1", "10.1.1.1:2", "h:3"],
                          timeout=2)
    assert time.monotonic() - start < 15
    assert "waiting for rank(s) 1 (10.1.1.1:2), 2 (h:3) to join" in str(err.value)


def test_unreachable_master_is_named(monkeypatch):
    from fleetx.comm.groups import CommError, ProcessGroups
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))  # nobody listens there
    with pytest.raises(CommError, match="rank 1 could not reach rank 0's rendezvous store at "
                                        "127.0.0.1:"):
        ProcessGroups.join(rank=1, world_size=2, timeout=2)
