"""A server checks every request before it touches a table (servers on threads, real loopback
sockets, requests built by hand where the client would refuse to send them): a malformed sync
push never takes the other worker's push down with it, non-finite gradients are refused or
skipped, learning rates are bounded, SAVE stays under its root and takes only its modes (a delta
only after a base), SHRINK only a valid threshold, tables have a row limit, and refused requests
are counted and logged without flooding the log."""
import dataclasses
import logging
import re
import time

import numpy as np
import pytest

from fleetx.ps import (PSConfigError, DenseTableSpec, InitConfig, KVClient, PSConfig, PSServer,
                       RemoteError, RuleConfig, SparseTableSpec, Tables)
from fleetx.ps.api import Kind

TABLES = Tables((SparseTableSpec("emb", 2, RuleConfig("sgd", lr=1.0),
                                 InitConfig("constant", value=1.0)),),
                (DenseTableSpec("dense", 4, RuleConfig("sgd", lr=1.0)),))
I64, F32 = np.int64, np.float32


@pytest.fixture
def cluster(tmp_path):
    servers = []

    def make(workers=1, **kw):
        cfg = PSConfig(["127.0.0.1:0"], workers, heartbeat_interval=0.3, dead_after=5.0,
                       timeout=30.0, save_root=str(tmp_path), **kw)
        servers.append(PSServer(cfg, 0, TABLES).start())
        cfg = dataclasses.replace(cfg, servers=(servers[-1].endpoint,))
        clients = [KVClient(cfg, r, TABLES) for r in range(workers)]
        for c in clients:
            c.start()
        return servers[-1], clients
    yield make
    for s in servers:
        s.stop()


def send(client, kind, meta, bufs=()):
    """A request exactly as given (the client's own checks would refuse most of these)."""
    return client._request(kind, {0: (meta, list(bufs), None)}, None)


def rows(client, ids=(1, 2, 3)):
    return client.pull({"emb": np.array(ids)}, create=False).wait().sparse["emb"].values.copy()


def test_a_malformed_sync_push_is_refused_alone_and_the_round_goes_on(cluster):
    server, (c0, c1) = cluster(workers=2, mode="sync")
    good = c0.push({"emb": (np.array([1]), np.full((1, 2), 2.0, F32))})
    bad = send(c1, Kind.PUSH, {"sparse": ["emb"], "dense": []},  # 5 ids, 4 floats
               [np.arange(5, dtype=I64), np.ones(4, F32)])
    with pytest.raises(RemoteError, match=r"RequestError: PUSH: table 'emb': got 4 values, "
                                          r"expected 10 \(5 ids x dim 2\)"):
        bad.wait(10)
    assert not good.done()  # the round still waits for worker 1's push of this step
    c1.push({"emb": (np.array([1]), np.full((1, 2), 4.0, F32))}).wait(10)
    good.wait(10)  # answered: the mean (2 + 4) / 2 was applied once
    np.testing.assert_allclose(rows(c0, [1]), [[1.0 - 3.0, 1.0 - 3.0]])


def test_a_round_that_cannot_be_applied_answers_every_member(cluster):
    server, (c0, c1) = cluster(workers=2, mode="sync", max_rows=3)
    h0 = c0.push({"emb": (np.array([1, 2]), np.ones((2, 2), F32))})
    h1 = c1.push({"emb": (np.array([3, 4]), np.ones((2, 2), F32))})  # 4 new rows > 3
    for h in (h0, h1):
        with pytest.raises(RemoteError, match=r"table 'emb' holds 0 rows here; 4 new ids would "
                                              r"pass its limit of 3 rows per server"):
            h.wait(10)
    assert server.stats()["rows"] == {"emb": 0}  # nothing of the round was applied


