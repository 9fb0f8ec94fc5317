"""The process grid of a job: how many ranks shard, replicate, split and pipeline.

One rule decides the degrees, whichever of Paddle's places they were written in:
``hybrid_configs`` is the source of truth; a degree set elsewhere
(``sharding_configs['sharding_degree']``, ``sharding_configs['dp_degree']``,
``tensor_parallel_configs['tensor_parallel_degree']``...) fills the ``hybrid_configs`` key when
that one is unset, and two places set to different values is an error naming both. "Set" means
assigned by the user (``DistributedStrategy.is_set``), even to the default: a value left at its
default says nothing.

With ``strategy.sharding = True`` and no sharding degree anywhere, the sharding group is the
whole data-parallel group (Paddle's ``sharding_configs`` default of 8 is not used: it would
refuse every job of fewer than 8 processes). With sharding off the sharding degree is 1.
``hybrid_configs['dp_degree'] = -1`` (its default) infers the data-parallel degree from the
world size.

``mp_degree`` (filled by ``tensor_parallel_configs['tensor_parallel_degree']``) and
``pp_degree`` need no switch, as in Paddle 2.2's dynamic graph: with sharding off the world is
``dp x pp x mp`` ranks, ``dp_degree=-1`` taking what the other two leave, and degrees that
cannot fill the world are an error naming each as ``name=value`` with the world size. Sharding
together with tensor or pipeline parallelism is refused (not implemented).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

from fleetx.strategy.api import StrategyError

__all__ = ["AXES", "Coordinate", "Topology", "resolve"]


AXES = ("data", "pipe", "sharding", "model")


class Coordinate(NamedTuple):
    """A rank's place in the grid, one index per axis of :data:`AXES`."""

    data: int
    pipe: int
    sharding: int
    model: int


