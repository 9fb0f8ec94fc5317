"""The parameter-server contract: wire format, message kinds, table and rule specs, errors.

Every other module of :mod:`fleetx.ps` imports its shared vocabulary from here and nothing
from its siblings' internals. The byte-level wire format is specified in
``docs/parameter_server.md``; the constants below are that specification in code.

A frame on the wire is::

    header (32 bytes, little-endian, HEADER)
    nbufs descriptors (16 bytes each, DESCRIPTOR): dtype code, byte count
    meta: meta_len bytes of UTF-8 JSON (an object; the small control fields)
    nbufs raw buffers, back to back, in descriptor order (ids, rows, gradients...)

Nothing on the wire is pickled: the meta block is JSON and the payload is raw little-endian
arrays, so a peer can never make us execute code.
"""
from __future__ import annotations

import enum
import hashlib
import json
import math
import struct
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Mapping, Optional, Sequence

__all__ = [
    "WIRE_MAGIC", "WIRE_VERSION", "HEADER", "DESCRIPTOR", "FLAG_REPLY", "FLAG_ERROR",
    "MAX_META_BYTES", "MAX_BUFFERS", "Kind", "DTYPES", "DTYPE_CODES", "PSMode",
    "PSError", "PSConfigError", "ConfigError", "ProtocolError", "PeerLostError", "RemoteError",
    "PSTimeoutError",
    "StateError", "AuthError", "RequestError", "NONFINITE", "DEFAULT_MAX_FRAME_BYTES",
    "TRANSPORTS", "RuleConfig", "InitConfig", "CountFilterEntry", "ProbabilityEntry",
    "ShowClickEntry", "AccessorConfig", "DEFAULT_MAX_PENDING", "SparseTableSpec",
    "DenseTableSpec", "Tables", "PSConfig", "CommunicatorConfig",
]

# --------------------------------------------------------------------------------------------
# Wire format
# --------------------------------------------------------------------------------------------

WIRE_MAGIC = b"FXPS"
WIRE_VERSION = 1
#: magic(4s) version(B) kind(B) flags(H) request id(Q) nbufs(I) meta_len(I) payload bytes(Q)
HEADER = struct.Struct("<4sBBHQIIQ")
#: dtype code(B), 7 pad bytes, byte count(Q)
DESCRIPTOR = struct.Struct("<B7xQ")
FLAG_REPLY = 0x1  # the frame answers the request with the same id
FLAG_ERROR = 0x2  # a reply whose meta carries {"error": class name, "message": text}
MAX_META_BYTES = 1 << 20  # a larger meta block means a corrupt or hostile frame
MAX_BUFFERS = 1 << 16
#: Largest frame (payload bytes) a peer may announce; checked on the header, before anything is
#: allocated. 1 GiB holds a dense table of 256 M float32 values per server in one INIT or PUSH,
#: far beyond a CTR model's dense part, while a corrupt header (up to 16 EiB) is refused at once.
DEFAULT_MAX_FRAME_BYTES = 1 << 30

assert HEADER.size == 32 and DESCRIPTOR.size == 16


class Kind(enum.IntEnum):
    """Message kinds. Requests carry the kind; the reply repeats it with FLAG_REPLY set."""

    HEARTBEAT = 1  # no reply; any frame proves liveness, this one is sent when idle
    HELLO = 2      # worker -> server: {"rank", "pid", "host", "fingerprint"}
    BYE = 3        # worker -> server: the worker stops cleanly
    PULL = 4       # read rows of sparse tables and/or dense slices
    PUSH = 5       # gradients (or GEO deltas) for sparse tables and/or dense slices
    INIT = 6       # worker 0 assigns initial values (ignored where the server loaded a save)
    SET_LR = 7     # change the learning rate of one or every table's rule
    BARRIER = 8    # answered once every live worker has entered the same barrier
    SAVE = 9       # each server writes its shards to a folder
    STATS = 10     # rows, bytes and request counts of a server
    SHRINK = 20    # end of a pass: decay show/click, delete rows unseen or scoring too low
    # 30-39: inference and heter workers (docs/ps_inference.md, docs/heter.md)
    INFER = 30           # worker -> server: it turned to inference; its writes are refused
    HETER_HELLO = 31     # trainer -> heter worker: {"rank", "pid", "host", "fingerprint", "mode"}
    HETER_FORWARD = 32   # trainer -> heter worker: a section's inputs; reply: its outputs
    HETER_BACKWARD = 33  # trainer -> heter worker: the outputs' gradients; reply: the inputs'
    HETER_STEP = 34      # trainer -> heter worker: the trainer's optimizer step is done
    HETER_BYE = 35       # trainer -> heter worker: the trainer stops or turns to inference
    HETER_FLUSH = 36     # trainer -> heter worker: answered once its queued steps reached the servers


