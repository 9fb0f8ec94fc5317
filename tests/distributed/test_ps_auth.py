"""Letting nobody in: every connection to a parameter server proves it holds the job's secret
before a single frame reaches the server, and the server proves it to the worker too.

Real servers (threads of this process) and raw sockets; the attacker knows the wire protocol
but not the secret."""
import dataclasses
import logging
import os
import socket
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from ps_attack import (SECRET, TABLES, authed, config, frame, hello, raw,  # noqa: E402
                       read_until_closed, serve, server, worker)

from fleetx.ps import AuthError, PSConfigError, PSServer  # noqa: E402
from fleetx.ps import handshake  # noqa: E402
from fleetx.ps.api import Kind  # noqa: E402
from fleetx.ps.handshake import (CHALLENGE, OK, REJECTED, RESPONSE_BYTES,  # noqa: E402
                                 client_handshake)


def rejected(sock: socket.socket, answer: bytes) -> bytes:
    """Answer the challenge with ``answer``; what the server says before it closes."""
    challenge = sock.recv(CHALLENGE.size, socket.MSG_WAITALL)
    assert len(challenge) == CHALLENGE.size and challenge[:4] == b"FXPA"
    sock.sendall(answer)
    data, closed = read_until_closed(sock)
    assert closed, "the server kept an unauthenticated connection open"
    return data


def test_a_worker_with_the_secret_trains_and_wrong_or_missing_secrets_are_refused(server):
    srv, cfg = server()
    c = worker(cfg)
    assert c.pull({"emb": np.arange(3)}).wait().sparse["emb"].values.shape == (3, 8)
    for secret in ("another secret", None):
        with pytest.raises(AuthError) as err:
            worker(dataclasses.replace(cfg, secret=secret), rank=0)
        text = str(err.value)
        assert f"server 0 ({cfg.servers[0]}) rejected this process's secret" in text
        assert "--ps_secret_file" in text and SECRET not in text
    assert srv.stats()["connections"]["auth_failed"] == 2
    c.stop()


def test_a_stranger_who_knows_the_protocol_gets_nothing_and_changes_nothing(server, tmp_path):
    srv, cfg = server(config(workers=1))
    target = tmp_path / "stolen"
    attacks = [hello(0), frame(Kind.INIT, {"sparse": ["emb"], "dense": [], "force": True},
                               [np.arange(2), np.full((2, 8), 9e9, np.float32)]),
               frame(Kind.SET_LR, {"lr": 1e30, "tables": None}), frame(Kind.STATS),
               frame(Kind.SAVE, {"dirname": str(target), "save_id": "x"})]
    for attack in attacks:
        # frames sent straight away: the server reads them as a (wrong) handshake answer
        with raw(cfg) as s:
            s.sendall(attack.ljust(RESPONSE_BYTES, b"\0"))
            data, closed = read_until_closed(s)
            assert closed and data[CHALLENGE.size:] == REJECTED, data
        # frames after a wrong answer to the challenge: the connection is already closed
        with raw(cfg) as s:
            assert rejected(s, os.urandom(RESPONSE_BYTES)) == REJECTED
    assert srv.stats()["requests"] == 0
    c = worker(cfg, rank=0)  # the rank a stranger tried to take is free
    rows = c.pull({"emb": np.arange(2)}).wait().sparse["emb"].values
    np.testing.assert_array_equal(rows, 0.25)  # no INIT reached the table
    c.push({"emb": (np.arange(2), np.ones((2, 8), np.float32))}).wait()
    np.testing.assert_allclose(c.pull({"emb": np.arange(2)}).wait().sparse["emb"].values,
                               0.25 - 0.5)  # lr 0.5 still: no SET_LR reached the rule
    assert not target.exists()
    assert srv.stats()["connections"]["auth_failed"] == 2 * len(attacks)
    c.stop()


