"""The store fleetrun hosts for ``--fault_tolerance heal``, attacked while a real 3-rank job
trains on it: it listens on the job's address only, and garbage, a connection reset, a huge
length, a client that stops half-way through a message and a crowd of idle connections neither
stop it nor the job, which then heals a killed rank as usual (``docs/reliability.md``, healing).

The store is torch's ``TCPStore`` (libuv server). Its protocol: a first message VALIDATE (query
byte 0 and a 32-bit magic number), then queries whose strings are 64-bit lengths and bytes.
"""
from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_fleetrun import fleetrun_cmd, wait_for  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "heal_train.py"
_VALIDATE = struct.pack("<BI", 0, 0x3C85F7CE)
_SET = 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening_addresses(port: int) -> set[str]:
    """Local addresses of the sockets listening on ``port`` (from /proc/net/tcp and tcp6)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, hexport = local.split(":")
            if state == "0A" and int(hexport, 16) == port:
                found.add(addr)
    return found


def _closed_by_server(sock: socket.socket, timeout: float = 10.0) -> bool:
    sock.settimeout(timeout)
    try:
        while sock.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def _attack(port: int) -> list[socket.socket]:
    """Each attack once; returns the connections left open for the rest of the job."""
    addr = ("127.0.0.1", port)
    # garbage of 64 KiB, then gone
    with socket.create_connection(addr) as s:
        s.sendall(os.urandom(64 << 10))
    # a reset in the middle of a message
    s = socket.create_connection(addr)
    s.sendall(_VALIDATE + bytes([_SET]) + b"\x05\x00")
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()
    # a stranger who validates, then claims a key of 2**62 bytes: the server drops it
    s = socket.create_connection(addr)
    s.sendall(_VALIDATE + bytes([_SET]) + struct.pack("<Q", 1 << 62) + b"x" * 64)
    assert _closed_by_server(s), "the store kept a client that announced a 2**62-byte key"
    s.close()
    # a client that stops half-way through a message and never reads, kept open
    held = [socket.create_connection(addr)]
    held[0].sendall(_VALIDATE + bytes([_SET]) + struct.pack("<Q", 100) + b"heal/")
    # a crowd of idle connections, kept open
    held += [socket.create_connection(addr) for _ in range(200)]
    return held


def test_the_heal_store_alone_listens_on_its_address_and_serves_on_after_attacks():
    """The default stage's check: fleetrun's own ``_open_store`` (no job), attacked, then used
    by a torch client as the ranks use it."""
    from datetime import timedelta
    from types import SimpleNamespace

    import torch.distributed as dist

    from fleetx.launch.api import LaunchError
    from fleetx.launch.heal import _HealJob

    port = _free_port()
    job = _HealJob.__new__(_HealJob)  # the store only: no process is started
    job.plan, job.port = SimpleNamespace(master_addr="127.0.0.1"), port
    job._open_store()
    held = []
    try:
        assert _listening_addresses(port) == {"0100007F"}, _listening_addresses(port)
        held = _attack(port)
        client = dist.TCPStore("127.0.0.1", port, is_master=False,
                               timeout=timedelta(seconds=10))
        client.set("heal/probe", "ok")
        assert job.store.get("probe") == b"ok"
    finally:
        for s in held:
            s.close()
    with pytest.raises(LaunchError, match=f"cannot serve the healing job's store at "
                                        f"127.0.0.1:{port}: port {port} is already in use"):
        _HealJob._open_store(job)  # its own port, taken: named


@pytest.mark.slow  # a real 3-rank job, ~30 s; 13 s of steps after the kill to rejoin in
def test_the_heal_store_survives_attacks_and_the_job_still_heals(tmp_path):
    port = _free_port()
    job = subprocess.Popen(
        fleetrun_cmd("--nproc_per_node", 3, "--fault_tolerance", "heal", "--max_restarts", 1,
                     "--master", f"127.0.0.1:{port}", SCRIPT, "--out", "out", "--steps", 60,
                     "--kill", "1:15", "--sleep", "0.3"),
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    held = []
    try:
        out0 = tmp_path / "out.0"
        assert wait_for(lambda: out0.exists() and len(out0.read_text().splitlines()) > 4, 120), \
            "the job did not start training"
        assert _listening_addresses(port) == {"0100007F"}, \
            f"the store listens on {_listening_addresses(port)}, not on 127.0.0.1 only"
        held = _attack(port)
        output, _ = job.communicate(timeout=240)
    finally:
        for s in held:
            s.close()
        if job.poll() is None:
            job.kill()
            job.wait()
    assert job.returncode == 0, output
    assert "rejoined" in output, output
    records = [json.loads(line) for line in out0.read_text().splitlines()]
    steps = [r for r in records if "step" in r]
    assert [r["step"] for r in steps] == list(range(60)), output
    assert len({r["pid"] for r in records}) == 1  # rank 0 was never restarted
    ends = [next(json.loads(line)["w"] for line in (tmp_path / f"out.{s}").read_text()
                 .splitlines() if json.loads(line).get("event") == "end") for s in range(3)]
    assert ends[0] == ends[1] == ends[2]