#: wire dtype code -> numpy dtype string (always little-endian)
DTYPES: Mapping[int, str] = {1: "<i8", 2: "<f4", 3: "<f8", 4: "|u1", 5: "<i4"}
DTYPE_CODES: Mapping[str, int] = {v: k for k, v in DTYPES.items()}


class PSMode(str, enum.Enum):
    """How updates travel (Fleet's ``a_sync`` / ``k_steps``)."""

    SYNC = "sync"    # every step applies the mean of all workers' gradients
    ASYNC = "async"  # gradients are applied on arrival
    GEO = "geo"      # workers train locally and exchange parameter deltas every k steps


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


class PSError(RuntimeError):
    """Base class of every parameter-server failure."""


class PSConfigError(PSError, ValueError):
    """A table, rule or cluster setting is invalid; the message names the field."""


# The name ``fleetx.ps`` exported before ``fleetx.launch.ConfigError`` (a bad fleetrun flag)
# made it ambiguous; kept so that scripts catching ``fleetx.ps.ConfigError`` go on working.
ConfigError = PSConfigError
# Likewise ``fleetx.ps.Mode``, the name of :class:`PSMode` before ``fleetx.strategy.api.Mode``
# (collective / ps) made it mean two things.
Mode = PSMode


class ProtocolError(PSError):
    """A frame is malformed, of another wire version, or a reply does not match its request."""


class PeerLostError(PSError):
    """A server or worker died, closed its connection or stopped sending heartbeats.

    Attributes:
        peer: who was lost, e.g. ``"server 1 (10.0.0.2:6001)"`` or ``"worker 3 (pid 41 on h)"``.
    """

    def __init__(self, peer: str, reason: str) -> None:
        super().__init__(f"{peer} lost: {reason}")
        self.peer = peer
        self.reason = reason


class RemoteError(PSError):
    """The peer failed while handling a request; ``remote_type`` is its error class name."""

    def __init__(self, peer: str, remote_type: str, message: str) -> None:
        super().__init__(f"{peer} failed: {remote_type}: {message}")
        self.peer = peer
        self.remote_type = remote_type


class PSTimeoutError(PSError, TimeoutError):
    """A bounded wait (connect, registration, an explicit timeout) ran out."""


class AuthError(PSError):
    """A connection failed the shared-secret handshake: the peer does not hold the job's secret
    (or holds another one), or it is not a fleetx parameter server at all. The message names the
    endpoint; it never contains a secret or a digest of one."""


class StateError(PSError):
    """A call out of order or on the wrong role (training before ``init_worker``, serving on
    a worker); the message says what to call first."""


class RequestError(PSError, ValueError):
    """A server refused a request: a field is malformed or out of range (a shape that does not
    match its table, an unknown table, a non-finite value, a learning rate out of range, a
    path outside the save root, a table that would exceed its row limit). The message names
    the request kind, the table or field, and what was expected; the tables are unchanged."""


# --------------------------------------------------------------------------------------------
# Tables and rules
# --------------------------------------------------------------------------------------------

RULES = ("sgd", "adagrad", "adam", "sum")
_OPTIMIZERS = {"SGD": "sgd", "Adagrad": "adagrad", "Adam": "adam", "AdamW": "adam"}


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise PSConfigError(message)


