"""A bound model of parameter-server throughput and memory; every formula is in docs/scaling.md.

Pure functions of measured inputs (the JSON that ``benchmarks/ps_scaling.py inputs`` writes):
nothing here measures, times or reads a file. A job's samples/s is the smallest of the limits
its resources put on it (a roofline): the workers' own step (compute, PS client, waits), the
hottest server's CPU, the cores all processes share (when they share them), and the network
cards of a worker and of the hottest server (when there is a network). Each limit is in samples
per second of the whole job; the smallest one is the bottleneck, the next one is what a fix for
it would run into.

Example:
    >>> mode = ModeInputs("async", batch=512, worker_cpu_s_per_sample=50e-6,
    ...                   stall_s_per_step=1e-3, server_cpu_s_per_step=2e-3,
    ...                   requests_per_step=2, unique_ids_per_step=3500,
    ...                   sent_bytes_per_sample=8000, received_bytes_per_sample=8000,
    ...                   dense_sent_bytes_per_sample=7700, dense_received_bytes_per_sample=7700,
    ...                   frame_bytes=150)
    >>> costs = Costs(server_request_s=1e-4, client_request_s=5e-5, pull_ids_per_s=25e6,
    ...               push_ids_per_s={"sgd": 16e6, "adam": 5e6})
    >>> round(predict(mode, costs, Cluster(servers=1, workers=2, cores=2)).samples_per_s)
    37101
"""
from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Optional

__all__ = ["ModeInputs", "Costs", "Cluster", "Prediction", "predict", "server_memory",
           "mode_inputs", "costs", "balance_at", "MODES"]

MODES = ("sync", "async", "geo")


@dataclass(frozen=True)
class ModeInputs:
    """What one worker step costs in one training mode, measured with one server and one
    worker (each process on its own core).

    Args:
        mode: ``sync``, ``async`` or ``geo``.
        batch: samples per worker step (B).
        worker_cpu_s_per_sample: the worker process's CPU, all threads, per sample (w).
        stall_s_per_step: a worker's wall time per step minus its CPU time per step (L1): the
            waits on its critical path (a pull's round trip; in sync the whole round).
        server_cpu_s_per_step: the server's CPU per worker step (T1).
        requests_per_step: requests a worker sends per step (q); each goes to every server
            holding part of it, so with S servers each server gets q per worker step.
        unique_ids_per_step: distinct sparse ids per step after the client's de-duplication (u).
        sent_bytes_per_sample, received_bytes_per_sample: a worker's TCP bytes to and from the
            server per sample, everything included (b_out, b_in).
        dense_sent_bytes_per_sample, dense_received_bytes_per_sample: their dense parts (d_out,
            d_in): gradients or deltas of the dense tables and the weights sent back.
        frame_bytes: framing per request (header, descriptors, JSON meta), h.
        rule: the sparse table's rule in the measured job.
    """

    mode: str
    batch: int
    worker_cpu_s_per_sample: float
    stall_s_per_step: float
    server_cpu_s_per_step: float
    requests_per_step: float
    unique_ids_per_step: float
    sent_bytes_per_sample: float
    received_bytes_per_sample: float
    dense_sent_bytes_per_sample: float
    dense_received_bytes_per_sample: float
    frame_bytes: float
    rule: str = "sgd"


@dataclass(frozen=True)
class Costs:
    """Per-request and per-id costs measured apart from any job.

    Args:
        server_request_s: a server's CPU per request carrying one id (c_s): the fixed part.
        client_request_s: a worker's CPU per such request (c_w).
        pull_ids_per_s: one shard's pull rate, C kernels (r_pull).
        push_ids_per_s: one shard's push rate per rule (r_push), e.g. ``{"sgd": .., "adam": ..}``.
    """

    server_request_s: float
    client_request_s: float
    pull_ids_per_s: float
    push_ids_per_s: dict

    def seconds_per_id(self, rule: str) -> float:
        """Kernel time of one id pulled and pushed under ``rule`` (k)."""
        if rule not in self.push_ids_per_s:
            raise ValueError(f"no push rate measured for rule {rule!r}; measured: "
                             f"{', '.join(sorted(self.push_ids_per_s))}")
        return 1.0 / self.pull_ids_per_s + 1.0 / self.push_ids_per_s[rule]


