"""Bytes each rank sends and receives per step: dense data parallel against DGC at 2, 4, 8 ranks.

DGC shrinks what a rank contributes, but it exchanges its top-k entries with an all-gather, and
an all-gather grows with the number of ranks where an all-reduce does not. Per rank and step,
on a ring (gloo's algorithm for both collectives on CPU):

* dense data parallel: one ring all-reduce of the gradients, ``2(n-1)/n x 4 x numel`` bytes
  sent (a reduce-scatter then an all-gather, each ``n-1`` chunks of ``1/n`` of the buffer);
* DGC after ramp-up: an all-gather of the packet of ``k`` (index, value) pairs, each 4 + 4
  bytes, forwarded ``n-1`` times: ``(n-1) x 8 x k``; plus a ring all-reduce of the parameters too
  small to compress (under 16,384 elements): ``2(n-1)/n x 4 x numel_small``. ``k`` is taken per
  parameter, ``max(1, int(numel x (1 - sparsity)))``.

How bytes are counted: not from that formula, but at the sockets. After the warm-up steps and
again after the counted ones, every rank reads the kernel's TCP counters (``tcpi_bytes_sent``,
``tcpi_bytes_received`` of ``TCP_INFO``) of every connected TCP socket it holds, except those of
the two rendezvous stores, and sums them: that is gloo's whole traffic (payload plus its message
headers) over loopback. Between the readings the ranks synchronise through a separate
``TCPStore``, so no barrier's bytes are counted. :func:`expected_bytes` gives the formula, which
``tests/unit/test_bench_wire_bytes.py`` checks the socket count against.

The model is the Fashion-MNIST CNN of ``examples/fashion_mnist/train.py`` (421,642 parameters:
two of them, 18,432 and 401,408 elements, are compressed; 1,802 elements stay dense), on random
batches; ``--model mlp`` is a 37,892-parameter MLP for quick checks. Bytes do not depend on the
batch or the machine's speed: this counts, it does not time.

    python benchmarks/wire_bytes.py --nproc 2,4,8
    python benchmarks/wire_bytes.py --nproc 2 --model mlp --steps 2     # quick check

Prints one row per world size and case, then one JSON line (every rank's figures).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import struct
import sys
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from ports import free_ports, start_processes

ROOT = Path(__file__).resolve().parents[1]
DGC_FLAGS = {"dgc": True, "dgc_configs": {"rampup_begin_step": 0, "rampup_step": 1,
                                          "sparsity": [0.999]}}
CASES = {"data_parallel": {}, "dgc": DGC_FLAGS}
# struct tcp_info (include/uapi/linux/tcp.h): offsets of its u64 byte counters;
# tcpi_bytes_sent and tcpi_bytes_retrans exist since Linux 4.19 (the struct is then >= 216 bytes).
_TCP_INFO_LEN, _BYTES_RECEIVED, _BYTES_SENT, _BYTES_RETRANS = 232, 128, 200, 208
_TIMEOUT = datetime.timedelta(seconds=600)   # 8 ranks on 2 cores step slowly


def tcp_bytes(skip_ports: set, only_ports: set | None = None) -> tuple[int, int, int]:
    """(bytes sent, bytes received, bytes retransmitted) so far over this process's connected
    TCP sockets, leaving out any whose local or peer port is in ``skip_ports`` and, when
    ``only_ports`` is given, any whose peer port is not in it. Bytes sent count
    each byte once: a retransmission (on an overloaded loopback, a tail-loss probe fired before
    the peer's ACK was scheduled) is counted apart.

    Raises:
        RuntimeError: the kernel's ``TCP_INFO`` has no ``tcpi_bytes_sent`` (Linux < 4.19).
    """
    sent = received = retrans = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(int(name)))
        except OSError:  # closed meanwhile (the listing's own fd, a thread's short-lived one)
            continue
        with sock:  # closes the duplicate only
            if sock.family not in (socket.AF_INET, socket.AF_INET6) \
                    or sock.type != socket.SOCK_STREAM:
                continue
            try:
                peer = sock.getpeername()[1]
            except OSError:  # listening
                continue
            if peer in skip_ports or sock.getsockname()[1] in skip_ports:
                continue
            if only_ports is not None and peer not in only_ports:
                continue
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
            if len(info) < _BYTES_RETRANS + 8:
                raise RuntimeError(f"TCP_INFO is {len(info)} bytes: this kernel lacks "
                                   "tcpi_bytes_sent (Linux >= 4.19 needed)")
            received += struct.unpack_from("=Q", info, _BYTES_RECEIVED)[0]
            again = struct.unpack_from("=Q", info, _BYTES_RETRANS)[0]
            sent += struct.unpack_from("=Q", info, _BYTES_SENT)[0] - again
            retrans += again
    return sent, received, retrans


def ring_all_reduce(n: int, nbytes: float) -> float:
    """Bytes one rank sends in a ring all-reduce of ``nbytes`` over ``n`` ranks."""
    return 2 * (n - 1) / n * nbytes


def ring_all_gather(n: int, nbytes: float) -> float:
    """Bytes one rank sends in a ring all-gather of ``nbytes`` from each of ``n`` ranks."""
    return (n - 1) * nbytes


def expected_bytes(model: nn.Module, n: int, dgc: bool, sparsity: float = 0.999) -> float:
    """The formula: bytes one rank sends per step for ``model``'s gradients over ``n`` ranks.

    Args:
        model: its float32 parameters are the gradients exchanged.
        n: ranks.
        dgc: DGC after ramp-up at ``sparsity`` (else dense data parallel).
    """
    from fleetx.strategy.algorithms.dgc import compressible
    params = [p for p in model.parameters() if p.requires_grad]
    if not dgc:
        return ring_all_reduce(n, 4 * sum(p.numel() for p in params))
    k = sum(max(1, int(p.numel() * (1.0 - sparsity))) for p in params if compressible(p))
    small = sum(p.numel() for p in params if not compressible(p))
    return ring_all_gather(n, 8 * k) + ring_all_reduce(n, 4 * small)


class MLP(nn.Module):
    """32 -> 1024 -> 4: one compressible weight (32,768 elements), 5,124 dense elements."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 1024), nn.Linear(1024, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)))


def make_model(name: str) -> tuple[nn.Module, tuple, int]:
    """(model, one input's shape, classes) of ``--model``."""
    if name == "mlp":
        return MLP(), (32,), 4
    sys.path.insert(0, str(ROOT / "examples" / "fashion_mnist"))
    from train import Net  # examples/fashion_mnist/train.py
    return Net(), (1, 28, 28), 10


class StoreBarrier:
    """A barrier over its own ``TCPStore``, so that waiting moves no byte over gloo's sockets."""

    def __init__(self, rank: int, world: int, port: int) -> None:
        self.store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0,
                                   timeout=_TIMEOUT)
        self.world, self.count = world, 0

    def wait(self) -> None:
        self.count += 1
        key = f"barrier{self.count}"
        if self.store.add(key, 1) == self.world:
            self.store.set(key + "/go", "1")
        self.store.wait([key + "/go"], _TIMEOUT)