@dataclass(frozen=True)
class RuleConfig:
    """A server-side update rule and its hyper-parameters (torch.optim's meaning and names).

    Attributes:
        name: ``sgd``, ``adagrad``, ``adam`` or ``sum`` (GEO: add the pushed delta).
        lr: learning rate; changeable at run time (``SET_LR``).
        weight_decay: L2 penalty added to the gradient (``decoupled_weight_decay``: AdamW).
        momentum / nesterov: SGD momentum (dampening is not supported: it is always 0).
        betas / eps: Adam's; ``eps`` is Adagrad's too.
        initial_accumulator_value: Adagrad's starting sum of squares.

    Example:
        >>> RuleConfig.from_param_group("Adam", {"lr": 1e-3, "betas": (0.9, 0.99)}).name
        'adam'
    """

    name: str
    lr: float = 0.01
    weight_decay: float = 0.0
    momentum: float = 0.0
    nesterov: bool = False
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8
    initial_accumulator_value: float = 0.0
    decoupled_weight_decay: bool = False

    def __post_init__(self) -> None:
        _require(self.name in RULES, f"RuleConfig.name={self.name!r}: expected one of {RULES}")
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))
        for f in ("lr", "weight_decay", "momentum", "eps", "initial_accumulator_value"):
            v = getattr(self, f)
            _require(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0,
                     f"RuleConfig.{f}={v!r}: expected a finite number >= 0")
        _require(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
                 f"RuleConfig.betas={self.betas!r}: expected two numbers in [0, 1)")
        _require(not self.nesterov or self.momentum > 0,
                 "RuleConfig.nesterov=True needs momentum > 0")

    @classmethod
    def from_param_group(cls, optimizer: str, group: Mapping[str, Any]) -> "RuleConfig":
        """The rule for a torch optimizer class name and one of its ``param_groups``.

        Raises:
            PSConfigError: the optimizer or one of its options has no server-side equivalent.
        """
        name = _OPTIMIZERS.get(optimizer)
        _require(name is not None, f"optimizer {optimizer!r} has no parameter-server rule; "
                 f"supported: {', '.join(sorted(_OPTIMIZERS))}")
        g = dict(group)
        for key in ("amsgrad", "maximize", "lr_decay", "dampening"):
            _require(not g.get(key), f"{optimizer}({key}={g.get(key)!r}) is not supported by "
                     "the server-side rule")
        lr = g.get("lr", 0.01)
        _require(isinstance(lr, (int, float)), f"{optimizer} lr={lr!r}: a tensor lr is not "
                 "supported by the server rule; pass a float")
        kw: dict[str, Any] = {"lr": float(lr), "weight_decay": float(g.get("weight_decay", 0))}
        if name == "sgd":
            kw.update(momentum=float(g.get("momentum", 0)), nesterov=bool(g.get("nesterov")))
        elif name == "adagrad":
            kw.update(eps=float(g.get("eps", 1e-10)),
                      initial_accumulator_value=float(g.get("initial_accumulator_value", 0)))
        else:
            kw.update(eps=float(g.get("eps", 1e-8)), betas=tuple(g.get("betas", (0.9, 0.999))),
                      decoupled_weight_decay=bool(
                          g.get("decoupled_weight_decay", optimizer == "AdamW")))
        return cls(name, **kw)

    @classmethod
    def from_optimizer(cls, optimizer: Any, group_index: int = 0) -> "RuleConfig":
        """Like :meth:`from_param_group` for a torch optimizer object."""
        return cls.from_param_group(type(optimizer).__name__,
                                    optimizer.param_groups[group_index])

    def with_lr(self, lr: float) -> "RuleConfig":
        return RuleConfig(**{**asdict(self), "lr": float(lr)})


INITS = ("uniform", "normal", "constant")


@dataclass(frozen=True)
class InitConfig:
    """How a sparse row is initialised the first time its id is touched.

    The value of row ``id`` is a pure function of ``(seed, id)`` (a counter-based hash), so it
    does not depend on which server creates it, on the number of servers or on the order of
    requests.

    Attributes:
        kind: ``uniform`` (in [low, high)), ``normal`` (mean, std) or ``constant`` (value).
        seed: the table's seed; two tables with the same seed get the same rows.
    """

    kind: str = "normal"
    low: float = -0.01
    high: float = 0.01
    mean: float = 0.0
    std: float = 1.0
    value: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        _require(self.kind in INITS, f"InitConfig.kind={self.kind!r}: expected one of {INITS}")
        _require(self.low <= self.high, f"InitConfig: low={self.low} > high={self.high}")
        _require(self.std >= 0, f"InitConfig.std={self.std}: expected >= 0")
        _require(isinstance(self.seed, int) and 0 <= self.seed < 2 ** 63,
                 f"InitConfig.seed={self.seed!r}: expected an int in [0, 2**63)")