@dataclass(frozen=True)
class Cluster:
    """Where the job runs.

    Args:
        servers, workers: S and W.
        cores: cores that every process of the job shares (C), e.g. 2 on a 2-core machine
            running 4 servers and 2 workers; ``None``: each process has a core of its own.
        bandwidth_bytes_per_s: what one network card carries in each direction (bw); ``None``:
            no network limit (loopback, where moving bytes costs CPU, already in the costs).
        balance: the hottest server's share of the sparse ids over the mean share (kappa, from
            the partition function; 1.0 is perfect balance).
        rtt_s: network round-trip time added to every step's waits.
    """

    servers: int
    workers: int
    cores: Optional[float] = None
    bandwidth_bytes_per_s: Optional[float] = None
    balance: float = 1.0
    rtt_s: float = 0.0


@dataclass
class Prediction:
    """Samples/s of the job, its bottleneck, and the per-step quantities behind them."""

    samples_per_s: float
    bottleneck: str
    limits: dict                 # limit name -> samples/s of the job
    worker_s_per_step: float     # T_w: a worker's CPU per step
    wait_s_per_step: float       # L: its waits per step
    hot_server_s_per_step: float  # T_hot: the hottest server's CPU per worker step
    all_servers_s_per_step: float  # T_all: every server's CPU per worker step
    bytes: dict = field(default_factory=dict)  # per sample: worker out/in, hottest server in/out

    def next_bottleneck(self) -> tuple:
        """(name, samples/s) of the limit met once the bottleneck is lifted (None if none)."""
        rest = sorted((v, k) for k, v in self.limits.items() if k != self.bottleneck)
        return (rest[0][1], rest[0][0]) if rest else (None, None)


def predict(m: ModeInputs, c: Costs, cluster: Cluster, rule: Optional[str] = None) -> Prediction:
    """The job's samples/s: the smallest of its limits (docs/scaling.md, "The model").

    Args:
        m: the mode's measured inputs; c: the measured costs; cluster: the job's shape.
        rule: the sparse rule to predict for (default: the measured one, ``m.rule``).

    Raises:
        ValueError: no servers or workers, or no push rate for ``rule``.
    """
    S, W, B, q = cluster.servers, cluster.workers, m.batch, m.requests_per_step
    if S < 1 or W < 1:
        raise ValueError(f"servers and workers must be >= 1, got {S} and {W}")
    kappa = cluster.balance
    # a worker: its CPU at one server, plus the fixed cost of the S - 1 more requests per step
    t_w = B * m.worker_cpu_s_per_sample + (S - 1) * q * c.client_request_s
    # a server: fixed cost per request, then work that divides over servers; of it, the
    # sparse kernels' part follows the partition's balance and the rule
    variable = max(m.server_cpu_s_per_step - q * c.server_request_s, 0.0)
    kernels_measured = m.unique_ids_per_step * c.seconds_per_id(m.rule)
    kernels = m.unique_ids_per_step * c.seconds_per_id(rule or m.rule)
    rest = max(variable - kernels_measured, 0.0)
    t_hot = q * c.server_request_s + (kappa * kernels + rest) / S
    t_all = S * q * c.server_request_s + kernels + rest
    # (negative when a worker's threads overlapped on two cores: no wait then)
    wait = max(m.stall_s_per_step, 0.0) + cluster.rtt_s
    if m.mode == "sync":  # the server's part of the round is counted apart, below
        wait = max(m.stall_s_per_step - m.server_cpu_s_per_step, 0.0) + cluster.rtt_s
    limits = {"workers": W * B / (t_w + wait), "hottest server CPU": B / t_hot}
    if cluster.cores is not None:
        limits["shared cores"] = cluster.cores * B / (t_w + t_all)
    framing = q * m.frame_bytes / B  # per sample and server, each way
    out, inn = m.sent_bytes_per_sample - framing, m.received_bytes_per_sample - framing
    d_out, d_in = m.dense_sent_bytes_per_sample, m.dense_received_bytes_per_sample
    nbytes = {"worker_out": out + S * framing, "worker_in": inn + S * framing,
              "server_in": (kappa * (out - d_out) + d_out) / S + framing,
              "server_out": (kappa * (inn - d_in) + d_in) / S + framing}
    if cluster.bandwidth_bytes_per_s is not None:
        bw = cluster.bandwidth_bytes_per_s
        limits["a worker's network"] = W * bw / max(nbytes["worker_out"], nbytes["worker_in"])
        limits["hottest server's network"] = bw / max(nbytes["server_in"], nbytes["server_out"])
    bottleneck = min(limits, key=limits.get)
    rate = limits[bottleneck]
    if m.mode == "sync":  # a round: the workers step, then the server applies all W pushes
        serial = 1.0 / (1.0 / limits["workers"] + 1.0 / limits["hottest server CPU"])
        if serial < rate:
            rate = serial
            bottleneck = min(("workers", "hottest server CPU"), key=limits.get)
    return Prediction(rate, bottleneck, limits, t_w, wait, t_hot, t_all, nbytes)


