"""Fuzzing a real server process: connections with a wrong secret, unauthenticated bytes,
random frames from authenticated but unregistered connections, and, from an authenticated and
registered insider, requests with exactly one invalid field each (shapes, dtypes, table names,
non-finite values, learning rates, save paths). Afterwards the tables are exactly as before,
the server's threads and memory did not grow without bound, every invalid request got an error
reply carrying neither the secret nor the table fingerprint, and a real worker still trains
(its next SGD step lands exactly).

The default run sends 500 frames; the slow stage sends 10,000."""
from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from ps_attack import (DIM, SECRET, TABLES, authed, config, frame, hello, proc_status,  # noqa
                       raw, start_server_process, worker)

from fleetx.ps import AuthError  # noqa: E402
from fleetx.ps.api import DESCRIPTOR, FLAG_ERROR, FLAG_REPLY, HEADER, Kind  # noqa: E402
from fleetx.ps.handshake import CHALLENGE, RESPONSE_BYTES  # noqa: E402

I64, F32 = np.int64, np.float32
NUMEL = 16  # the dense table of ps_attack.TABLES
LR = 0.5


def recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


def recv_frame(sock: socket.socket) -> tuple[int, int, object]:
    """(kind, flags, meta) of the next frame other than a heartbeat; raises EOFError when the
    server closed."""
    while True:
        _, _, kind, flags, _, nbufs, meta_len, total = HEADER.unpack(
            recv_exact(sock, HEADER.size))
        rest = recv_exact(sock, nbufs * DESCRIPTOR.size + meta_len)
        if total:
            recv_exact(sock, total)
        if kind != Kind.HEARTBEAT:
            return kind, flags, json.loads(rest[nbufs * DESCRIPTOR.size:] or b"{}")


# ------------------------------------------------------------------ invalid requests (insider)

def pick(rng, seq):
    """One element of ``seq`` as it is (``rng.choice`` would make numpy scalars of it)."""
    return seq[int(rng.integers(0, len(seq)))]


def _ids(rng, n):
    return rng.integers(-10 ** 6, 10 ** 6, n).astype(I64)


def _push(rng):
    n = int(rng.integers(1, 6))
    return ({"sparse": ["emb"], "dense": ["dense"]},
            [_ids(rng, n), rng.standard_normal(n * DIM).astype(F32),
             rng.standard_normal(NUMEL).astype(F32)])


def _nonfinite(rng, arr):
    arr = arr.copy()
    arr[rng.integers(0, len(arr))] = pick(rng, [np.nan, np.inf, -np.inf])
    return arr


def _mutate_push(rng, kind):
    """A PUSH or INIT with one invalid field (every branch makes it invalid)."""
    meta, bufs = _push(rng)
    which = int(rng.integers(0, 10))
    if which == 0:
        bufs[1] = bufs[1][:-int(rng.integers(1, DIM + 1))]           # too few values
    elif which == 1:
        bufs[1] = np.concatenate([bufs[1], np.ones(int(rng.integers(1, 9)), F32)])
    elif which == 2:
        bufs[0] = bufs[0].astype(pick(rng, [np.float64, np.int32, np.uint8]))
    elif which == 3:
        bufs[1] = bufs[1].astype(np.float64)
    elif which == 4:
        meta["sparse"] = [pick(rng, ["nope", "dense", "", "emb/x", "é" * 300])]
    elif which == 5:
        bufs[1 + int(rng.integers(0, 2))] = _nonfinite(rng, bufs[1 + int(rng.integers(0, 2))])
    elif which == 6:
        bufs[2] = bufs[2][:int(rng.integers(0, NUMEL))]               # wrong dense length
    elif which == 7:
        meta[pick(rng, ["sparse", "dense"])] = pick(rng, ["emb", 5, {"a": 1}, ["emb", 3]])
    elif which == 8:
        bufs = bufs[:int(rng.integers(0, 3))]                        # missing buffers
    else:
        meta["dense"] = ["dense", "dense"]
        bufs.append(bufs[2])
    if which == 5 and not any(not np.isfinite(b).all() for b in bufs[1:]):
        bufs[2] = _nonfinite(rng, bufs[2])
    if kind == Kind.PUSH and rng.random() < 0.2:
        meta["pull_dense"] = ["dense"]
    return meta, bufs