def _check_name(kind: str, name: str) -> None:
    _require(isinstance(name, str) and 0 < len(name) <= 200 and name.isprintable()
             and "/" not in name, f"{kind}.name={name!r}: expected 1-200 printable characters "
             "without '/'")


# --------------------------------------------------------------------------------------------
# Table growth: admission entries (Paddle's ``paddle.distributed.*Entry``) and eviction
# --------------------------------------------------------------------------------------------

#: ids whose sighting counts one server keeps per table while they wait for admission
DEFAULT_MAX_PENDING = 1 << 20


def _check_pending(kind: str, max_pending: Any) -> None:
    _require(isinstance(max_pending, int) and not isinstance(max_pending, bool)
             and 1 <= max_pending <= 1 << 30, f"{kind}.max_pending={max_pending!r}: expected "
             "an int in [1, 2**30]")


@dataclass(frozen=True)
class CountFilterEntry:
    """Admission by count: an id gets a row once training lookups saw it ``count_filter``
    times (Paddle's ``paddle.distributed.CountFilterEntry``).

    Until then a lookup returns zeros and its gradient is dropped. Each training pull request
    that holds the id counts once (in sync mode: each step whose update holds it, however many
    workers saw it); evaluation lookups never count. The counts of ids waiting
    for admission are kept exactly, for at most ``max_pending`` ids per server (about 22 bytes
    each); past that, new ids are not counted until a shrink forgets ids unseen for a pass.

    Example:
        >>> emb = SparseEmbedding(16, entry=CountFilterEntry(3))   # doctest: +SKIP
    """

    count_filter: int
    max_pending: int = DEFAULT_MAX_PENDING

    def __post_init__(self) -> None:
        _require(isinstance(self.count_filter, int) and not isinstance(self.count_filter, bool)
                 and 1 <= self.count_filter <= 1 << 20, f"CountFilterEntry.count_filter="
                 f"{self.count_filter!r}: expected an int in [1, 2**20]")
        _check_pending("CountFilterEntry", self.max_pending)


@dataclass(frozen=True)
class ProbabilityEntry:
    """Admission by chance: each training sighting of an id without a row admits it with
    probability ``probability`` (Paddle's ``paddle.distributed.ProbabilityEntry``).

    The k-th sighting's draw is a hash of ``(seed, id, k)``: which ids get in does not depend
    on the number of servers or on the order of requests. Sightings are counted as for
    :class:`CountFilterEntry` (``max_pending`` ids per server).

    Example:
        >>> emb = SparseEmbedding(16, entry=ProbabilityEntry(0.1))   # doctest: +SKIP
    """

    probability: float
    seed: int = 0
    max_pending: int = DEFAULT_MAX_PENDING

    def __post_init__(self) -> None:
        p = self.probability
        _require(isinstance(p, (int, float)) and not isinstance(p, bool) and 0 < p <= 1,
                 f"ProbabilityEntry.probability={p!r}: expected a number in (0, 1]")
        _require(isinstance(self.seed, int) and 0 <= self.seed < 2 ** 63,
                 f"ProbabilityEntry.seed={self.seed!r}: expected an int in [0, 2**63)")
        _check_pending("ProbabilityEntry", self.max_pending)


@dataclass(frozen=True)
class ShowClickEntry:
    """Show/click statistics per row, as Paddle's CTR accessor keeps them (Paddle's
    ``paddle.distributed.ShowClickEntry``): every id gets a row, and each training lookup
    passes per-sample ``show`` and ``click`` values (``emb(ids, show=..., click=...)``) that
    are summed into the row. The table's :class:`AccessorConfig` decays them at each shrink
    and deletes rows whose score falls below ``delete_threshold``.

    Args:
        show_name / click_name: names of the inputs (kept for Paddle's signature and shown in
            the memory report; the values come through the forward call).
    """

    show_name: str = "show"
    click_name: str = "click"

    def __post_init__(self) -> None:
        for f in ("show_name", "click_name"):
            v = getattr(self, f)
            _require(isinstance(v, str) and 0 < len(v) <= 200,
                     f"ShowClickEntry.{f}={v!r}: expected a non-empty string")


