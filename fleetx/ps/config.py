"""The cluster's settings: :class:`PSConfig` (servers, workers, mode, liveness, limits,
failover), :class:`CommunicatorConfig` (a worker's sending knobs) and :class:`PSMode`.

Both are frozen dataclasses checked on construction; a wrong value raises
:class:`~fleetx.ps.api.PSConfigError` naming the field. Users import them from
:mod:`fleetx.ps.api`.

What the launcher contract says about them (``FLEETX_PS_*``, ``FLEETX_TIMEOUT``,
``FLEETX_LOG_INTERVAL``, ``TORCHELASTIC_RESTART_COUNT``) is read in one place,
:func:`settings_from_env`, into a :class:`PSSettings`; the servers' and workers' code takes the
values from the :class:`PSConfig` it builds, never from the environment. Where a
:class:`PSConfig` field and a variable mean the same, the field's default is the variable's,
declared in :mod:`fleetx.env`.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, fields
from typing import Any, Mapping, Optional, Sequence

from fleetx import env
from fleetx.ps.errors import require as _require
from fleetx.ps.wire import DEFAULT_MAX_FRAME_BYTES

__all__ = [
    "PSMode", "Mode", "NONFINITE", "TRANSPORTS", "PSConfig", "CommunicatorConfig", "endpoint_of",
    "PSSettings", "settings_from_env",
]


class PSMode(str, enum.Enum):
    """How updates travel (Fleet's ``a_sync`` / ``k_steps``)."""

    SYNC = "sync"    # every step applies the mean of all workers' gradients
    ASYNC = "async"  # gradients are applied on arrival
    GEO = "geo"      # workers train locally and exchange parameter deltas every k steps


# ``fleetx.ps.Mode`` was the name of :class:`PSMode` before ``fleetx.strategy.api.Mode``
# (collective / ps) made it mean two things; kept so that scripts using it go on working.
Mode = PSMode


#: PSConfig.nonfinite choices: refuse a push holding NaN/inf, or skip it and count it
NONFINITE = ("refuse", "skip")
#: PSConfig.transport choices: fleetx's own TCP links, or ZeroMQ (loopback, for comparison only)
TRANSPORTS = ("tcp", "zmq")


@dataclass(frozen=True)
class PSConfig:
    """The cluster and its liveness settings; the same on every server and worker.

    Attributes:
        servers: ``host:port`` of every server, in server-index order.
        num_workers: how many workers take part (sync rounds and barriers wait for all of them).
        mode: sync, async or GEO.
        shard_num: logical shards of the key space; ids hash to a shard, shards map to servers
            in contiguous blocks (see :mod:`fleetx.ps.partition`).
        heartbeat_interval: seconds between heartbeats on an idle connection.
        dead_after: a peer silent for this long (no frame, not even a heartbeat) is dead.
        timeout: seconds to wait for servers to come up and for every worker to register.
        log_interval: seconds between a server's log lines (rows, memory, requests/s).
        max_frame_bytes: the largest frame payload a peer may announce; a larger header ends
            the connection before anything is allocated (``FLEETX_PS_MAX_FRAME_MB``).
        max_connections: authenticated connections a server keeps at once (each costs two
            threads); 0 means ``2 * num_workers + 16``. Further ones are closed at once.
        secret: the job's shared secret (``FLEETX_PS_SECRET``); never printed, never compared
            or serialised with the rest of the config.
        secret_file: a file holding the secret (``FLEETX_PS_SECRET_FILE``), read when a
            connection is made. Neither given: servers bound to loopback accept any local
            process (with a warning); others refuse to start.
        max_lr: the largest learning rate ``SET_LR`` accepts (``FLEETX_PS_MAX_LR``); rates
            must also be finite and > 0.
        max_rows: sparse rows one server may hold per table (``FLEETX_PS_MAX_ROWS``); a request
            that would create more is refused. 0: no limit.
        nonfinite: what a server does with a push holding NaN or inf (``FLEETX_PS_NONFINITE``):
            ``refuse`` answers with an error naming the table; ``skip`` drops that worker's
            push for the step (a sync round counts it as zero), answers normally and counts
            it in STATS (``skipped_pushes``).
        save_root: the folder SAVE requests and checkpoint loads are confined to
            (``FLEETX_PS_SAVE_ROOT``); None: the server's working directory.
        transport: ``tcp`` (fleetx's authenticated links) or ``zmq`` (pyzmq, unauthenticated,
            loopback only: it exists to measure the two against each other,
            :mod:`fleetx.ps.transport_zmq`); ``FLEETX_PS_TRANSPORT``.
        heter_workers: ``host:port`` of every heter worker (``docs/heter.md``). They connect
            to the servers as ranks ``num_workers, num_workers + 1, ...``: their pushes are
            applied on arrival in every mode and they take no part in sync rounds or barriers.
        local_sockets: servers also listen on a Unix-domain socket in a folder only their
            user can enter, and workers and heter workers on the same machine connect to them
            through it (:mod:`fleetx.ps.local`); heter workers themselves listen on TCP only,
            so trainers reach them over TCP. ``FLEETX_PS_LOCAL_SOCKETS`` (1 by default, 0: TCP
            only).
        snapshot_dir: failover is on (``fleetrun --max_restarts``): each server snapshots its
            shard there every ``snapshot_interval`` seconds and a restarted one loads its latest
            (:mod:`fleetx.ps.snapshots`); workers reconnect to a server they lost and resend
            the requests it had not answered (``FLEETX_PS_CHECKPOINT_DIR``). None: a lost
            server is an error naming it.
        snapshot_interval: seconds between a server's snapshots
            (``FLEETX_PS_CHECKPOINT_INTERVAL``).
        snapshot_job: the job's id (``FLEETX_PS_JOB_ID``): only this job's snapshots load.
        restart_count: how many times fleetrun restarted this process
            (``TORCHELASTIC_RESTART_COUNT``; differs between processes).
    """

    servers: tuple
    num_workers: int
    mode: PSMode = PSMode.ASYNC
    shard_num: int = 1000
    heartbeat_interval: float = env.default("FLEETX_PS_HEARTBEAT_INTERVAL")
    dead_after: float = env.default("FLEETX_PS_DEAD_AFTER")
    timeout: float = float(env.default("FLEETX_TIMEOUT"))
    log_interval: float = 60.0
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    max_connections: int = 0
    secret: Optional[str] = field(default=None, repr=False, compare=False)
    secret_file: Optional[str] = None
    max_lr: float = env.default("FLEETX_PS_MAX_LR")
    max_rows: int = env.default("FLEETX_PS_MAX_ROWS")
    nonfinite: str = env.default("FLEETX_PS_NONFINITE")
    save_root: Optional[str] = None
    transport: str = env.default("FLEETX_PS_TRANSPORT")
    heter_workers: tuple = ()
    local_sockets: bool = True
    snapshot_dir: Optional[str] = None
    snapshot_interval: float = env.default("FLEETX_PS_CHECKPOINT_INTERVAL")
    snapshot_job: str = env.default("FLEETX_PS_JOB_ID")
    restart_count: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "servers", tuple(self.servers))
        object.__setattr__(self, "heter_workers", tuple(self.heter_workers))
        object.__setattr__(self, "mode", PSMode(self.mode))
        _require(len(self.servers) > 0, "PSConfig.servers: at least one server endpoint")
        for what, eps in (("servers", self.servers), ("heter_workers", self.heter_workers)):
            for ep in eps:
                host, _, port = str(ep).rpartition(":")
                _require(bool(host) and port.isdigit(),
                         f"PSConfig.{what}: {ep!r} is not host:port")
        _require(self.num_workers > 0, f"PSConfig.num_workers={self.num_workers}: expected > 0")
        _require(self.shard_num >= len(self.servers),
                 f"PSConfig.shard_num={self.shard_num} < number of servers {len(self.servers)}")
        _require(0 < self.heartbeat_interval < self.dead_after,
                 f"PSConfig: need 0 < heartbeat_interval ({self.heartbeat_interval}) < "
                 f"dead_after ({self.dead_after})")
        _require(self.timeout > 0, "PSConfig.timeout must be > 0")
        _require(isinstance(self.max_frame_bytes, int) and self.max_frame_bytes >= 1 << 20,
                 f"PSConfig.max_frame_bytes={self.max_frame_bytes!r}: expected an int >= 1 MiB")
        _require(isinstance(self.max_connections, int) and self.max_connections >= 0,
                 f"PSConfig.max_connections={self.max_connections!r}: expected an int >= 0")
        _require(isinstance(self.max_lr, (int, float)) and math.isfinite(self.max_lr)
                 and self.max_lr > 0, f"PSConfig.max_lr={self.max_lr!r}: expected a finite "
                 "number > 0")
        _require(isinstance(self.max_rows, int) and self.max_rows >= 0,
                 f"PSConfig.max_rows={self.max_rows!r}: expected an int >= 0 (0: no limit)")
        _require(self.nonfinite in NONFINITE, f"PSConfig.nonfinite={self.nonfinite!r}: "
                 f"expected one of {NONFINITE}")
        _require(self.transport in TRANSPORTS, f"PSConfig.transport={self.transport!r}: "
                 f"expected one of {TRANSPORTS}")
        _require(isinstance(self.local_sockets, bool), f"PSConfig.local_sockets="
                 f"{self.local_sockets!r}: expected True or False")
        _require(isinstance(self.snapshot_interval, (int, float)) and
                 math.isfinite(self.snapshot_interval) and self.snapshot_interval > 0,
                 f"PSConfig.snapshot_interval={self.snapshot_interval!r}: expected a finite "
                 "number of seconds > 0")
        _require(isinstance(self.restart_count, int) and self.restart_count >= 0,
                 f"PSConfig.restart_count={self.restart_count!r}: expected an int >= 0")

    @property
    def failover(self) -> bool:
        """Servers snapshot, restarted servers load, workers reconnect."""
        return self.snapshot_dir is not None

    @property
    def num_servers(self) -> int:
        return len(self.servers)

    @property
    def num_heter_workers(self) -> int:
        return len(self.heter_workers)

    @property
    def connection_limit(self) -> int:
        """Authenticated connections a server keeps at once (``max_connections`` or its
        default: every worker and heter worker once, twice over, plus room for tools)."""
        return self.max_connections or 2 * (self.num_workers + self.num_heter_workers) + 16

    def to_dict(self) -> dict:
        """Every field but ``secret`` (a cluster file must not carry it)."""
        return {f.name: (getattr(self, f.name).value if f.name == "mode"
                         else getattr(self, f.name)) for f in fields(self) if f.name != "secret"}