def test_pulls_that_would_pass_the_row_limit_are_refused(cluster):
    server, (c,) = cluster(max_rows=5)
    c.pull({"emb": np.arange(4)}).wait(10)
    with pytest.raises(RemoteError, match="4 new ids would pass its limit of 5 rows"):
        c.pull({"emb": np.arange(2, 8)}).wait(10)
    c.pull({"emb": np.arange(5)}).wait(10)  # exactly at the limit, and old ids are free
    assert server.stats()["rows"] == {"emb": 5}


def test_non_finite_gradients_are_refused_naming_the_table(cluster):
    server, (c,) = cluster()
    before = rows(c)
    g = np.ones((3, 2), F32)
    g[1, 0] = np.nan
    with pytest.raises(RemoteError, match=r"PUSH: non-finite \(NaN or inf\) gradients refused "
                                          r"in table 'emb' \(1\)"):
        c.push({"emb": (np.array([1, 2, 3]), g)}).wait(10)
    with pytest.raises(RemoteError, match=r"in table 'dense' \(1\)"):
        c.push(dense={"dense": np.array([0, 0, np.inf, 0], F32)}).wait(10)
    with pytest.raises(RemoteError, match=r"INIT: non-finite \(NaN or inf\) values refused"):
        c.init(dense={"dense": np.full(4, np.nan, F32)}, force=True).wait(10)
    np.testing.assert_array_equal(rows(c), before)
    np.testing.assert_array_equal(c.pull(dense=["dense"]).wait().dense["dense"], 0)
    stats = server.stats()
    assert stats["rejected"] == 3 and stats["rejected_by_kind"] == {"PUSH": 2, "INIT": 1}


def test_with_skip_a_non_finite_push_counts_as_zero_in_its_round(cluster):
    server, (c0, c1) = cluster(workers=2, mode="sync", nonfinite="skip")
    h0 = c0.push({"emb": (np.array([1]), np.full((1, 2), np.inf, F32))})
    h1 = c1.push({"emb": (np.array([1]), np.full((1, 2), 4.0, F32))})
    h0.wait(10), h1.wait(10)
    np.testing.assert_allclose(rows(c0, [1]), [[1.0 - 2.0, 1.0 - 2.0]])  # (0 + 4) / 2
    assert server.stats()["skipped_pushes"] == 1 and server.stats()["rejected"] == 0


def test_learning_rates_out_of_range_are_refused_and_the_maximum_is_configurable(cluster):
    _, (c,) = cluster(max_lr=50.0)
    for lr in (1e30, float("nan"), float("inf"), 0.0, -1.0, 51.0):
        with pytest.raises(RemoteError, match=r"SET_LR: learning rate .* refused: expected a "
                                              r"finite number in \(0, 50\]"):
            send(c, Kind.SET_LR, {"lr": lr}).wait(10)
    c.set_lr(50.0, ["emb"]).wait(10)
    c.push({"emb": (np.array([1]), np.full((1, 2), 0.5, F32))}).wait(10)
    np.testing.assert_allclose(rows(c, [1]), [[1.0 - 25.0, 1.0 - 25.0]])


def test_save_is_confined_to_the_save_root(cluster, tmp_path):
    server, (c,) = cluster()
    root = tmp_path.resolve()
    for path in ("../escape", str(tmp_path.parent / "escape"), "/etc/fleetx-test"):
        with pytest.raises(PSConfigError, match=re.escape(
                f"checkpoint folder {path!r} is outside the save root {str(root)!r}")):
            send(c, Kind.SAVE, {"dirname": path, "save_id": "s1"}).wait(10)
    assert not (tmp_path.parent / "escape").exists()
    send(c, Kind.SAVE, {"dirname": "rel", "save_id": "s2"}).wait(10)  # relative to the root
    send(c, Kind.SAVE, {"dirname": str(tmp_path / "abs"), "save_id": "s3"}).wait(10)
    assert (tmp_path / "rel" / "save-s2" / "server-0-of-1" / "meta.json").is_file()
    assert (tmp_path / "abs" / "save-s3" / "server-0-of-1" / "meta.json").is_file()
    (tmp_path / "link").symlink_to(tmp_path.parent)  # a link out of the root is no way out
    with pytest.raises(PSConfigError, match="is outside the save root"):
        send(c, Kind.SAVE, {"dirname": "link/escape", "save_id": "s4"}).wait(10)
    with pytest.raises(RemoteError, match=r"CheckpointError: invalid save id '\.\./x'"):
        send(c, Kind.SAVE, {"dirname": "rel", "save_id": "../x"}).wait(10)