ENTRIES = {"count_filter": CountFilterEntry, "probability": ProbabilityEntry,
           "show_click": ShowClickEntry}


@dataclass(frozen=True)
class AccessorConfig:
    """When rows are decayed and deleted at a shrink (``fleet.shrink()``, one per pass):
    Paddle's ``ctr_accessor_param``, with its names and defaults (``the_one_ps.py``).

    A row is *seen* in a pass when a training update (push) touched it. At each shrink, show
    and click are multiplied by ``show_click_decay_rate`` (tables with a
    :class:`ShowClickEntry`), then a row is deleted when its score
    ``(show - click) * nonclk_coeff + click * click_coeff`` is below ``delete_threshold``
    (show/click tables) or when it was not seen in more than ``delete_after_unseen_days``
    consecutive passes (``CtrCommonAccessor::Shrink``).

    Example:
        >>> AccessorConfig(delete_after_unseen_days=2).delete_after_unseen_days
        2
    """

    nonclk_coeff: float = 0.1
    click_coeff: float = 1.0
    show_click_decay_rate: float = 1.0
    delete_threshold: float = 0.0
    delete_after_unseen_days: int = 30

    def __post_init__(self) -> None:
        for f in ("nonclk_coeff", "click_coeff", "delete_threshold"):
            v = getattr(self, f)
            _require(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
                     f"AccessorConfig.{f}={v!r}: expected a finite number")
        d = self.show_click_decay_rate
        _require(isinstance(d, (int, float)) and not isinstance(d, bool) and 0 <= d <= 1,
                 f"AccessorConfig.show_click_decay_rate={d!r}: expected a number in [0, 1]")
        u = self.delete_after_unseen_days
        _require(isinstance(u, int) and not isinstance(u, bool) and 0 <= u < 1 << 24,
                 f"AccessorConfig.delete_after_unseen_days={u!r}: expected an int in "
                 "[0, 2**24)")


def _entry_json(entry: Any) -> Optional[dict]:
    if entry is None:
        return None
    kind = next(k for k, cls in ENTRIES.items() if isinstance(entry, cls))
    return {"kind": kind, **asdict(entry)}


def _entry_from_json(d: Any) -> Any:
    if d is None:
        return None
    d = dict(d)
    return ENTRIES[d.pop("kind")](**d)


@dataclass(frozen=True)
class SparseTableSpec:
    """A sparse table: int64 id -> row of ``dim`` float32 weights plus the rule's state.

    Attributes:
        name: unique among all tables of a job.
        dim: row width.
        rule: the server-side update rule.
        init: how a missing row is created.
        num_embeddings: set for tables that come from ``nn.Embedding(sparse=True)``: ids must be
            in ``[0, num_embeddings)`` and worker 0 assigns the module's own weights at start.
        entry: admission (:class:`CountFilterEntry`, :class:`ProbabilityEntry`) or show/click
            statistics (:class:`ShowClickEntry`); None: every id gets a row on first touch.
        accessor: when rows are decayed and deleted at a shrink; None: never (and no
            per-row statistics are kept). A :class:`ShowClickEntry` implies the defaults.
    """

    name: str
    dim: int
    rule: RuleConfig
    init: InitConfig = field(default_factory=InitConfig)
    num_embeddings: Optional[int] = None
    entry: Any = None
    accessor: Optional[AccessorConfig] = None

    def __post_init__(self) -> None:
        _check_name("SparseTableSpec", self.name)
        _require(isinstance(self.dim, int) and self.dim > 0,
                 f"SparseTableSpec({self.name!r}).dim={self.dim!r}: expected an int > 0")
        _require(self.num_embeddings is None or self.num_embeddings > 0,
                 f"SparseTableSpec({self.name!r}).num_embeddings must be > 0")
        _require(self.entry is None or isinstance(self.entry, tuple(ENTRIES.values())),
                 f"SparseTableSpec({self.name!r}).entry={self.entry!r}: expected None, "
                 "CountFilterEntry, ProbabilityEntry or ShowClickEntry")
        _require(self.accessor is None or isinstance(self.accessor, AccessorConfig),
                 f"SparseTableSpec({self.name!r}).accessor={self.accessor!r}: expected None or "
                 "an AccessorConfig")
        if self.show_click and self.accessor is None:
            object.__setattr__(self, "accessor", AccessorConfig())

    @property
    def show_click(self) -> bool:
        """Rows keep show/click statistics, fed by every push."""
        return isinstance(self.entry, ShowClickEntry)

    @property
    def admission(self) -> bool:
        """Rows are created only for admitted ids (a count or probability entry)."""
        return isinstance(self.entry, (CountFilterEntry, ProbabilityEntry))

    @property
    def push_width(self) -> int:
        """Floats per id in a PUSH: the gradient, then show and click for show/click tables."""
        return self.dim + (2 if self.show_click else 0)

    def to_json(self) -> dict:
        return {**{f.name: getattr(self, f.name) for f in fields(self)},
                "rule": asdict(self.rule), "init": asdict(self.init),
                "entry": _entry_json(self.entry),
                "accessor": None if self.accessor is None else asdict(self.accessor)}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "SparseTableSpec":
        acc = d.get("accessor")
        return cls(**{**d, "rule": RuleConfig(**{**d["rule"], "betas": tuple(d["rule"]["betas"])}),
                      "init": InitConfig(**d["init"]), "entry": _entry_from_json(d.get("entry")),
                      "accessor": None if acc is None else AccessorConfig(**acc)})