@dataclass(frozen=True)
class CommunicatorConfig:
    """Worker-side sending knobs (Fleet's ``a_sync_configs``; unused keys are ignored).

    Attributes:
        k_steps: GEO: local steps between delta exchanges.
        send_queue_size: async: steps that may wait to be sent before ``step`` blocks.
        max_merge_var_num: async: at most this many queued steps are merged into one push.
        send_wait_times: async: empty polls (1 ms each) the sender waits for more steps to merge.
        thread_pool_size: async: merged pushes that may be in flight at once.
        independent_recv_thread: async: receive the dense weights on a schedule of their own
            (every ``min_send_grad_num_before_recv`` pushes) instead of with every push.
        min_send_grad_num_before_recv: async, with ``independent_recv_thread``: pushes between
            two receptions of the dense weights.
    """

    k_steps: int = 100
    send_queue_size: int = 16
    max_merge_var_num: int = 1
    send_wait_times: int = 1
    thread_pool_size: int = 1
    independent_recv_thread: bool = False
    min_send_grad_num_before_recv: int = 1

    @property
    def recv_every(self) -> int:
        """Async: the dense weights come back with every this-many-th push."""
        return self.min_send_grad_num_before_recv if self.independent_recv_thread else 1

    def __post_init__(self) -> None:
        for f in fields(self):
            if isinstance(f.default, bool):
                _require(isinstance(getattr(self, f.name), bool),
                         f"CommunicatorConfig.{f.name}={getattr(self, f.name)!r}: expected a bool")
                continue
            v, low = getattr(self, f.name), 0 if f.name == "send_wait_times" else 1
            _require(isinstance(v, int) and not isinstance(v, bool) and v >= low,
                     f"CommunicatorConfig.{f.name}={v!r}: expected an int >= {low}")

    @classmethod
    def from_a_sync_configs(cls, configs: Mapping[str, Any]) -> "CommunicatorConfig":
        names = {f.name for f in fields(cls)}
        flags = {f.name for f in fields(cls) if isinstance(f.default, bool)}
        kw = {k: v if k in flags else int(v) for k, v in configs.items() if k in names}
        if kw.get("k_steps", 1) <= 0:
            kw.pop("k_steps")
        return cls(**kw)