def test_refused_requests_are_counted_and_logged_at_a_limited_rate(cluster, caplog):
    server, (c,) = cluster()
    caplog.set_level(logging.WARNING, "fleetx.ps")
    t0 = time.monotonic()
    for i in range(40):
        with pytest.raises(RemoteError):
            send(c, Kind.PULL, {"sparse": ["nope"]}, [np.arange(3, dtype=I64)]).wait(10)
    assert server.stats()["rejected_by_kind"] == {"PULL": 40}
    lines = [r.getMessage() for r in caplog.records if "refused PULL" in r.getMessage()]
    elapsed = time.monotonic() - t0  # one warning per 10 s interval (one in all when quick)
    assert 1 <= len(lines) <= 1 + int(elapsed // 10), (elapsed, lines)
    assert "refused PULL from worker 0" in lines[0] and "unknown sparse table 'nope'" in lines[0]
    c.pull({"emb": np.arange(3)}).wait(10)  # the connection is still served


@pytest.mark.parametrize("rank", ["0", 1.5, None, True, 7])
def test_hello_with_a_rank_that_is_not_a_valid_integer_is_refused_naming_it(cluster, rank):
    server, (c0,) = cluster(workers=1)
    reply = send(c0, Kind.HELLO, {"rank": rank, "pid": 1, "host": "h",
                                  "fingerprint": TABLES.fingerprint(), "mode": "async"})
    with pytest.raises(PSConfigError, match=rf"HELLO: worker rank {re.escape(repr(rank))} is not "
                                          r"an integer in \[0, 1\)"):
        reply.wait(10)


@pytest.mark.parametrize("meta, error", [
    ({"threshold": -1}, r"SHRINK: 'threshold' must be null or an int in \[0, 2\*\*24\), got -1"),
    ({"threshold": 2.5}, r"got 2.5"), ({"threshold": True}, r"got True"),
    ({"threshold": "3"}, r"got '3'"),
])
def test_shrink_takes_only_a_valid_threshold(cluster, meta, error):
    server, (c,) = cluster()
    with pytest.raises(RemoteError, match=error):
        send(c, Kind.SHRINK, meta).wait(10)
    reply, = send(c, Kind.SHRINK, {"threshold": None}).wait(10)  # a valid one is answered
    assert reply.meta == {"tables": {"emb": {"removed": 0, "forgotten": 0, "rows": 0}}}
    assert server.stats()["rejected_by_kind"] == {"SHRINK": 1}


@pytest.mark.parametrize("meta, error", [
    ({"mode": 3}, r"SAVE: 'mode' must be one of \(0, 1, 2, 'export'\), got 3"),
    ({"mode": True}, r"got True"), ({"mode": "base"}, r"got 'base'"),
    ({"mode": 2}, r"SAVE: a delta \(mode 2\) needs a base: make a full save"),
])
def test_save_takes_only_its_modes_and_a_delta_only_after_a_base(cluster, tmp_path, meta,
                                                                 error):
    server, (c,) = cluster()
    with pytest.raises(RemoteError, match=error):
        send(c, Kind.SAVE, {"dirname": "ckpt", "save_id": "s1", **meta}).wait(10)
    assert not (tmp_path / "ckpt" / "manifest.json").exists()
    send(c, Kind.SAVE, {"dirname": "ckpt", "save_id": "s2", "mode": 1}).wait(10)
    send(c, Kind.SAVE, {"dirname": "d", "save_id": "s3", "mode": 2}).wait(10)  # now accepted
