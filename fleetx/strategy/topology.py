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

Tensor and pipeline parallelism are not implemented in fleetx yet: their degrees are resolved
by the same rule (so conflicts are reported), and a resolved degree other than 1 is refused.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

from fleetx.strategy.api import StrategyError

__all__ = ["Topology", "resolve"]


@dataclass(frozen=True)
class Topology:
    """The degrees of the process grid; their product is the world size.

    Rank layout (what :meth:`sharding_groups` and :meth:`dp_groups` return): a sharding group is
    ``sharding_degree`` consecutive ranks, and a data-parallel group holds the ranks at the same
    position in each sharding group. Rank ``r`` sits at row ``r // sharding_degree`` (its
    data-parallel index) and column ``r % sharding_degree`` (its position in its sharding group)
    of a ``(dp_degree, sharding_degree)`` grid: the layout of
    ``torch.distributed.device_mesh.init_device_mesh(device, mesh_shape)`` with
    ``mesh_dim_names=("replicate", "shard")``, FSDP2's hybrid-sharding mesh. Consecutive ranks
    share a node under ``fleetrun``, so the sharding traffic (every step) stays on the node
    while only the replication crosses nodes.

    Example:
        >>> t = Topology(dp_degree=2, sharding_degree=4)
        >>> t.sharding_groups()
        [[0, 1, 2, 3], [4, 5, 6, 7]]
        >>> t.dp_groups()
        [[0, 4], [1, 5], [2, 6], [3, 7]]
        >>> t.world_size, t.mesh_shape
        (8, (2, 4))
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
        if self.mp_degree != 1 or self.pp_degree != 1:
            # The group layout below knows two dimensions only; resolve() refuses the others.
            raise ValueError("Topology supports mp_degree == pp_degree == 1 only (tensor and "
                             f"pipeline parallelism are not implemented), got mp_degree "
                             f"{self.mp_degree}, pp_degree {self.pp_degree}")

    @property
    def world_size(self) -> int:
        """The number of processes: the product of the degrees."""
        return self.dp_degree * self.sharding_degree * self.mp_degree * self.pp_degree

    @property
    def mesh_shape(self) -> tuple[int, int]:
        """``(dp_degree, sharding_degree)``: the 2-D device mesh whose rows are sharding groups."""
        return (self.dp_degree, self.sharding_degree)

    def sharding_groups(self) -> list[list[int]]:
        """Every sharding group, each ``sharding_degree`` consecutive ranks, in rank order."""
        s = self.sharding_degree
        return [list(range(d * s, (d + 1) * s)) for d in range(self.dp_degree)]

    def dp_groups(self) -> list[list[int]]:
        """Every data-parallel group: the ranks at one position of each sharding group."""
        s = self.sharding_degree
        return [list(range(i, self.world_size, s)) for i in range(s)]

    def sharding_rank(self, rank: int) -> int:
        """``rank``'s position in its sharding group."""
        return self._check(rank) % self.sharding_degree

    def dp_rank(self, rank: int) -> int:
        """The index of ``rank``'s sharding group (its position in its data-parallel group)."""
        return self._check(rank) // self.sharding_degree

    def _check(self, rank: int) -> int:
        if not 0 <= rank < self.world_size:
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
            ``strategy.sharding`` is off; a tensor or pipeline degree other than 1. Each
            message names the settings, their numbers and the fix.
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
    for key, feature, others in _UNIMPLEMENTED:
        # sharding_configs counts only with sharding on (off, the plan says it is ignored).
        places = [("hybrid_configs", key)] + [p for p in others if on or p[0] != "sharding_configs"]
        degree = _agreed(_explicit(strategy, places))
        if degree is not None and degree.value != 1:
            raise StrategyError(
                f"{degree.source}={degree.value} asks for {feature}, which fleetx does not "
                f"implement yet: set it to 1 or leave it unset")
    if not on:
        return _without_sharding(strategy, world_size)
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


# Degrees fleetx cannot run yet: (hybrid_configs key, what it asks for, the other places).
_UNIMPLEMENTED = (
    ("mp_degree", "tensor parallelism", (("tensor_parallel_configs", "tensor_parallel_degree"),
                                         ("sharding_configs", "mp_degree"))),
    ("pp_degree", "pipeline parallelism", (("sharding_configs", "pp_degree"),)),
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


def _without_sharding(strategy: Any, world_size: int) -> Topology:
    """Sharding off: every rank is a data-parallel rank. ``sharding_configs`` is ignored (the
    plan says so); a ``hybrid_configs`` degree that asks for more is an error."""
    sharding = _agreed(_explicit(strategy, [("hybrid_configs", "sharding_degree")]))
    if sharding is not None and sharding.value != 1:
        raise StrategyError(
            f"{sharding.source}={sharding.value} asks for sharding, but strategy.sharding is "
            f"off: set strategy.sharding = True, or leave the degree unset")
    dp = _agreed(_given(strategy, [("hybrid_configs", "dp_degree")], infer=-1))
    if dp is not None and dp.value != world_size:
        raise StrategyError(
            f"{dp.source}={dp.value}, but without sharding every one of the {world_size} "
            f"processes is a data-parallel rank: set it to {world_size}, or -1 to infer it")
    return Topology(dp_degree=world_size, sharding_degree=1)