def endpoint_of(servers: Sequence[str], index: int) -> tuple[str, int]:
    """``(host, port)`` of server ``index``."""
    host, _, port = servers[index].rpartition(":")
    return host, int(port)


@dataclass(frozen=True)
class PSSettings:
    """The parameter-server settings of the launcher contract, as :func:`settings_from_env`
    read them: every :class:`PSConfig` field but the cluster's shape (servers, workers, mode,
    heter workers), and the workers' progress interval. A field not read keeps
    :class:`PSConfig`'s default.

    Attributes:
        log_interval: ``FLEETX_LOG_INTERVAL``: seconds between progress lines, 0 for none.
        timeout: ``FLEETX_TIMEOUT``.
        heartbeat_interval: ``FLEETX_PS_HEARTBEAT_INTERVAL``.
        dead_after: ``FLEETX_PS_DEAD_AFTER``.
        max_lr / max_rows / nonfinite / save_root: ``FLEETX_PS_MAX_LR``, ``FLEETX_PS_MAX_ROWS``,
            ``FLEETX_PS_NONFINITE``, ``FLEETX_PS_SAVE_ROOT``.
        secret_file / secret: ``FLEETX_PS_SECRET_FILE``, ``FLEETX_PS_SECRET`` (never shown).
        max_frame_bytes: ``FLEETX_PS_MAX_FRAME_MB``, in bytes.
        transport: ``FLEETX_PS_TRANSPORT``.
        local_sockets: ``FLEETX_PS_LOCAL_SOCKETS`` is 1.
        snapshot_dir / snapshot_interval / snapshot_job / restart_count: failover's
            ``FLEETX_PS_CHECKPOINT_DIR`` (None: no failover, and the other three keep
            :class:`PSConfig`'s defaults), ``FLEETX_PS_CHECKPOINT_INTERVAL``,
            ``FLEETX_PS_JOB_ID`` and ``TORCHELASTIC_RESTART_COUNT``.
    """

    log_interval: float = env.default("FLEETX_LOG_INTERVAL")
    timeout: float = PSConfig.timeout
    heartbeat_interval: float = PSConfig.heartbeat_interval
    dead_after: float = PSConfig.dead_after
    max_lr: float = PSConfig.max_lr
    max_rows: int = PSConfig.max_rows
    nonfinite: str = PSConfig.nonfinite
    save_root: Optional[str] = None
    secret_file: Optional[str] = None
    max_frame_bytes: int = PSConfig.max_frame_bytes
    transport: str = PSConfig.transport
    local_sockets: bool = PSConfig.local_sockets
    snapshot_dir: Optional[str] = None
    snapshot_interval: float = PSConfig.snapshot_interval
    snapshot_job: str = PSConfig.snapshot_job
    restart_count: int = 0
    secret: Optional[str] = field(default=None, repr=False, compare=False)

    def config(self, servers: Sequence[str], num_workers: int, mode: Any = PSMode.ASYNC,
               heter_workers: Sequence[str] = ()) -> PSConfig:
        """The cluster of ``servers`` and ``num_workers`` workers with these settings.

        Raises:
            PSConfigError: the values contradict each other.
        """
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "log_interval"}
        # 0 turns the servers' progress lines off: a server logs every log_interval seconds
        interval = self.log_interval if self.log_interval > 0 else math.inf
        return PSConfig(tuple(servers), num_workers, mode=mode, log_interval=interval,
                        heter_workers=tuple(heter_workers), **values)