def test_a_recorded_handshake_cannot_be_replayed(server):
    """Record a real worker's answer (to a challenge we sent), replay it to the server."""
    srv, cfg = server()
    fake = socket.create_server(("127.0.0.1", 0))
    recorded = {}

    def fake_server():
        conn, _ = fake.accept()
        conn.sendall(CHALLENGE.pack(b"FXPA", 1, os.urandom(32)))
        recorded["answer"] = conn.recv(RESPONSE_BYTES, socket.MSG_WAITALL)
        conn.sendall(REJECTED)
        conn.close()
    t = threading.Thread(target=fake_server)
    t.start()
    with socket.create_connection(fake.getsockname()) as s, pytest.raises(AuthError):
        client_handshake(s, SECRET.encode(), "fake", 5.0)
    t.join()
    fake.close()
    assert len(recorded["answer"]) == RESPONSE_BYTES
    with raw(cfg) as s:
        assert rejected(s, recorded["answer"]) == REJECTED
    assert srv.stats()["connections"]["auth_failed"] == 1


def test_the_worker_checks_the_server_too():
    """A program on the server's port that does not hold the secret cannot pass as the server,
    even if it answers OK."""
    fake = socket.create_server(("127.0.0.1", 0))

    def fake_server():
        conn, _ = fake.accept()
        conn.sendall(CHALLENGE.pack(b"FXPA", 1, os.urandom(32)))
        conn.recv(RESPONSE_BYTES, socket.MSG_WAITALL)
        conn.sendall(OK + os.urandom(32))
        conn.recv(1)
        conn.close()
    threading.Thread(target=fake_server, daemon=True).start()
    cfg = config(servers=(f"127.0.0.1:{fake.getsockname()[1]}",))
    with pytest.raises(AuthError, match=r"server 0 \(127.0.0.1:\d+\) did not prove that it "
                                        r"holds the job's secret"):
        worker(cfg)
    fake.close()


def test_without_a_secret_loopback_servers_warn_once_and_others_refuse_to_start(server, caplog,
                                                                              monkeypatch):
    monkeypatch.setattr(handshake, "_warned", threading.Event())  # as in a fresh process
    with caplog.at_level(logging.WARNING, logger="fleetx.ps"):
        _, cfg = server(config(secret=None))
        server(config(secret=None))
        c = worker(cfg)  # no secret on either side: any local process may connect
        c.stop()
    warnings = [r.message for r in caplog.records if "no shared secret" in r.message]
    assert len(warnings) == 1 and "any process on this machine may connect" in warnings[0]
    with pytest.raises(AuthError, match="rejected this process's secret"):
        worker(dataclasses.replace(cfg, secret=SECRET))  # nor does the secret match nothing
    everywhere = config(secret=None, servers=("0.0.0.0:0",))
    with pytest.raises(PSConfigError, match="refusing to listen on 0.0.0.0, which is not a "
                                          "loopback address, without a shared secret: set "
                                          "FLEETX_PS_SECRET or FLEETX_PS_SECRET_FILE"):
        PSServer(everywhere, 0, TABLES).start()


def test_a_secret_file_is_read_when_connecting_and_a_missing_one_is_named(server, tmp_path):
    path = tmp_path / "secret"
    cfg = config(secret=None, secret_file=str(path))  # no error yet: nothing connects
    with pytest.raises(PSConfigError, match=f"FLEETX_PS_SECRET_FILE={path}: cannot read"):
        server(cfg)
    path.write_text(f"  {SECRET}\n")
    _, cfg = server(cfg)
    c = worker(dataclasses.replace(cfg, secret=SECRET, secret_file=None))
    c.stop()
    path.write_text("\n")
    with pytest.raises(PSConfigError, match="the file is empty"):
        worker(cfg)


def test_error_replies_carry_no_fingerprint(server):
    _, cfg = server()
    other = TABLES.__class__(TABLES.sparse, ())
    with authed(cfg) as s:
        s.sendall(hello(0, other))
        data, _ = read_until_closed(s, timeout=2)
    assert b"another table layout" in data
    assert TABLES.fingerprint().encode() not in data and other.fingerprint().encode() not in data


def test_failed_handshakes_are_counted_and_logged_at_a_limited_rate(server, caplog):
    srv, cfg = server()
    with caplog.at_level(logging.WARNING, logger="fleetx.ps"):
        for _ in range(30):
            with raw(cfg) as s:
                rejected(s, b"\0" * RESPONSE_BYTES)
    assert srv.stats()["connections"]["auth_failed"] == 30
    assert len([r for r in caplog.records if "failed authentication" in r.message]) == 1
    c = worker(cfg)  # and the real worker is not held up by any of it
    c.stop()
