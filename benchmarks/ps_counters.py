"""What the processes of a benchmarked parameter-server job count about themselves.

Used by ``benchmarks/ps_ctr.py train`` (every process of a ``run`` job) and summarised in its
``run`` output, for the scaling model of ``docs/scaling.md``:

* a worker, before its first epoch and after each: the wall clock, its process CPU time (all
  threads: training, the communicator's sender, the links' receive threads), the bytes its TCP
  sockets to the servers sent and received (the kernel's counters, as
  ``benchmarks/wire_bytes.py`` reads them: TCP only, so a job that counts bytes runs with
  ``FLEETX_PS_LOCAL_SOCKETS=0``, as ``ps_scaling.py`` does; over same-machine Unix-domain
  sockets they read 0), and the requests it sent per message kind, with
  their payload and framing bytes and the dense tables' part (counted in ``Link.send`` of the
  TCP transport; the ZeroMQ comparison transport is not counted);
* a server: its process CPU time every 50 ms with the wall clock, so that the summary can take
  the servers' CPU inside the workers' warm epochs.

Counting adds one wrapper call per request sent and a reading of ``/proc/self/fd`` per epoch.
The kernel counts bytes once they left the socket's buffer, so a reading may miss the tail of a
request still being written (at most one push, against the hundreds of an epoch).
"""
from __future__ import annotations

import json
import threading
import time
from collections import defaultdict

import numpy as np

from fleetx.ps.api import DESCRIPTOR, HEADER
from wire_bytes import tcp_bytes

REQUESTS = ("PULL", "PUSH")   # the kinds a training step sends


class WorkerProbe:
    """A worker's counters (one per process: it wraps ``Link.send`` of this process).

    Args:
        server_endpoints: ``ip:port`` of every server; only sockets to these ports count.
    """

    def __init__(self, server_endpoints: list) -> None:
        from fleetx.ps.transport import Link
        self.ports = {int(e.rsplit(":", 1)[1]) for e in server_endpoints}
        self.readings: list = []
        self._lock = threading.Lock()
        # kind -> [requests, payload bytes, dense payload bytes, framing bytes]
        self._sent: dict = defaultdict(lambda: [0, 0, 0, 0])
        original = Link.send
        probe = self

        def send(link, msg):
            original(link, msg)
            if not msg.is_reply and msg.kind.name in REQUESTS:
                probe._count(msg)
        Link.send = send

    def _count(self, msg) -> None:
        sizes = [b.nbytes for b in msg.bufs]
        # a PUSH carries its dense slices last, one per table of meta["dense"]
        n_dense = len(msg.meta.get("dense", ())) if msg.kind.name == "PUSH" else 0
        dense = sum(sizes[len(sizes) - n_dense:]) if n_dense else 0
        # the frame's header, descriptors and meta, as wire.encode_frame writes them
        framing = HEADER.size + DESCRIPTOR.size * len(sizes) + len(
            json.dumps(msg.meta, separators=(",", ":")))
        with self._lock:
            c = self._sent[msg.kind.name]
            c[0] += 1
            c[1] += sum(sizes)
            c[2] += dense
            c[3] += framing

    def read(self, _epoch: int = -1) -> None:
        """Take a reading (before training, then as ``train_epochs``' ``on_epoch``)."""
        sent, received, _ = tcp_bytes(set(), only_ports=self.ports)
        with self._lock:
            requests = {k: list(v) for k, v in self._sent.items()}
        self.readings.append({"wall": time.time(), "cpu": time.process_time(), "sent": sent,
                              "received": received, "requests": requests})


class ServerProbe:
    """A server's CPU time, sampled every ``interval`` seconds by a daemon thread."""

    def __init__(self, interval: float = 0.05) -> None:
        self.trace: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True,
                                        name="cpu-probe")
        self._thread.start()

    def _run(self, interval: float) -> None:
        while not self._stop.is_set():
            self.trace.append((time.time(), time.process_time()))
            self._stop.wait(interval)

    def stop(self) -> list:
        self._stop.set()
        self._thread.join()
        self.trace.append((time.time(), time.process_time()))
        return self.trace


def _delta(a: dict, b: dict, kind: str, i: int) -> int:
    return b["requests"].get(kind, [0] * 4)[i] - a["requests"].get(kind, [0] * 4)[i]


def summarize(workers: list, servers: list, batch: int) -> dict:
    """Per-sample and per-step figures over the warm epochs (2.., or the only one).

    Args:
        workers: each worker's record: ``samples`` per epoch and ``probe`` (its readings).
        servers: each server's record: ``cpu_trace`` ``[(wall, cpu), ...]``.
        batch: samples per step.
    """
    tot = defaultdict(float)
    starts, ends = [], []
    for w in workers:
        r = w["probe"]
        first = 1 if len(r) > 2 else 0          # readings: before epoch 1, after each epoch
        a, b = r[first], r[-1]
        epochs = len(r) - 1 - first
        tot["samples"] += w["samples"] * epochs
        tot["steps"] += -(-w["samples"] // batch) * epochs
        tot["cpu"] += b["cpu"] - a["cpu"]
        tot["wall"] += b["wall"] - a["wall"]
        tot["sent"] += b["sent"] - a["sent"]
        tot["received"] += b["received"] - a["received"]
        for kind in REQUESTS:
            tot[kind] += _delta(a, b, kind, 0)
            tot["framing"] += _delta(a, b, kind, 3)
        tot["dense"] += _delta(a, b, "PUSH", 2)
        starts.append(a["wall"])
        ends.append(b["wall"])
    n, steps = tot["samples"], tot["steps"]
    requests = tot["PULL"] + tot["PUSH"]
    out = {"samples": int(n), "steps": int(steps),
           "worker_cpu_s_per_sample": tot["cpu"] / n,
           "stall_s_per_step": (tot["wall"] - tot["cpu"]) / steps,
           "wall_s_per_step": tot["wall"] / steps,
           # None: nothing counted (the ZeroMQ comparison transport is not wrapped)
           "requests_per_step": requests / steps if requests else None,
           "pulls_per_step": tot["PULL"] / steps, "pushes_per_step": tot["PUSH"] / steps,
           "sent_bytes_per_sample": tot["sent"] / n,
           "received_bytes_per_sample": tot["received"] / n,
           # every dense push asks for the same tables' weights back (pull_dense): as many bytes
           "dense_sent_bytes_per_sample": tot["dense"] / n,
           "dense_received_bytes_per_sample": tot["dense"] / n,
           "frame_bytes": tot["framing"] / requests if requests else None}
    if servers:
        per_server = [_cpu_between(s["cpu_trace"], min(starts), max(ends)) for s in servers]
        out["server_cpu_s_per_step"] = sum(per_server) / steps
        out["hottest_server_cpu_s_per_step"] = max(per_server) / steps
    return out


def _cpu_between(trace: list, lo: float, hi: float) -> float:
    """CPU seconds a server's trace ``[(wall, cpu), ...]`` spent between two wall times."""
    wall, cpu = np.asarray(trace, np.float64).T
    return float(np.interp(hi, wall, cpu) - np.interp(lo, wall, cpu))