def settings_from_env(environ: Optional[Mapping[str, str]] = None, *,
                      servers: bool = True) -> PSSettings:
    """The parameter-server settings from the environment (``environ``, the process environment
    by default): the one place they are read. The secret is only named here (checked when a
    connection is made); failover's variables are read only when
    ``FLEETX_PS_CHECKPOINT_DIR`` turns it on.

    Args:
        environ: the mapping to read.
        servers: False for a job without servers (its tables are local): only the progress
            interval is read, since the other settings describe servers and links it does
            not have (``FLEETX_TIMEOUT=0``, which a dataset reads as "no limit", stays valid
            there).

    Raises:
        fleetx.env.EnvError: a variable is malformed: not a number, ``FLEETX_TIMEOUT`` not a
            whole number above 0, ``FLEETX_PS_TRANSPORT`` not one of :data:`TRANSPORTS`, or
            ``FLEETX_PS_LOCAL_SOCKETS`` neither 0 nor 1 (the message names it).

    Example:
        >>> settings_from_env({"FLEETX_PS_TRANSPORT": "zmq"}).transport
        'zmq'
    """
    e = environ
    log_interval = env.get_float("FLEETX_LOG_INTERVAL", env=e)
    if not servers:
        return PSSettings(log_interval=log_interval)
    liveness = {"heartbeat_interval": env.get_float("FLEETX_PS_HEARTBEAT_INTERVAL", env=e),
                "dead_after": env.get_float("FLEETX_PS_DEAD_AFTER", env=e),
                "timeout": env.timeout(e)}
    limits = {"max_lr": env.get_float("FLEETX_PS_MAX_LR", env=e),
              "max_rows": env.get_int("FLEETX_PS_MAX_ROWS", env=e),
              "nonfinite": env.get("FLEETX_PS_NONFINITE", env=e),
              "save_root": env.get("FLEETX_PS_SAVE_ROOT", env=e)}
    return PSSettings(log_interval=log_interval, **liveness, **limits, **_links(e),
                      **_failover(e))


