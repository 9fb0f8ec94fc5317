"""Same-machine links: a worker on the server's machine connects through a Unix-domain socket in
a folder only its user can enter, with the same handshake as over TCP; strangers on that socket
get nothing; an unsafe folder or FLEETX_PS_LOCAL_SOCKETS=0 means TCP only.

Real servers (threads of this process) and raw sockets."""
import dataclasses
import logging
import os
import re
import shutil
import socket
import stat
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from ps_attack import config, frame, hello, read_until_closed, serve, server, worker  # noqa: E402

from fleetx.ps import AuthError, local  # noqa: E402
from fleetx.ps.handshake import CHALLENGE, REJECTED, RESPONSE_BYTES  # noqa: E402


@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    """The sockets' folder under a temporary directory of this test's own, short enough for a
    socket path (pytest's own, under a parallel run's worker folder, can pass 100 bytes).
    ``tmp_path`` is made first, while pytest still finds its base folder."""
    short = tempfile.mkdtemp(prefix="fx")
    monkeypatch.setattr(tempfile, "gettempdir", lambda: short)
    yield Path(short) / f"fleetx-ps-{os.geteuid()}"
    shutil.rmtree(short, ignore_errors=True)


def family(client) -> int:
    return client._links[0].sock.family


def test_a_worker_on_the_same_machine_uses_the_private_socket(server, private_tmp):
    srv, cfg = server()
    port = int(cfg.servers[0].rpartition(":")[2])
    path = private_tmp / f"127.0.0.1-{port}.sock"
    assert stat.S_IMODE(private_tmp.stat().st_mode) == 0o700
    assert stat.S_ISSOCK(path.stat().st_mode) and stat.S_IMODE(path.stat().st_mode) == 0o600
    c = worker(cfg)
    assert family(c) == socket.AF_UNIX
    assert c.pull({"emb": np.arange(3)}).wait().sparse["emb"].values.shape == (3, 8)
    c.push({"emb": (np.arange(3), np.ones((3, 8), np.float32))}, {"dense": np.ones(16)},
           pull_dense=["dense"]).wait()
    c.stop()
    srv.stop()
    assert not path.exists()  # removed with the server


def test_tcp_only_when_turned_off(server, private_tmp):
    srv, cfg = server(config(workers=2, local_sockets=False))
    c = worker(cfg)
    assert family(c) == socket.AF_INET and not list(private_tmp.glob("*.sock"))
    # a worker that wants the socket falls back to TCP when the server has none
    d = worker(dataclasses.replace(cfg, local_sockets=True), rank=1)
    assert family(d) == socket.AF_INET
    c.stop()
    d.stop()


@pytest.mark.parametrize("unsafe, why", [
    ("open to others", r"has mode 0755, open to other users \(expected 0700\)"),
    ("a link", "is a symbolic link, not a directory"), ("a file", "is not a directory")])
def test_an_unsafe_folder_means_tcp_only(server, private_tmp, tmp_path, unsafe, why, caplog):
    if unsafe == "open to others":
        private_tmp.mkdir(mode=0o755)
        os.chmod(private_tmp, 0o755)
    elif unsafe == "a link":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        private_tmp.symlink_to(tmp_path / "elsewhere")
    else:
        private_tmp.write_text("")
    assert local.socket_dir() is None
    with caplog.at_level(logging.INFO, logger="fleetx.ps"):
        srv, cfg = server()
    assert srv._acceptor.local_sock is None
    assert re.search(rf"no same-machine socket: {re.escape(str(private_tmp))} {why}; TCP only",
                     caplog.text), caplog.text
    c = worker(cfg)
    assert family(c) == socket.AF_INET
    c.stop()


def test_a_file_left_by_a_dead_server_is_replaced(server, private_tmp):
    srv, cfg = server(config(local_sockets=False))
    port = int(cfg.servers[0].rpartition(":")[2])
    srv.stop()  # its port is free again; a dead server of that port left its socket file
    private_tmp.mkdir(mode=0o700, exist_ok=True)
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(private_tmp / f"127.0.0.1-{port}.sock"))
    stale.close()
    srv, cfg = server(config(servers=[f"127.0.0.1:{port}"]))
    c = worker(cfg)
    assert family(c) == socket.AF_UNIX
    c.stop()


def test_a_stranger_on_the_private_socket_gets_nothing(server, private_tmp):
    srv, cfg = server(config(workers=1))
    port = int(cfg.servers[0].rpartition(":")[2])
    path = str(private_tmp / f"127.0.0.1-{port}.sock")
    for attack in (hello(0), frame(1, {"x": 1}), os.urandom(200), b""):
        s = socket.socket(socket.AF_UNIX)
        s.connect(path)
        s.settimeout(10)
        assert s.recv(CHALLENGE.size, socket.MSG_WAITALL)[:4] == b"FXPA"
        s.sendall(attack.ljust(RESPONSE_BYTES, b"\0")[:max(RESPONSE_BYTES, len(attack))])
        data, closed = read_until_closed(s)
        s.close()
        assert closed and data == REJECTED, data
    with pytest.raises(AuthError, match="rejected this process's secret"):
        worker(dataclasses.replace(cfg, secret="another secret"))
    counters = srv.stats()["connections"]
    assert counters["auth_failed"] == 5 and srv.stats()["requests"] == 0
    c = worker(cfg)  # the job's own worker is still served
    assert family(c) == socket.AF_UNIX
    c.stop()


@pytest.mark.parametrize("host, here", [("127.0.0.1", True), ("localhost", True),
                                        ("192.0.2.7", False), ("no-such-host.invalid", False)])
def test_what_counts_as_this_machine(host, here):
    assert local.is_local_host(host) is here


def test_an_address_of_this_machine_counts_as_local():
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("192.0.2.1", 9))  # picks a route; sends nothing
        mine = probe.getsockname()[0]
    except OSError:
        pytest.skip("no non-loopback IPv4 route on this machine")
    finally:
        probe.close()
    assert local.is_local_host(mine)


def test_a_path_too_long_for_a_socket_is_not_used(monkeypatch, tmp_path, caplog):
    deep = tmp_path / ("d" * 120)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(deep))
    assert local.socket_path("127.0.0.1", 6000) is None
    with caplog.at_level(logging.INFO, logger="fleetx.ps"):
        assert local.listen("127.0.0.1", 6000, 8) is None
    assert re.search(r"port 6000: no same-machine socket: the path .*127\.0\.0\.1-6000\.sock is "
                     r"\d+ bytes, longer than a socket's 100; TCP only", caplog.text), caplog.text


def test_two_servers_on_one_port_at_two_addresses_keep_their_own_sockets(server, private_tmp):
    """Two network namespaces sharing a file system (or two interfaces of one host) may run a
    server each on the same port: each worker reaches its own server."""
    a, cfg_a = server(config(workers=1))
    port = int(cfg_a.servers[0].rpartition(":")[2])
    try:
        b, cfg_b = server(config(workers=1, servers=[f"127.0.0.2:{port}"]))
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"cannot listen on 127.0.0.2:{port} here: {e}")
    assert sorted(p.name for p in private_tmp.glob("*.sock")) == sorted(
        [f"127.0.0.1-{port}.sock", f"127.0.0.2-{port}.sock"])
    ca, cb = worker(cfg_a), worker(cfg_b)
    assert family(ca) == family(cb) == socket.AF_UNIX
    ca.push({"emb": (np.arange(2), np.ones((2, 8), np.float32))}).wait()
    assert a.stats()["requests"] >= 2 and b.stats()["requests"] == 1  # b: only its HELLO
    ca.stop()
    cb.stop()
