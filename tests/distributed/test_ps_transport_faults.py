"""Staying up: nothing a connection does at the transport level stops a parameter server from
serving its real workers. Each fault is made for real with raw sockets against a real server
(in this process, or a subprocess when its memory, threads or file limit are measured); the
real worker sharing 127.0.0.1 with the attacker must still be served."""
import logging
import os
import resource
import signal
import socket
import struct
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from ps_attack import (authed, config, frame, hello, open_files, proc_status,  # noqa: E402
                       raw, read_until_closed, serve, start_server_process, worker)

from fleetx.ps.api import HEADER, WIRE_MAGIC, WIRE_VERSION, Kind  # noqa: E402
from fleetx.ps.handshake import RESPONSE_BYTES, Retry, client_handshake  # noqa: E402

IDS = np.arange(64, dtype=np.int64)


@pytest.fixture
def server():
    made = []

    def make(cfg):
        made.append(serve(cfg))
        return made[-1]
    yield make
    for s, _ in made:
        s.stop()


@pytest.fixture
def process(tmp_path):
    made = []

    def make(cfg, **kw):
        made.append(start_server_process(tmp_path, cfg, **kw))
        return made[-1]
    yield make
    for p, _ in made:
        p.kill()
        p.communicate()


def served(cfg, rank=0):
    """A real worker connects, pulls, pushes and reads its push back."""
    c = worker(cfg, rank)
    try:
        before = c.pull({"emb": IDS}).wait().sparse["emb"].values.copy()
        c.push({"emb": (IDS, np.ones((len(IDS), 8), np.float32))}).wait()
        after = c.pull({"emb": IDS}).wait().sparse["emb"].values
        np.testing.assert_allclose(after, before - 0.5)
        return c.stats().wait()[0]
    finally:
        c.stop()