def _count_case(fleet, flags: dict, args, barrier: StoreBarrier, skip: set) -> dict:
    model, shape, classes = make_model(args.model)
    torch.manual_seed(0)
    model = fleet.distributed_model(model)
    strategy = fleet.DistributedStrategy()
    for key, value in flags.items():
        setattr(strategy, key, value)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # replacing fleet.init's strategy is the point here
        opt = fleet.distributed_optimizer(
            torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), strategy=strategy)
    g = torch.Generator().manual_seed(fleet.worker_index())
    x, y = torch.randn(args.batch, *shape, generator=g), torch.randint(0, classes, (args.batch,))

    def steps(count: int) -> None:
        for _ in range(count):
            opt.minimize(F.cross_entropy(model(x), y))
    steps(args.warmup)   # DDP rebuilds its buckets after the first step
    barrier.wait()
    before = tcp_bytes(skip)
    steps(args.steps)
    barrier.wait()       # every rank's collectives are complete: all their bytes have moved
    after = tcp_bytes(skip)
    per_step = [(b - a) / args.steps for a, b in zip(before, after)]
    return dict(zip(("sent", "received", "retransmitted"), per_step))


def _rank(rank: int, world: int, ports: tuple, args, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(ports[0]), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    from fleetx import fleet
    fleet.init(is_collective=True)
    barrier = StoreBarrier(rank, world, ports[1])
    result = {name: _count_case(fleet, flags, args, barrier, set(ports))
              for name, flags in CASES.items()}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()  # not the store's: its server (rank 0) must outlive every rank's last wait


def count(world: int, args) -> dict:
    """Spawn ``world`` ranks; per case: every rank's bytes sent and received per step, and the
    formula's bytes sent."""
    with tempfile.TemporaryDirectory(prefix="fleetx_wire_") as out:
        start_processes(_rank, args=(world, tuple(free_ports(2)), args, out),
                           nprocs=world, start_method="spawn")
        ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(world)]
    model = make_model(args.model)[0]
    return {name: {**{key: [r[name][key] for r in ranks]
                      for key in ("sent", "received", "retransmitted")},
                   "formula_sent": expected_bytes(model, world, name == "dgc")}
            for name in CASES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", default="2,4,8", help="comma-separated world sizes")
    parser.add_argument("--model", choices=("cnn", "mlp"), default="cnn")
    parser.add_argument("--steps", type=int, default=3, help="counted steps per case")
    parser.add_argument("--warmup", type=int, default=2, help="steps before counting")
    parser.add_argument("--batch", type=int, default=16,
                        help="per rank (bytes do not depend on it)")
    args = parser.parse_args()
    model = make_model(args.model)[0]
    print(f"model {args.model}: {sum(p.numel() for p in model.parameters()):,} parameters; "
          "bytes per rank per step (max over ranks), counted at the sockets")
    print(f"{'ranks':>5} {'case':>14} {'sent':>12} {'received':>12} {'formula':>12} "
          f"{'sent/formula':>12} {'dense/DGC':>10}")
    results = {}
    for world in (int(w) for w in args.nproc.split(",")):
        results[world] = res = count(world, args)
        for name, r in res.items():
            gain = max(res["data_parallel"]["sent"]) / max(r["sent"])
            print(f"{world:>5} {name:>14} {max(r['sent']):>12,.0f} {max(r['received']):>12,.0f} "
                  f"{r['formula_sent']:>12,.0f} {max(r['sent']) / r['formula_sent']:>12.4f} "
                  f"{gain:>9.1f}x", flush=True)
    print(json.dumps({"bench": "wire_bytes", "model": args.model, "steps": args.steps,
                      "warmup": args.warmup, "results": results}))


if __name__ == "__main__":
    main()