def _invalid_request(rng) -> tuple[int, object, list, int]:
    """(kind, meta, bufs, flags) of a request the server must refuse."""
    which = int(rng.integers(0, 10))
    if which <= 2:
        meta, bufs = _mutate_push(rng, Kind.PUSH)
        return Kind.PUSH, meta, bufs, 0
    if which == 3:
        meta, bufs = _mutate_push(rng, Kind.INIT)
        return Kind.INIT, {**meta, "force": bool(rng.random() < 0.5)}, bufs, 0
    if which == 4:
        bad = [{"sparse": ["nope"]}, {"sparse": ["emb"], "create": "yes"},
               {"sparse": ["emb", "emb"]}, {"dense": ["emb"]}, {"sparse": "emb"}]
        meta = bad[int(rng.integers(0, len(bad)))]
        ids = _ids(rng, 3).astype(pick(rng, [np.int64, np.float64])) if meta.get(
            "sparse") == ["emb"] and "create" not in meta else _ids(rng, 3)
        return Kind.PULL, meta, [ids] * int(rng.integers(0, 3)), 0
    if which == 5:
        lr = pick(rng, [0.0, -1.0, 1e30, 10.0 + float(rng.random()) + 1e-3, "0.1", True, None,
                         float("inf"), float("-inf")])
        meta = {"lr": lr, "tables": None} if rng.random() < 0.8 else \
            {"lr": 0.1, "tables": [pick(rng, ["nope", "", "x" * 999])]}
        return Kind.SET_LR, meta, [], 0
    if which == 6:
        bad = [{"dirname": "../outside", "save_id": "s"}, {"dirname": "/etc", "save_id": "s"},
               {"dirname": "ok", "save_id": "../x"}, {"dirname": 7, "save_id": "s"},
               {"dirname": "ok", "save_id": ""}, {"dirname": "a/../../b", "save_id": "s"},
               {"dirname": "ok"}, {"dirname": "x" * 5000, "save_id": "s"},
               {"dirname": "ok", "save_id": "s", "mode": pick(rng, [3, -1, True, "base", 1.5])},
               {"dirname": "ok", "save_id": "s", "mode": 2}]  # a delta without a base
        return Kind.SAVE, bad[int(rng.integers(0, len(bad)))], [], 0
    if which == 7:
        return Kind.BARRIER, {"name": pick(rng, [5, ["a"], "n" * 201, None])}, [], 0
    if which == 8:
        return Kind.SHRINK, {"threshold": pick(rng, [-1, 1.5, "2", True, 1 << 40, [1]])}, [], 0
    kind = pick(rng, [Kind.PULL, Kind.PUSH, Kind.STATS, Kind.HELLO])
    if kind == Kind.HELLO:  # already registered: refused
        return Kind.HELLO, {"rank": 1}, [], 0
    if rng.random() < 0.5:
        return kind, pick(rng, [[1, 2], "meta", 42]), [], 0  # meta not an object
    return kind, {}, [], FLAG_REPLY  # a "reply" sent as a request


# ------------------------------------------------------------------ random frames (no HELLO)

_KEYS = ["sparse", "dense", "lr", "rank", "name", "dirname", "save_id", "create", "force",
         "tables", "pull_dense", "geo_pull", "fingerprint", "mode", "pid", "threshold"]


def _random_value(rng, depth=0):
    """A random JSON value: numbers of any size, strings, null, booleans, field names, and
    (two levels deep at most) lists and objects of them."""
    pick_ = int(rng.integers(0, 8 if depth < 2 else 6))
    if pick_ == 0:
        return int(rng.integers(-2 ** 63, 2 ** 63 - 1))
    if pick_ == 1:
        return float(rng.standard_normal() * 10.0 ** int(rng.integers(-30, 30)))
    if pick_ == 2:
        return "".join(pick(rng, "ab/.é\\0 ") for _ in range(int(rng.integers(0, 20))))
    if pick_ == 3:
        return pick(rng, [None, True, False])
    if pick_ in (4, 5):
        return pick(rng, _KEYS)
    if pick_ == 6:
        return [_random_value(rng, depth + 1) for _ in range(int(rng.integers(0, 4)))]
    return {pick(rng, _KEYS): _random_value(rng, depth + 1) for _ in range(int(rng.integers(0, 4)))}


def _random_frame(rng) -> tuple[bytes, bool]:
    """(bytes, whether a reply or a close follows at once)."""
    which = int(rng.integers(0, 5))
    if which == 0:  # garbage
        return rng.bytes(int(rng.integers(HEADER.size, 300))), True
    kind = int(rng.integers(0, 256)) if which == 1 else int(pick(rng, list(Kind)))
    meta = {pick(rng, _KEYS): _random_value(rng) for _ in range(int(rng.integers(0, 6)))}
    bufs = [rng.integers(-5, 5, int(rng.integers(0, 8))).astype(pick(rng, 
        [np.int64, np.float32, np.float64, np.uint8, np.int32])) for _ in range(
        int(rng.integers(0, 4)))]
    data = frame(kind, meta, bufs, req_id=int(rng.integers(0, 2 ** 63)))
    if which == 2:  # a damaged header or meta: the server must close, not hang
        data = bytearray(data)
        data[int(rng.integers(4, len(data)))] ^= 0xFF
        return bytes(data), False
    if which == 3:  # a truncated frame, then the connection ends
        return data[:int(rng.integers(1, len(data)))], False
    return data, kind != Kind.HEARTBEAT  # a heartbeat is never answered


# ------------------------------------------------------------------ the run