@dataclass(frozen=True)
class Topology:
    """The degrees of the process grid; their product is the world size.

    Rank layout: Paddle's axis order ``["data", "pipe", "sharding", "model"]``, the model axis
    innermost, so ``rank = ((data * pp + pipe) * sharding_degree + sharding) * mp + model``.
    A group of an axis is the ranks that differ only in that axis (:meth:`groups`); groups are
    listed in Paddle's ``get_comm_list`` order (the other axes' indexes counted row-major).
    Consecutive ranks share a node under ``fleetrun``, so the groups that talk most (model,
    then sharding) stay on a node while only the replication crosses nodes.

    With ``mp_degree == pp_degree == 1`` a sharding group is ``sharding_degree`` consecutive
    ranks and rank ``r`` sits at row ``r // sharding_degree``, column ``r % sharding_degree`` of
    :attr:`mesh_shape`: the layout of ``init_device_mesh(device, mesh_shape)`` with
    ``mesh_dim_names=("replicate", "shard")``, FSDP2's hybrid-sharding mesh.

    Example:
        >>> t = Topology(dp_degree=2, sharding_degree=4)
        >>> t.sharding_groups()
        [[0, 1, 2, 3], [4, 5, 6, 7]]
        >>> t.dp_groups()
        [[0, 4], [1, 5], [2, 6], [3, 7]]
        >>> t.world_size, t.mesh_shape
        (8, (2, 4))
        >>> h = Topology(dp_degree=2, sharding_degree=1, mp_degree=2, pp_degree=2)
        >>> h.groups("model"), h.groups("pipe")
        ([[0, 1], [2, 3], [4, 5], [6, 7]], [[0, 2], [1, 3], [4, 6], [5, 7]])
        >>> h.coordinate(5)
        Coordinate(data=1, pipe=0, sharding=0, model=1)
    """

    dp_degree: int
    sharding_degree: int
    mp_degree: int = 1
    pp_degree: int = 1

    def __post_init__(self) -> None:
        for name in ("dp_degree", "sharding_degree", "mp_degree", "pp_degree"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Topology.{name} must be an int >= 1, got {value!r}")

    @property
    def world_size(self) -> int:
        """The number of processes: the product of the degrees."""
        return self.dp_degree * self.sharding_degree * self.mp_degree * self.pp_degree

    @property
    def shape(self) -> Coordinate:
        """The degree of each axis, in :data:`AXES` order."""
        return Coordinate(self.dp_degree, self.pp_degree, self.sharding_degree, self.mp_degree)

    @property
    def mesh_shape(self) -> tuple[int, int]:
        """``(dp_degree, sharding_degree)``: the 2-D device mesh whose rows are sharding groups
        (sharding's mesh; it describes the whole world only when mp and pp are 1)."""
        return (self.dp_degree, self.sharding_degree)

    def coordinate(self, rank: int) -> Coordinate:
        """``rank``'s index on every axis."""
        rest, out = self._check(rank), []
        for degree in reversed(self.shape):
            rest, index = divmod(rest, degree)
            out.append(index)
        return Coordinate(*reversed(out))

    def rank_of(self, data: int = 0, pipe: int = 0, sharding: int = 0, model: int = 0) -> int:
        """The rank at a coordinate (the inverse of :meth:`coordinate`).

        Raises:
            ValueError: an index is outside its axis, named as ``axis=value``.
        """
        rank = 0
        for axis, index, degree in zip(AXES, (data, pipe, sharding, model), self.shape):
            if not 0 <= index < degree:
                raise ValueError(f"{axis}={index} is outside the {axis} axis of degree {degree}")
            rank = rank * degree + index
        return rank

    def groups(self, axis: str) -> list[list[int]]:
        """Every group of ``axis`` (one of :data:`AXES`): the ranks that differ only there.

        Raises:
            ValueError: ``axis`` is not one of :data:`AXES`.
        """
        if axis not in AXES:
            raise ValueError(f"unknown axis {axis!r}: choose one of {', '.join(AXES)}")
        where = AXES.index(axis)
        others = [range(d) for i, d in enumerate(self.shape) if i != where]
        out = []
        for fixed in itertools.product(*others):
            coords = list(fixed)
            out.append([self.rank_of(*(coords[:where] + [i] + coords[where:]))
                        for i in range(self.shape[where])])
        return out

    def group_of(self, axis: str, rank: int) -> list[int]:
        """The group of ``axis`` that holds ``rank``."""
        self._check(rank)
        return next(g for g in self.groups(axis) if rank in g)

    def sharding_groups(self) -> list[list[int]]:
        """Every sharding group (``sharding_degree`` consecutive ranks when mp is 1)."""
        return self.groups("sharding")

    def dp_groups(self) -> list[list[int]]:
        """Every data-parallel group: the ranks at one position of every other axis."""
        return self.groups("data")

    def model_groups(self) -> list[list[int]]:
        """Every model (tensor) parallel group: ``mp_degree`` consecutive ranks."""
        return self.groups("model")

    def pipe_groups(self) -> list[list[int]]:
        """Every pipeline group, its ranks in stage order."""
        return self.groups("pipe")

    def sharding_rank(self, rank: int) -> int:
        """``rank``'s position in its sharding group."""
        return self.coordinate(rank).sharding

    def dp_rank(self, rank: int) -> int:
        """``rank``'s position in its data-parallel group."""
        return self.coordinate(rank).data

    def mp_rank(self, rank: int) -> int:
        """``rank``'s position in its model-parallel group."""
        return self.coordinate(rank).model

    def stage(self, rank: int) -> int:
        """``rank``'s pipeline stage (its position in its pipe group)."""
        return self.coordinate(rank).pipe

    def _check(self, rank: int) -> int:
        if isinstance(rank, bool) or not isinstance(rank, int) or \
                not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size} processes")
        return rank


class _Degree(NamedTuple):
    value: int
    source: str  # how messages name where it was written: hybrid_configs['mp_degree']