def server_memory(rows: float, servers: int, bytes_per_row: float, row_balance: float,
                  dense_numel: int, dense_width: float, base_bytes: float = 0.0) -> float:
    """Bytes the fullest server holds: its sparse rows, its dense slice with the rule's state,
    and the process's own base.

    Args:
        rows: sparse rows of the whole job; servers: S.
        bytes_per_row: measured per row under the rule (index and growth slack included).
        row_balance: the fullest server's rows over the mean (kappa_rows).
        dense_numel: elements of the dense tables; dense_width: the rule's columns per element
            (1 for SGD, 2 for Adagrad, about 3 for Adam).
        base_bytes: the server process without tables.
    """
    return (rows / servers * row_balance * bytes_per_row
            + 4.0 * dense_numel * dense_width / servers + base_bytes)


# -- reading the inputs JSON -------------------------------------------------------------------
def _pick(section: dict, cls, where: str, **extra):
    names = [f.name for f in fields(cls) if f.name not in extra]
    required = [f.name for f in fields(cls) if f.name not in extra
                and f.default is MISSING and f.default_factory is MISSING]
    missing = [n for n in required if n not in section]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(missing)}; expected keys: "
                         f"{', '.join(names)}")
    return cls(**{n: section[n] for n in names if n in section}, **extra)


def mode_inputs(doc: dict, mode: str) -> ModeInputs:
    """The ``modes[mode]`` section of an inputs JSON as :class:`ModeInputs`.

    Raises:
        ValueError: an unknown mode, a mode not measured, or a missing key (named).
    """
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; valid: {', '.join(MODES)}")
    measured = doc.get("modes", {})
    if mode not in measured:
        raise ValueError(f"mode {mode!r} was not measured; the inputs hold: "
                         f"{', '.join(measured) or 'none'}")
    return _pick(measured[mode], ModeInputs, f"modes.{mode}", mode=mode)


def costs(doc: dict) -> Costs:
    """The ``costs`` section of an inputs JSON as :class:`Costs`."""
    return _pick(doc.get("costs", {}), Costs, "costs")


def balance_at(doc: dict, servers: int, key: str = "ids") -> float:
    """kappa at ``servers`` from the ``balance`` section (measured on the workload's ids).

    Raises:
        ValueError: no figure for that number of servers (the measured ones are named).
    """
    table = doc.get("balance", {})
    if str(servers) not in table:
        raise ValueError(f"no partition balance for {servers} servers; measured for: "
                         f"{', '.join(sorted(table, key=int)) or 'none'} (add it with "
                         f"ps_scaling.py inputs --balance-servers)")
    return float(table[str(servers)][key])