@dataclass(frozen=True)
class DenseTableSpec:
    """A flat dense parameter vector (one per optimizer param group), split evenly over servers."""

    name: str
    numel: int
    rule: RuleConfig

    def __post_init__(self) -> None:
        _check_name("DenseTableSpec", self.name)
        _require(isinstance(self.numel, int) and self.numel > 0,
                 f"DenseTableSpec({self.name!r}).numel={self.numel!r}: expected an int > 0")


@dataclass(frozen=True)
class Tables:
    """Every table of a job. Servers and workers build the same one; HELLO compares fingerprints."""

    sparse: tuple = ()
    dense: tuple = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "sparse", tuple(self.sparse))
        object.__setattr__(self, "dense", tuple(self.dense))
        names = [t.name for t in self.sparse + self.dense]
        dup = sorted({n for n in names if names.count(n) > 1})
        _require(not dup, f"table names must be unique; repeated: {dup}")

    def get(self, name: str):
        for t in self.sparse + self.dense:
            if t.name == name:
                return t
        raise PSConfigError(f"unknown table {name!r}; known: "
                          f"{', '.join(t.name for t in self.sparse + self.dense) or '(none)'}")

    def to_json(self) -> str:
        return json.dumps({"sparse": [t.to_json() for t in self.sparse],
                           "dense": [asdict(t) for t in self.dense]}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Tables":
        d = json.loads(text)
        return cls(tuple(SparseTableSpec.from_json(t) for t in d.get("sparse", ())),
                   tuple(DenseTableSpec(**{**t, "rule": RuleConfig(
                       **{**t["rule"], "betas": tuple(t["rule"]["betas"])})})
                         for t in d.get("dense", ())))

    def fingerprint(self) -> str:
        """A digest of the layout (names, shapes, rule kinds, growth settings) but not of
        learning rates, which may legitimately differ while a job runs."""
        shape = [(t.name, t.dim, t.rule.name, t.num_embeddings, asdict(t.init)) + (
            (_entry_json(t.entry), None if t.accessor is None else asdict(t.accessor))
            if t.entry is not None or t.accessor is not None else ())
                 for t in self.sparse] + [(t.name, t.numel, t.rule.name) for t in self.dense]
        return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]


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
    heartbeat_interval: float = 3.0
    dead_after: float = 15.0
    timeout: float = 300.0
    log_interval: float = 60.0
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    max_connections: int = 0
    secret: Optional[str] = field(default=None, repr=False, compare=False)
    secret_file: Optional[str] = None
    max_lr: float = 10.0
    max_rows: int = 0
    nonfinite: str = "refuse"
    save_root: Optional[str] = None
    transport: str = "tcp"
    heter_workers: tuple = ()
    local_sockets: bool = True
    snapshot_dir: Optional[str] = None
    snapshot_interval: float = 30.0
    snapshot_job: str = ""
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
