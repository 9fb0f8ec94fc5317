"""Transport micro-benchmark: fleetx's Link against a pyzmq DEALER/ROUTER pair, same run.

What the parameter server's wire costs per request, apart from the tables: a client sends a
PULL-sized request (``--ids`` int64 ids) and receives the rows (``--ids`` x ``--dim`` float32)
into a preallocated array; or sends a PUSH-sized request (ids + gradients) and receives an empty
reply. The server side echoes through the same shape as ``PSServer``: a receive path, one
handler thread, a reply.

Variants (all over TCP on 127.0.0.1, each on its own fresh connection):

``link``   today's transport: blocking client ``Link`` <-> queued server ``Link`` (writer
           thread) + handler thread, rows received in place (``allocator``);
``old``    the transport before hardening (``fleetx/ps/transport.py`` at ``--old-rev``), when
           git can show it: the same pair with its blocking server sends;
``zmq``    pyzmq: DEALER client, ROUTER server in one thread, the same frame split into
           ZeroMQ message parts (header + meta, then each array zero-copy); the client copies
           the reply rows into the preallocated array, as a Link receives straight into it.

Modes: ``sync`` (one request in flight, latency-bound, what a sync step does per server) and
``pipe`` (``--window`` requests in flight, what the async communicator does). Variants run in
alternation, ``--rounds`` times, ``--requests`` round trips each; printed: one JSON line per
run, then the median requests/s and MB/s per variant and the ratio to ``link``.

Usage (on a quiet machine; needs ``pip install pyzmq`` for the zmq variant):
    python benchmarks/ps_transport.py --rounds 7
    python benchmarks/ps_transport.py --ids 40000 --rounds 5 --requests 300
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import queue
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from fleetx.ps.api import FLAG_REPLY, Kind
from fleetx.ps import transport

ROOT = Path(__file__).resolve().parents[1]


# -- Link pairs ---------------------------------------------------------------------------------
def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    lst = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(lst.getsockname())
    server, _ = lst.accept()
    lst.close()
    return client, server


class LinkPair:
    """A client Link and a server Link whose handler thread answers every request."""

    def __init__(self, module, queued: bool) -> None:
        c_sock, s_sock = _tcp_pair()
        self.replies: queue.Queue = queue.Queue()
        self.target: np.ndarray | None = None
        self.requests: queue.Queue = queue.Queue()
        kw = {"queued": True} if queued else {}
        self.server = module.Link(s_sock, "server", lambda l, m: self.requests.put(m),
                                  lambda l, r: None, 30.0, **kw).start()
        self.client = module.Link(c_sock, "client", lambda l, m: self.replies.put(m),
                                  lambda l, r: None, 30.0,
                                  allocator=lambda m, d: [self.target]).start()
        self.module = module
        threading.Thread(target=self._handle, daemon=True).start()

    def _handle(self) -> None:
        while True:
            msg = self.requests.get()
            if msg is None:
                return
            self.server.send(msg.reply({}, self.answer(msg)))

    def request(self, kind: Kind, bufs: list) -> None:
        self.client.send(self.module.Message(kind, 1, {"sparse": ["emb"]}, bufs))

    def reply(self) -> None:
        self.replies.get(timeout=30)

    def close(self) -> None:
        self.requests.put(None)
        self.client.close()
        self.server.close()


# -- zmq pair -----------------------------------------------------------------------------------
class ZmqPair:
    """DEALER client, ROUTER server thread; frames as multipart messages."""

    def __init__(self, zmq) -> None:
        self.zmq = zmq
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.MAXMSGSIZE, 1 << 30)
        port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.connect(f"tcp://127.0.0.1:{port}")
        self.target: np.ndarray | None = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        poller = self.zmq.Poller()
        poller.register(self.router, self.zmq.POLLIN)
        while not self.stop.is_set():
            if not poller.poll(100):
                continue
            ident, head, *parts = self.router.recv_multipart(copy=False)
            json.loads(bytes(head.buffer[32:]))  # decode the meta, as a Link does
            bufs = [np.frombuffer(p.buffer, np.uint8) for p in parts]
            reply = self.answer_raw(bufs)
            self.router.send_multipart([ident, _head(Kind(head.buffer[5]), reply)] +
                                       [memoryview(r) for r in reply], copy=False)

    def request(self, kind: Kind, bufs: list) -> None:
        self.dealer.send_multipart([_head(kind, bufs, {"sparse": ["emb"]})] +
                                   [memoryview(np.ascontiguousarray(b)) for b in bufs],
                                   copy=False)

    def reply(self) -> None:
        head, *parts = self.dealer.recv_multipart(copy=False)
        if parts:  # into the preallocated target, as a Link receives
            self.target.reshape(-1).view(np.uint8)[:] = np.frombuffer(parts[0].buffer, np.uint8)

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.dealer.close(0)
        self.router.close(0)
        self.ctx.term()


def _head(kind: Kind, bufs: list, meta: dict | None = None) -> bytes:
    from fleetx.ps.api import HEADER, WIRE_MAGIC, WIRE_VERSION
    m = json.dumps(meta or {}).encode()
    return HEADER.pack(WIRE_MAGIC, WIRE_VERSION, int(kind), FLAG_REPLY, 1, len(bufs), len(m),
                       sum(np.asarray(b).nbytes for b in bufs)) + m


# -- the workload -------------------------------------------------------------------------------
def _answers(args):
    rows = np.random.default_rng(0).standard_normal((args.ids, args.dim)).astype(np.float32)

    def answer(kind: Kind, nbufs: int) -> list:
        return [rows] if kind == Kind.PULL else []
    return rows, answer


def run_one(variant: str, mode: str, kind: Kind, args, module_old, zmq) -> dict:
    rows, answer = _answers(args)
    ids = np.arange(args.ids, dtype=np.int64) * 7919
    grads = np.ones((args.ids, args.dim), np.float32)
    bufs = [ids] if kind == Kind.PULL else [ids, grads]
    if variant == "zmq":
        pair = ZmqPair(zmq)
        pair.answer_raw = lambda b: answer(kind, len(b))
    else:
        pair = LinkPair(module_old if variant == "old" else transport, variant == "link")
        pair.answer = lambda m: answer(kind, len(m.bufs))
    pair.target = np.empty_like(rows) if kind == Kind.PULL else None
    window = 1 if mode == "sync" else args.window
    try:
        for _ in range(args.warmup):
            pair.request(kind, bufs)
            pair.reply()
        t0 = time.perf_counter()
        inflight = 0
        for _ in range(args.requests):
            pair.request(kind, bufs)
            inflight += 1
            if inflight == window:
                pair.reply()
                inflight -= 1
        for _ in range(inflight):
            pair.reply()
        dt = time.perf_counter() - t0
    finally:
        pair.close()
    nbytes = sum(b.nbytes for b in bufs) + (rows.nbytes if kind == Kind.PULL else 0)
    return {"variant": variant, "mode": mode, "op": kind.name.lower(), "ids": args.ids,
            "dim": args.dim, "requests_per_s": args.requests / dt,
            "MB_per_s": args.requests * nbytes / dt / 1e6}


def load_old(rev: str):
    """The transport module as it was at ``rev`` (None when git cannot show it)."""
    try:
        text = subprocess.run(["git", "show", f"{rev}:fleetx/ps/transport.py"], cwd=ROOT,
                              capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    path = Path(tempfile.mkdtemp()) / "old_transport.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("old_transport", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ids", type=int, default=6000, help="unique ids per request (ps_ctr: "
                    "~6k per server per step)")
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--window", type=int, default=8, help="requests in flight in pipe mode")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--old-rev", default="a191330", help="git revision of the old transport")
    ap.add_argument("--variants", default="link,old,zmq")
    args = ap.parse_args()
    wanted = args.variants.split(",")
    module_old = load_old(args.old_rev) if "old" in wanted else None
    try:
        import zmq
    except ImportError:
        zmq = None
    variants = [v for v in wanted if (v != "old" or module_old) and (v != "zmq" or zmq)]
    skipped = sorted(set(wanted) - set(variants))
    if skipped:
        print(f"# skipped {skipped}: old transport not in git / pyzmq not installed",
              file=sys.stderr)
    results = []
    for _ in range(args.rounds):
        for mode in ("sync", "pipe"):
            for kind in (Kind.PULL, Kind.PUSH):
                for variant in variants:  # alternate, so drift hits every variant alike
                    r = run_one(variant, mode, kind, args, module_old, zmq)
                    print(json.dumps(r), flush=True)
                    results.append(r)
    print(f"\n# medians over {args.rounds} rounds, {os.cpu_count()} CPUs; ratio to link")
    for mode in ("sync", "pipe"):
        for op in ("pull", "push"):
            base = statistics.median(r["requests_per_s"] for r in results
                                     if (r["variant"], r["mode"], r["op"]) == ("link", mode, op))
            for variant in variants:
                rs = [r for r in results if (r["variant"], r["mode"], r["op"]) ==
                      (variant, mode, op)]
                rate = statistics.median(r["requests_per_s"] for r in rs)
                mbs = statistics.median(r["MB_per_s"] for r in rs)
                print(f"{mode:4} {op:4} {variant:4} {rate:9.0f} req/s {mbs:8.0f} MB/s "
                      f"{rate / base:6.2f}x")


if __name__ == "__main__":
    main()