def reset(sock):
    """Close with SO_LINGER 0: the peer gets a TCP RST instead of a FIN."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def test_connections_reset_before_accept_do_not_stop_the_accept_loop(process):
    p, cfg = process(config(workers=2))
    os.kill(p.pid, signal.SIGSTOP)  # nothing is accepted while the attack happens
    try:
        socks = [raw(cfg) for _ in range(50)]  # the kernel completes them into the backlog
        for s in socks:
            reset(s)
    finally:
        os.kill(p.pid, signal.SIGCONT)
    stats = served(cfg)
    assert stats["connections"]["closed_early"] >= 40, stats["connections"]
    assert p.poll() is None


def test_out_of_file_descriptors_the_server_backs_off_and_a_worker_still_gets_in(process):
    p, cfg = process(config(workers=3), nofile=40)
    base = open_files(p.pid)
    held = [raw(cfg) for _ in range(200)]  # far more than the server may open
    try:
        deadline = time.monotonic() + 30
        while open_files(p.pid) < 40 - 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        t0 = time.monotonic()
        stats = served(cfg)  # while the 200 are still held: strangers are cycled out
        assert time.monotonic() - t0 < 30
    finally:
        for s in held:
            s.close()
    assert stats["connections"]["out_of_descriptors"] >= 1, stats["connections"]
    served(cfg, rank=1)  # and after they are gone
    assert p.poll() is None and open_files(p.pid) <= base + 8
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=30)
    assert "cannot accept connections: Too many open files" in err


def test_a_flood_of_requests_never_read_does_not_delay_a_real_worker(server, caplog):
    """Four authenticated connections send pulls as fast as they can and never read a reply."""
    srv, cfg = server(config(workers=5, dead_after=5.0))
    c = worker(cfg, 0)
    flood = frame(Kind.PULL, {"sparse": ["emb"], "dense": [], "create": True},
                  [np.arange(4096, dtype=np.int64)])
    stop, sent = threading.Event(), []

    def flooder(rank):
        s = authed(cfg)
        s.sendall(hello(rank))
        s.settimeout(1.0)
        n = 0
        try:
            for _ in range(3000):  # bounded; stops early once the server stops reading us
                if stop.is_set():
                    break
                s.sendall(flood)
                n += 1
        except OSError:
            pass
        sent.append((n, s))
    threads = [threading.Thread(target=flooder, args=(r,)) for r in range(1, 5)]
    with caplog.at_level(logging.ERROR, logger="fleetx.ps"):
        for t in threads:
            t.start()
        slowest = 0.0
        for _ in range(30):
            t0 = time.monotonic()
            c.pull({"emb": IDS}).wait(timeout=30)
            slowest = max(slowest, time.monotonic() - t0)
            time.sleep(0.05)
        stop.set()
        for t in threads:
            t.join(timeout=60)
        assert slowest < 5.0, f"a real pull took {slowest:.1f} s during the flood"
        for n, s in sent:
            _, closed = read_until_closed(s, timeout=30)  # the server dropped the flooder
            assert closed and n > 16
            s.close()
    assert any("reads too slowly" in r.message or "reads nothing" in r.message
               for r in caplog.records), [r.message for r in caplog.records]
    c.pull({"emb": IDS}).wait(timeout=10)
    c.stop()


def test_a_huge_length_header_is_refused_before_anything_is_allocated(process):
    p, cfg = process(config(workers=2))
    rss = proc_status(p.pid, "VmRSS")
    huge = HEADER.pack(WIRE_MAGIC, WIRE_VERSION, int(Kind.PUSH), 0, 1, 1, 2, 1 << 40) + \
        struct.pack("<B7xQ", 4, 1 << 40) + b"{}"
    for _ in range(4):
        with authed(cfg) as s:  # even a peer that holds the secret
            s.sendall(huge)
            _, closed = read_until_closed(s)
            assert closed
        with raw(cfg) as s:  # and one that does not never gets that far
            s.sendall(huge.ljust(RESPONSE_BYTES, b"\0"))
            _, closed = read_until_closed(s)
            assert closed
    assert proc_status(p.pid, "VmRSS") - rss < 50 * 1024, "the server's memory jumped"
    stats = served(cfg)
    assert stats["connections"]["auth_failed"] == 4
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=30)
    assert "announces 1099511627776 bytes, more than the limit of 1073741824" in err


def trickle(sock, data, interval, until):
    """Send ``data`` one byte every ``interval`` seconds; the seconds until the peer hung up."""
    t0 = time.monotonic()
    for b in data:
        try:
            sock.send(bytes([b]))
        except OSError:
            return time.monotonic() - t0
        if time.monotonic() - t0 > until:
            break
        time.sleep(interval)
        sock.settimeout(0.01)
        try:
            while sock.recv(65536):  # heartbeats may come first: the close is behind them
                pass
            return time.monotonic() - t0
        except socket.timeout:
            pass
        except OSError:
            return time.monotonic() - t0
    return float("inf")


def test_a_one_byte_trickle_is_cut_at_the_frame_deadline(server, caplog):
    srv, cfg = server(config(workers=1, dead_after=2.0, heartbeat_interval=0.5))
    with caplog.at_level(logging.WARNING, logger="fleetx.ps"):
        with authed(cfg) as s:  # one byte a second: never silent for dead_after
            took = trickle(s, frame(Kind.STATS) * 10, 1.0, until=30)
        assert 1.5 < took < 5, took
        with raw(cfg) as s:  # the handshake has the same limit
            s.recv(64)
            took = trickle(s, b"x" * RESPONSE_BYTES, 1.0, until=30)
        assert 1.5 < took < 5, took
    assert srv.stats()["connections"]["handshake_timeout"] == 1
    served(cfg)


def test_thousands_of_strangers_are_capped_and_a_worker_still_gets_in(process):
    hold_connections(process, 300)


@pytest.mark.slow
def test_3200_strangers_keep_threads_bounded_and_a_worker_still_gets_in(process):
    hold_connections(process, 3200)


def hold_connections(process, count):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < count + 200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, count + 1000), hard))
    p, cfg = process(config(workers=2))
    threads = proc_status(p.pid, "Threads")
    held = []
    try:
        for _ in range(count):
            try:
                held.append(raw(cfg))
            except OSError:  # the backlog is full for a moment: the rest wait their turn
                time.sleep(0.01)
        assert len(held) >= count * 0.9
        assert proc_status(p.pid, "Threads") <= threads
        assert open_files(p.pid) <= 64 + 32  # pending handshakes are capped at 64
        stats = served(cfg)
        assert stats["connections"]["evicted"] >= count - 64 - 10
        assert proc_status(p.pid, "Threads") <= threads + 2  # the worker's link came and went
    finally:
        for s in held:
            s.close()


def test_authenticated_connections_beyond_the_cap_are_closed_at_once(process):
    p, cfg = process(config(workers=2, max_connections=4))
    c = worker(cfg)
    threads = proc_status(p.pid, "Threads")
    kept, busy = [], 0
    host, port = cfg.servers[0].rsplit(":", 1)
    for _ in range(10):
        s = socket.create_connection((host, int(port)), timeout=10)
        try:
            client_handshake(s, cfg.secret.encode(), "server 0", 10)
            kept.append(s)
        except Retry:
            busy += 1
            s.close()
    assert (len(kept), busy) == (3, 7)
    assert proc_status(p.pid, "Threads") <= threads + 2 * 3
    c.pull({"emb": IDS}).wait(timeout=10)  # the worker that was in keeps being served
    for s in kept:
        s.close()
    c.stop()
