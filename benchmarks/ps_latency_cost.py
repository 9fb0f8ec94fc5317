"""What the client's latency recorder costs per request (``fleetx/ps/latency.py``, timed by
``fleetx/ps/tracker.py``): ``Tracker.register`` + ``Tracker.resolve`` of 20,000 requests with a
kind (timed) and without one (untimed), alternating, best of ``--rounds``; the difference is the
recorder's price (two clock reads, a bucket index, an increment).

    python benchmarks/ps_latency_cost.py [--rounds 7]

Prints one JSON line: ns per request untimed, timed, and their difference.
"""
from __future__ import annotations

import argparse
import json
import time

from fleetx.ps.api import Kind, Message
from fleetx.ps.tracker import Handle, Tracker

N = 20_000


def per_request(kind) -> float:
    """Seconds per register + resolve of one request (``kind`` None: not timed)."""
    tracker, handle = Tracker(), Handle(1)
    replies = [Message(Kind.PULL, i + 1).reply() for i in range(N)]
    start = time.perf_counter()
    for reply in replies:
        tracker.register(handle, 0, 0, None, kind)
        tracker.resolve(reply, "server 0")
    return (time.perf_counter() - start) / N


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    untimed, timed = [], []
    for _ in range(args.rounds):  # alternating: drifts of the machine hit both alike
        untimed.append(per_request(None))
        timed.append(per_request("PULL"))
    a, b = min(untimed) * 1e9, min(timed) * 1e9
    print(json.dumps({"untimed_ns": round(a, 1), "timed_ns": round(b, 1),
                      "cost_ns": round(b - a, 1), "rounds": args.rounds, "requests": N}))


if __name__ == "__main__":
    main()