def resolve(strategy: Any, world_size: int) -> Topology:
    """The process grid ``strategy`` asks for on ``world_size`` processes (see the module).

    Args:
        strategy: a :class:`~fleetx.strategy.distributed_strategy.DistributedStrategy`.
        world_size: the number of processes of the job.

    Returns:
        The :class:`Topology`; its degrees multiply to ``world_size``.

    Raises:
        StrategyError: two places set a degree to different values; a sharding degree larger
            than the world or not dividing it; degrees whose product is not the world size;
            ``hybrid_dp`` contradicting the data-parallel degree; a sharding degree set while
            ``strategy.sharding`` is off; tensor or pipeline degrees other than 1 with sharding
            on. Each message names the settings, their numbers and the fix.
        ValueError: ``world_size`` is not an int >= 1.

    Example:
        >>> from fleetx.strategy.distributed_strategy import DistributedStrategy
        >>> s = DistributedStrategy(); s.sharding = True
        >>> resolve(s, 2)
        Topology(dp_degree=1, sharding_degree=2, mp_degree=1, pp_degree=1)
        >>> s.sharding_configs = {"sharding_degree": 4, "hybrid_dp": True}
        >>> resolve(s, 8).sharding_groups()
        [[0, 1, 2, 3], [4, 5, 6, 7]]
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    on = bool(strategy.sharding)
    model = _model_degrees(strategy, on)
    if not on:
        return _without_sharding(strategy, world_size, *model)
    if any(d is not None and d.value != 1 for d in model):
        asked = " and ".join(f"{d.source}={d.value}" for d in model if d and d.value != 1)
        raise StrategyError(
            f"{asked} with strategy.sharding on: sharding together with tensor or pipeline "
            f"parallelism is not implemented in fleetx; turn sharding off, or set the tensor "
            f"and pipeline degrees to 1")
    sharding = _agreed(_given(strategy, _SHARDING_PLACES))
    dp = _agreed(_given(strategy, _DP_PLACES, infer=-1))
    for degree in (sharding, dp):
        if degree is not None:
            _check_divides(degree, world_size)
    # No sharding degree anywhere: the sharding group is what the data-parallel degree leaves.
    s = sharding.value if sharding else world_size // (dp.value if dp else 1)
    d = dp.value if dp else world_size // s
    if s * d != world_size:
        raise StrategyError(
            f"{sharding.source}={s} x {dp.source}={d} is {s * d} processes, but the world has "
            f"{world_size}: make the product {world_size}, or leave one of them unset to "
            f"infer it")
    _check_hybrid_dp(strategy, d, world_size)
    return Topology(dp_degree=d, sharding_degree=s)


def _model_degrees(strategy: Any, sharding_on: bool) -> tuple[Optional[_Degree], ...]:
    """The tensor (mp) and pipeline (pp) degrees the user set, each agreed across its places;
    ``sharding_configs`` counts only with sharding on (off, the plan says it is ignored)."""
    out = []
    for key, others in _MODEL_PLACES:
        places = [("hybrid_configs", key)] + [p for p in others if p[0] != "sharding_configs"]
        # sharding_configs' copies are declared without effect: read only when the user set them
        extra = [p for p in others if sharding_on and p[0] == "sharding_configs"]
        out.append(_agreed(_given(strategy, places) + _explicit(strategy, extra)))
    return tuple(out)


# (hybrid_configs key, the other places that fill it when it is unset)
_MODEL_PLACES = (
    ("mp_degree", (("tensor_parallel_configs", "tensor_parallel_degree"),
                   ("sharding_configs", "mp_degree"))),
    ("pp_degree", (("sharding_configs", "pp_degree"),)),
)
_SHARDING_PLACES = (("hybrid_configs", "sharding_degree"), ("sharding_configs", "sharding_degree"))
_DP_PLACES = (("hybrid_configs", "dp_degree"), ("sharding_configs", "dp_degree"))


def _label(section: str, key: str) -> str:
    return f"{section}[{key!r}]"


def _given(strategy: Any, places, infer: Optional[int] = None) -> list[_Degree]:
    """The degrees the user set at ``places`` (``hybrid_configs`` first); ``infer`` is the
    value that means "not given" (``dp_degree = -1``)."""
    found = []
    for section, key in places:
        value = getattr(strategy.typed_config(section), key)
        if strategy.is_set(f"{section}.{key}") and value != infer:
            found.append(_Degree(value, _label(section, key)))
    return found


def _explicit(strategy: Any, places) -> list[_Degree]:
    """As :func:`_given`, reading only the keys the user set: these keys are declared without
    effect, and an unset one is never read."""
    return [_Degree(getattr(strategy.typed_config(section), key), _label(section, key))
            for section, key in places if strategy.is_set(f"{section}.{key}")]


def _agreed(found: list[_Degree]) -> Optional[_Degree]:
    """The first (``hybrid_configs``) of the degrees given, when all agree; None if none."""
    for other in found[1:]:
        if other.value != found[0].value:
            raise StrategyError(
                f"{found[0].source}={found[0].value} and {other.source}={other.value} disagree: "
                f"set the same value in both, or set only {found[0].source} (hybrid_configs is "
                f"the source of truth; the other only fills it when it is unset)")
    return found[0] if found else None


def _check_divides(degree: _Degree, world_size: int) -> None:
    if degree.value > world_size:
        raise StrategyError(
            f"{degree.source}={degree.value} is larger than the world size {world_size}: use "
            f"a divisor of {world_size} ({_divisors(world_size)})")
    if world_size % degree.value:
        raise StrategyError(
            f"{degree.source}={degree.value} does not divide the world size {world_size}: use "
            f"a divisor of {world_size} ({_divisors(world_size)})")


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _check_hybrid_dp(strategy: Any, dp: int, world_size: int) -> None:
    """``hybrid_dp``, when the user set it, must agree with the data-parallel degree."""
    hybrid_dp = strategy.typed_config("sharding").hybrid_dp
    if not strategy.is_set("sharding_configs.hybrid_dp"):
        return
    if hybrid_dp and dp == 1:
        raise StrategyError(
            f"sharding_configs['hybrid_dp']=True replicates sharding groups, but the "
            f"data-parallel degree is 1 (one sharding group of all {world_size} processes): "
            f"set a sharding_degree below {world_size} that divides it, or hybrid_dp=False")
    if not hybrid_dp and dp > 1:
        raise StrategyError(
            f"sharding_configs['hybrid_dp']=False, but the data-parallel degree is {dp} "
            f"({dp} sharding groups of {world_size // dp} processes): set hybrid_dp=True, or "
            f"a sharding_degree of {world_size}")


def _without_sharding(strategy: Any, world_size: int, mp: Optional[_Degree],
                      pp: Optional[_Degree]) -> Topology:
    """Sharding off: what the tensor and pipeline degrees leave is data parallel.
    ``sharding_configs`` is ignored (the plan says so); a ``hybrid_configs`` sharding degree
    that asks for more is an error."""
    sharding = _agreed(_explicit(strategy, [("hybrid_configs", "sharding_degree")]))
    if sharding is not None and sharding.value != 1:
        raise StrategyError(
            f"{sharding.source}={sharding.value} asks for sharding, but strategy.sharding is "
            f"off: set strategy.sharding = True, or leave the degree unset")
    dp = _agreed(_given(strategy, [("hybrid_configs", "dp_degree")], infer=-1))
    m, p = (mp.value if mp else 1), (pp.value if pp else 1)
    if m * p == 1:
        if dp is not None and dp.value != world_size:
            raise StrategyError(
                f"{dp.source}={dp.value}, but without sharding every one of the {world_size} "
                f"processes is a data-parallel rank: set it to {world_size}, or -1 to infer it")
        return Topology(dp_degree=world_size, sharding_degree=1)
    d = dp.value if dp else (world_size // (m * p) if world_size % (m * p) == 0 else 0)
    if d * m * p != world_size:
        raise StrategyError(_product_error(dp, d, mp, m, pp, p, world_size))
    return Topology(dp_degree=d, sharding_degree=1, mp_degree=m, pp_degree=p)


def _product_error(dp: Optional[_Degree], d: int, mp: Optional[_Degree], m: int,
                   pp: Optional[_Degree], p: int, world_size: int) -> str:
    """The message for degrees that cannot fill the world, each named ``name=value``."""
    filled = [f"{x.source} fills {key}" for x, key in ((mp, "mp_degree"), (pp, "pp_degree"))
              if x is not None and not x.source.startswith("hybrid_configs")]
    where = f" ({'; '.join(filled)})" if filled else ""
    if dp is None:
        return (f"pp_degree={p} x mp_degree={m} is {p * m} processes per data-parallel rank, "
                f"which does not divide the world size {world_size}{where}: use degrees whose "
                f"product divides {world_size} (dp_degree=-1 then infers the rest)")
    return (f"dp_degree={d} x pp_degree={p} x sharding_degree=1 x mp_degree={m} is "
            f"{d * p * m} processes, but the world size is {world_size}{where}: make the "
            f"product {world_size}, or set dp_degree=-1 to infer it")