def _links(e: Optional[Mapping[str, str]]) -> dict:
    """The connection settings: transport, same-machine sockets, the secret, the frame limit."""
    transport = env.get("FLEETX_PS_TRANSPORT", env=e)
    if transport not in TRANSPORTS:
        raise env.EnvError(f"environment variable FLEETX_PS_TRANSPORT={transport!r}: expected "
                           f"one of {', '.join(TRANSPORTS)}")
    local = env.get("FLEETX_PS_LOCAL_SOCKETS", env=e)
    if local not in ("0", "1"):
        raise env.EnvError(f"environment variable FLEETX_PS_LOCAL_SOCKETS={local!r}: expected "
                           "1 (same-machine peers connect through a Unix-domain socket) or 0 "
                           "(TCP only)")
    return {"secret": env.get("FLEETX_PS_SECRET", env=e),
            "secret_file": env.get("FLEETX_PS_SECRET_FILE", env=e),
            "max_frame_bytes": int(env.get_float("FLEETX_PS_MAX_FRAME_MB", env=e) * (1 << 20)),
            "transport": transport, "local_sockets": local == "1"}


def _failover(e: Optional[Mapping[str, str]]) -> dict:
    """Failover's settings, which fleetrun writes with ``--max_restarts``; none without it."""
    folder = env.get("FLEETX_PS_CHECKPOINT_DIR", env=e)
    if not folder:
        return {}
    return {"snapshot_dir": folder,
            "snapshot_interval": env.get_float("FLEETX_PS_CHECKPOINT_INTERVAL", env=e),
            "snapshot_job": env.get("FLEETX_PS_JOB_ID", env=e),
            "restart_count": env.get_int("TORCHELASTIC_RESTART_COUNT", env=e)}
