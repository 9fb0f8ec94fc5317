"""Table and rule specs: what every table of a job is, as servers and workers both build it.

A job's :class:`Tables` lists its :class:`SparseTableSpec` (id -> row, with a
:class:`RuleConfig`, an :class:`InitConfig` and optionally an admission or show/click entry and
an :class:`AccessorConfig`) and :class:`DenseTableSpec` (a flat vector). Every spec checks its
fields on construction and raises :class:`~fleetx.ps.api.PSConfigError` naming the field;
``to_json`` / ``from_json`` carry them to the servers, and :meth:`Tables.fingerprint` is what
HELLO compares. Users import these from :mod:`fleetx.ps.api`.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Mapping, Optional

from fleetx.ps.errors import PSConfigError, require as _require

__all__ = [
    "RULES", "RuleConfig", "INITS", "InitConfig", "DEFAULT_MAX_PENDING", "CountFilterEntry",
    "ProbabilityEntry", "ShowClickEntry", "ENTRIES", "AccessorConfig", "SparseTableSpec",
    "DenseTableSpec", "Tables",
]

RULES = ("sgd", "adagrad", "adam", "sum")
_OPTIMIZERS = {"SGD": "sgd", "Adagrad": "adagrad", "Adam": "adam", "AdamW": "adam"}


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