def snapshot(client, ids):
    rows = client.pull({"emb": ids}, create=False).wait().sparse["emb"].expand().copy()
    dense = client.pull(dense=["dense"]).wait().dense["dense"].copy()
    return rows, dense, client.stats().wait()[0]["rows"]


def fuzz_insider(cfg, rng, n: int, errors: list) -> None:
    sock = authed(cfg)
    sock.settimeout(30)
    sock.sendall(hello(1))
    assert not recv_frame(sock)[1] & FLAG_ERROR
    for i in range(n):
        kind, meta, bufs, flags = _invalid_request(rng)
        data = bytearray(frame(kind, meta, bufs, req_id=i + 2))
        data[6:8] = flags.to_bytes(2, "little")
        sock.sendall(bytes(data))
        r_kind, r_flags, r_meta = recv_frame(sock)
        assert r_flags & FLAG_ERROR and r_kind == kind, (kind, meta, r_meta)
        errors.append(r_meta["message"])
    sock.sendall(frame(Kind.BYE, req_id=n + 2))
    assert not recv_frame(sock)[1] & FLAG_ERROR
    sock.close()


def fuzz_unregistered(cfg, rng, n: int, errors: list) -> None:
    sock = None
    for _ in range(n):
        if sock is None:
            sock = authed(cfg)
            sock.settimeout(10)
        data, answered = _random_frame(rng)
        try:
            sock.sendall(data)
            if not answered:
                raise EOFError
            kind, flags, meta = recv_frame(sock)
            assert flags & FLAG_ERROR, meta  # nothing is served before HELLO
            errors.append(meta["message"])
        except socket.timeout:  # a frame that must be answered or closed was neither
            raise AssertionError("the server neither answered nor closed within 10 s") from None
        except (EOFError, OSError):
            sock.close()
            sock = None


def fuzz_strangers(cfg, rng, n: int) -> None:
    for i in range(n):
        if i % 2:
            with pytest.raises(AuthError):
                authed(cfg, secret="not the secret").close()
        else:  # no handshake at all: bytes (even a whole frame) in place of the answer
            with raw(cfg) as s:
                s.settimeout(10)
                assert len(recv_exact(s, CHALLENGE.size)) == CHALLENGE.size
                s.sendall(rng.bytes(RESPONSE_BYTES) if i % 4 else hello(0).ljust(
                    RESPONSE_BYTES, b"\0"))
                assert s.recv(64) in (b"\x01", b"")  # REJECTED, then closed


def run_fuzz(tmp_path, frames: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    cfg = config(workers=2, mode="async", dead_after=5.0)
    server, cfg = start_server_process(tmp_path, cfg)
    try:
        real = worker(cfg, 0)
        ids = np.arange(-50, 50)
        real.init(dense={"dense": np.arange(NUMEL, dtype=F32)}).wait()
        real.push({"emb": (ids, np.ones((100, DIM), F32))}).wait()
        before = snapshot(real, ids)
        threads, rss = proc_status(server.pid, "Threads"), proc_status(server.pid, "VmRSS")

        strangers = max(10, frames // 50)
        unregistered = int(frames * 0.3)
        errors: list = []
        fuzz_strangers(cfg, rng, strangers)
        fuzz_unregistered(cfg, rng, unregistered, errors)
        fuzz_insider(cfg, rng, frames - strangers - unregistered, errors)

        after = snapshot(real, ids)
        np.testing.assert_array_equal(after[0], before[0])
        np.testing.assert_array_equal(after[1], before[1])
        assert after[2] == before[2]  # not one row created
        stats = real.stats().wait()[0]
        assert stats["rejected"] >= frames - strangers - unregistered, stats
        assert stats["rejected_by_kind"].get("frame", 0) > 0, stats  # malformed frames too
        assert stats["connections"]["auth_failed"] >= strangers, stats["connections"]
        assert proc_status(server.pid, "Threads") <= threads + 8
        assert proc_status(server.pid, "VmRSS") < rss + 200 * 1024  # kB
        fingerprint = TABLES.fingerprint()
        leaks = [m for m in errors if SECRET in m or fingerprint in m]
        assert not leaks, leaks[:3]

        g = np.random.default_rng(1).standard_normal((100, DIM)).astype(F32)
        d = np.random.default_rng(2).standard_normal(NUMEL).astype(F32)
        real.push({"emb": (ids, g)}, {"dense": d}).wait()  # the real worker still trains
        rows, dense, _ = snapshot(real, ids)
        np.testing.assert_allclose(rows, before[0] - LR * g, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(dense, before[1] - LR * d, rtol=1e-6, atol=1e-6)
        real.stop()
        assert server.wait(timeout=30) == 0, server.stderr.read()[-3000:]
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    assert not os.path.exists(tmp_path.parent / "outside")


def test_fuzz_500_frames(tmp_path):
    run_fuzz(tmp_path, 500, seed=0)


@pytest.mark.slow
def test_fuzz_10000_frames(tmp_path):
    run_fuzz(tmp_path, 10_000, seed=1)
