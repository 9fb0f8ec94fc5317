"""Helpers for attacking a parameter server with raw sockets: servers in this process or in a
subprocess, hand-built frames, authenticated raw connections, and a process's memory and threads.

Nothing here goes through the real client except :func:`worker`, the well-behaved worker whose
service the attacks must not disturb.
"""
from __future__ import annotations

import dataclasses
import json
import os
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from fleetx.ps import (DenseTableSpec, InitConfig, KVClient, PSConfig, PSServer, RuleConfig,
                       SparseTableSpec, Tables)
from fleetx.ps.api import DESCRIPTOR, DTYPE_CODES, HEADER, WIRE_MAGIC, WIRE_VERSION, Kind
from fleetx.ps.handshake import connect

ROOT = Path(__file__).resolve().parents[2]
SECRET = "correct horse battery staple"
DIM = 8
TABLES = Tables((SparseTableSpec("emb", DIM, RuleConfig("sgd", lr=0.5),
                                 InitConfig("constant", value=0.25)),),
                (DenseTableSpec("dense", 16, RuleConfig("sgd", lr=0.5)),))


def config(workers: int = 1, secret: str | None = SECRET, **kw) -> PSConfig:
    """One server on a free loopback port (port 0), short liveness settings."""
    kw = {"servers": ["127.0.0.1:0"], "heartbeat_interval": 0.3, "dead_after": 3.0,
          "timeout": 300.0, **kw}
    return PSConfig(num_workers=workers, secret=secret, **kw)


def serve(cfg: PSConfig) -> tuple[PSServer, PSConfig]:
    """A started in-process server, and the config with its real endpoint."""
    server = PSServer(cfg, 0, TABLES).start()
    return server, dataclasses.replace(cfg, servers=(server.endpoint,))


@pytest.fixture
def server():
    """``server(cfg=None) -> (PSServer, its config)``: servers in this process, stopped after."""
    made = []

    def make(cfg=None):
        made.append(serve(cfg or config()))
        return made[-1]
    yield make
    for s, _ in made:
        s.stop()


def worker(cfg: PSConfig, rank: int = 0) -> KVClient:
    c = KVClient(cfg, rank, TABLES)
    c.start()
    return c


def host_port(cfg: PSConfig) -> tuple[str, int]:
    host, _, port = cfg.servers[0].rpartition(":")
    return host, int(port)


def frame(kind: int, meta: dict | None = None, bufs=(), req_id: int = 1,
          total: int | None = None) -> bytes:
    """A frame built byte by byte from the wire specification; ``total`` may lie."""
    meta_b = json.dumps(meta or {}).encode()
    arrays = [np.ascontiguousarray(b) for b in bufs]
    size = sum(a.nbytes for a in arrays) if total is None else total
    head = HEADER.pack(WIRE_MAGIC, WIRE_VERSION, int(kind), 0, req_id, len(arrays), len(meta_b),
                       size)
    descs = b"".join(DESCRIPTOR.pack(DTYPE_CODES[a.dtype.str], a.nbytes) for a in arrays)
    return head + descs + meta_b + b"".join(a.tobytes() for a in arrays)


def hello(rank: int, tables: Tables = TABLES, mode: str = "async") -> bytes:
    return frame(Kind.HELLO, {"rank": rank, "pid": os.getpid(), "host": "attacker",
                              "fingerprint": tables.fingerprint(), "mode": mode})


def authed(cfg: PSConfig, secret: str = SECRET) -> socket.socket:
    """A raw socket that passed the handshake (an attacker who holds the secret, or any local
    process when the server has none)."""
    host, port = host_port(cfg)
    return connect(host, port, "server 0", 10.0, secret.encode())


def raw(cfg: PSConfig) -> socket.socket:
    """A plain TCP connection to the server, no handshake."""
    return socket.create_connection(host_port(cfg), timeout=10)


def read_until_closed(sock: socket.socket, timeout: float = 10.0) -> tuple[bytes, bool]:
    """Everything the peer sends until it closes (True) or ``timeout`` passes (False)."""
    sock.settimeout(0.2)
    data, deadline = b"", time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except socket.timeout:
            continue
        except ConnectionResetError:
            return data, True
        if not chunk:
            return data, True
        data += chunk
    return data, False


def start_server_process(tmp_path: Path, cfg: PSConfig, nofile: int | None = None,
                         secret: str | None = SECRET) -> tuple[subprocess.Popen, PSConfig]:
    """``python -m fleetx.ps serve`` with ``cfg`` (secret through the environment), optionally
    with at most ``nofile`` open files; returns the process and the config with its endpoint."""
    cluster = tmp_path / "cluster.json"
    cluster.write_text(json.dumps({"config": cfg.to_dict(), "tables": json.loads(
        TABLES.to_json())}))
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env.pop("FLEETX_PS_SECRET_FILE", None)
    if secret:
        env["FLEETX_PS_SECRET"] = secret
    else:
        env.pop("FLEETX_PS_SECRET", None)

    def limit():
        if nofile:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
    p = subprocess.Popen([sys.executable, "-m", "fleetx.ps", "serve", "--cluster", str(cluster),
                          "--index", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env, cwd=tmp_path, preexec_fn=limit)
    line = p.stdout.readline()
    if not line.startswith("listening"):
        p.kill()
        raise RuntimeError(f"server did not start: {line}{p.stderr.read()}")
    return p, dataclasses.replace(cfg, servers=(line.split()[1],))


def proc_status(pid: int, field: str) -> int:
    """A number from /proc/<pid>/status: ``VmRSS`` (kB), ``Threads``..."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))
