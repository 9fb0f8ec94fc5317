"""The PyTorch engines behind ``strategy.sharding``, and the rebinding of the user's optimizer.

* Stage 1: :func:`zero_optimizer` turns the user's optimizer into a
  ``torch.distributed.optim.ZeroRedundancyOptimizer`` over the sharding group (same class, groups
  and defaults); each rank keeps the state of its share of the parameters, steps them and
  broadcasts them. The model keeps ``DistributedDataParallel`` over the whole world.
* Stages 2 and 3: :func:`shard_in_place` applies FSDP2 ``fully_shard`` to the user's module, in
  place: first to each unit (:func:`sharding_units`: the model's blocks), then to the root, so
  at stage 3 a unit's parameters are gathered for its forward and freed after it. Parameters
  become ``DTensor`` shards; gradients are reduce-scattered, so no DDP runs.
  :func:`rebound_optimizer` then gives the optimizer the new parameters.
  Every rank first takes rank 0's parameters and buffers (:func:`broadcast_from_rank0`),
  so the sharded model starts where DDP's would.

Both are idempotent: the fleet re-plans at every ``distributed_model`` / ``distributed_optimizer``
call, and a second call finds the module already sharded (a record on the module) and the
optimizer already rebuilt (a record on the user's optimizer).
"""
from __future__ import annotations

import contextlib
import inspect
import os
import re
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.weak import WeakIdKeyDictionary

from fleetx.comm.api import Blame, CommError
from fleetx.comm.groups import current
from fleetx.strategy.algorithms.fsdp_units import plan_units
from fleetx.strategy.api import StrategyError
from fleetx.strategy.plan import ModelInfo

if TYPE_CHECKING:
    from torch.distributed.optim import ZeroRedundancyOptimizer

__all__ = ["ShardRecord", "sharding_units", "shard_in_place", "broadcast_from_rank0",
           "gathered_bytes", "eval_guard", "rebound_optimizer", "zero_optimizer", "sharding_group"]

# The record a sharded module carries, and the optimizers built for a user's optimizer.
_RECORD = "_fleetx_sharding"
_BUILT = "_fleetx_sharding_built"
# Process groups of a sharding layout, made once per default group: every rank must create
# every group in the same order, and a re-plan must not make new ones.
_GROUPS: dict[tuple, Any] = {}


@dataclass
class ShardRecord:
    """How a module was sharded, and the qualified name of each of its original parameters
    (held weakly: an optimizer built before sharding maps its parameters through it)."""

    stage: int
    mesh_shape: tuple[int, ...]
    names: Any = field(default_factory=WeakIdKeyDictionary, repr=False)
    units: tuple[str, ...] = ()  # sharding_configs['units'] when it was sharded


def sharding_units(model: nn.Module, entries: Sequence[str] = ()) -> list[nn.Module]:
    """The sub-modules that become FSDP2 units of their own before the root, by the rule of
    :mod:`~fleetx.strategy.algorithms.fsdp_units`: those ``entries`` name, else the model's
    repeated blocks (and ``_no_split_modules`` classes), else each child holding parameters;
    a tied embedding and head stay in the root.

    Args:
        model: the user's module (the root unit, not listed).
        entries: ``sharding_configs['units']`` (class names or qualified-name globs).

    Raises:
        StrategyError: an entry matches nothing or would split a tie (see ``plan_units``).

    Example:
        >>> m = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
        >>> [type(u).__name__ for u in sharding_units(m)]
        ['Linear', 'Linear']
    """
    return [model.get_submodule(u.name) for u in plan_units(ModelInfo.of(model), entries)]


def device_mesh(device: str, mesh_shape: tuple[int, int]) -> Any:
    """FSDP2's mesh: 1-D over one sharding group, or ``(replicate, shard)`` (HSDP) when
    sharding groups are replicated over data-parallel groups (the layout of
    :class:`~fleetx.strategy.topology.Topology`).

    Args:
        device: ``"cpu"`` or ``"cuda"``.
        mesh_shape: ``(dp_degree, sharding_degree)``.
    """
    dp, sharding = mesh_shape
    if dp == 1:
        return init_device_mesh(device, (sharding,))
    return init_device_mesh(device, (dp, sharding), mesh_dim_names=("replicate", "shard"))


def shard_in_place(model: nn.Module, stage: int, mesh_shape: tuple[int, int],
                   device: str, units: Sequence[str] = ()) -> ShardRecord:
    """Apply FSDP2 ``fully_shard`` to ``model`` in place (stage 2 keeps the parameters gathered
    from forward to backward, stage 3 frees them after each unit's forward), after giving every
    rank rank 0's parameters and buffers (:func:`broadcast_from_rank0`); a module already
    sharded the same way is left as it is.

    Args:
        model: the user's module, changed in place (parameters become ``DTensor`` shards).
        stage: 2 or 3.
        mesh_shape: ``(dp_degree, sharding_degree)``, see :func:`device_mesh`.
        device: ``"cpu"`` or ``"cuda"``.
        units: ``sharding_configs['units']``, see :func:`sharding_units`.

    Returns:
        The module's :class:`ShardRecord` (the names of its original parameters).

    Raises:
        StrategyError: the module was already sharded at another stage or layout (FSDP2 cannot
            be undone: build a fresh model), or ``units`` is refused (:func:`sharding_units`).
    """
    record = model.__dict__.get(_RECORD)
    if record is not None:
        if (record.stage, record.mesh_shape) != (stage, tuple(mesh_shape)):
            raise StrategyError(
                f"sharding: the model was already sharded at stage {record.stage} over a "
                f"{record.mesh_shape} mesh and is now asked for stage {stage} over "
                f"{tuple(mesh_shape)}; sharding cannot be undone: wrap a fresh model")
        if record.units != tuple(units):
            raise StrategyError(
                f"sharding: the model was already sharded with sharding_configs['units'] = "
                f"{list(record.units)} and is now asked for {list(units)}; sharding cannot be "
                f"undone: wrap a fresh model")
        return record
    from torch.distributed.fsdp import fully_shard  # on use, as ZeroRedundancyOptimizer

    broadcast_from_rank0(model)  # start from rank 0's initialisation, as DDP does

    record = ShardRecord(stage, tuple(mesh_shape), units=tuple(units))
    for name, p in model.named_parameters():
        record.names[p] = name
    mesh = device_mesh(device, mesh_shape)
    reshard = stage == 3
    # innermost first: a unit nested in another (named by the user) is sharded before it, so
    # the outer unit's parameters are only its own
    chosen = sharding_units(model, units)
    for unit in sorted(chosen, key=lambda u: -_depth(u, chosen)):
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    model.__dict__[_RECORD] = record
    return record


def broadcast_from_rank0(model: nn.Module) -> None:
    """Give every rank rank 0's parameters and buffers, in place, as
    ``DistributedDataParallel`` does when it wraps a module.

    Ranks seeded apart (nanoGPT seeds ``1337 + rank``) build different initial weights; FSDP2
    keeps each rank's own shard of its own weights, so without this the sharded model would
    start from a mix of every rank's initialisation. Every rank must call it (a collective
    over the whole world); a parameter tied to another is sent once.

    Args:
        model: the user's module, before it is sharded.

    Example::

        broadcast_from_rank0(model)   # on every rank, then fully_shard
    """
    tensors = list(model.parameters()) + list(model.buffers())
    with torch.no_grad():
        works = [dist.broadcast(t.data, src=0, group=_init_group(t), async_op=True)
                 for t in tensors]
        for work in works:
            work.wait()


def _init_group(tensor: torch.Tensor) -> Any:
    """The world group that can send ``tensor``: the default one, or a gloo group for a
    host tensor when the default backend is a device's only (nccl)."""
    if tensor.device.type == "cpu" and "gloo" not in str(dist.get_backend()):
        return _own_group("init")
    return None


def gathered_bytes(model: nn.Module) -> int:
    """Bytes of the sharded ``model``'s parameters gathered (unsharded) on this rank now: the
    figure stage 3 keeps down to the root and one unit (two when FSDP2 prefetches the next)
    during a forward. Reads FSDP2's per-unit parameter state, a measurement for tests and
    benchmarks; 0 for a module that is not sharded.

    Args:
        model: a module :func:`shard_in_place` sharded.
    """
    from torch.distributed.fsdp import FSDPModule

    seen, total = set(), 0
    for module in model.modules():
        group = module._get_fsdp_state()._fsdp_param_group if isinstance(
            module, FSDPModule) else None
        for param in group.fsdp_params if group is not None else ():
            for tensor in param.all_gather_outputs:
                storage = tensor.untyped_storage()
                if storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    total += storage.size()
    return total


def _depth(unit: nn.Module, chosen: list[nn.Module]) -> int:
    """How many of the ``chosen`` units hold ``unit`` (0: an outermost one)."""
    return sum(1 for other in chosen if other is not unit
               and any(m is unit for m in other.modules()))


def eval_guard(model: nn.Module, stage: int, timeout: float) -> Callable[[], ContextManager]:
    """A forward-context factory: in eval mode, wait (at most ``timeout`` s) until every rank
    has come to an eval forward before the sharded one runs.

    A sharded forward gathers parameters, a collective. Run on one rank alone (evaluation on
    rank 0), its all-gathers would pair with the other ranks' training collectives: wrong
    outputs, then a crash or a wait for ever. The guard turns that into an error naming the ranks
    that did not come: through the job's store (:meth:`fleetx.comm.groups.ProcessGroups.enter`),
    within a second or two when they went on into a collective (the next training step's
    gathers) or stopped, else after ``timeout``; on a monitored barrier of its own gloo group
    (after ``timeout``) where fleetx did not join the job itself. Training forwards run on every
    rank anyway and are not checked.

    Args:
        model: the sharded module; its ``training`` flag says whether a forward is an eval one.
        stage: the sharding stage (named in the error).
        timeout: seconds to wait for the other ranks (``FLEETX_TIMEOUT``).

    Example::

        ctx.forward_contexts.append(eval_guard(model, 3, timeout=default_timeout()))

    Raises:
        CommError: (when the context is entered) a rank did not run an eval forward in time.
    """
    group = _own_group("eval")

    @contextlib.contextmanager
    def guard() -> Iterator[None]:
        if not model.training:
            comm = current()
            if comm is not None:  # the job's store: a rank gone elsewhere is named at once
                try:
                    comm.enter("model.forward", timeout=timeout)
                except CommError as err:
                    raise _eval_alone(stage, err.missing, err.cause) from err
            else:
                _eval_barrier(group, stage, timeout)
        yield
    return guard


def _eval_barrier(group: Any, stage: int, timeout: float) -> None:
    """Without fleetx's communicator: a monitored barrier (named after ``timeout`` only)."""
    try:
        dist.monitored_barrier(group, timeout=timedelta(seconds=timeout), wait_all_ranks=True)
    except RuntimeError as err:
        # Rank 0 names the ranks that did not come; the others wait for rank 0 only.
        found = re.search(r"Ranks? ([\d, ]+) failed", str(err))
        missing = tuple(int(r) for r in found.group(1).split(",") if r.strip()) if found else (0,)
        raise _eval_alone(stage, missing, f"they did not come within {timeout:.0f} s") from err


def _eval_alone(stage: int, missing: tuple, cause: str) -> CommError:
    """The error of an eval forward the ``missing`` ranks did not come to. It names them, also
    for fleetrun's ABORT line (its blame), not the rank that evaluates."""
    who = f"rank(s) {', '.join(map(str, missing))}"
    error = CommError(
        f"sharding stage {stage}: a forward in eval mode gathers the sharded parameters, a "
        f"collective every rank must run, and {who} did not run one ({cause}; FLEETX_TIMEOUT "
        f"bounds the wait); evaluate on every rank, or on one rank with a plain copy that every "
        f"rank makes: plain = fleet.consolidated_model(model); if rank == 0: evaluate(plain)")
    error._fleetx_blame = Blame(dist.get_rank(), os.getpid(), missing,
                                f"{who} did not come to the eval forward of sharding stage "
                                f"{stage} that rank {dist.get_rank()} ran")
    return error


def _own_group(purpose: str) -> Any:
    """A gloo group over the whole world for ``purpose`` alone, made once per default group
    (every rank makes it, in the same order); its own tags never meet other collectives'."""
    key = (id(dist.group.WORLD), purpose)
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(backend="gloo")
    return _GROUPS[key]


def _cached(optimizer: torch.optim.Optimizer, key: tuple,
            build: Callable[[], torch.optim.Optimizer]) -> torch.optim.Optimizer:
    """The optimizer built for ``optimizer`` under ``key``, built once (a re-plan reuses it
    with its state).

    Raises:
        StrategyError: ``optimizer`` already holds state (it would be dropped).
    """
    built = optimizer.__dict__.get(_BUILT)
    if built is not None and built[0] == key:
        return built[1]
    if optimizer.state:
        raise StrategyError(
            f"sharding: the {type(optimizer).__name__} given to fleet.distributed_optimizer "
            f"already holds state (it has stepped, or a state was loaded into it); sharding "
            f"rebuilds it over the sharded parameters and would drop that state: create the "
            f"optimizer fresh, and load a saved state with opt.load_state_dict once both "
            f"fleet.distributed_model and fleet.distributed_optimizer were called")
    new = build()
    optimizer.__dict__[_BUILT] = (key, new)
    return new


def _constructor_defaults(optimizer: torch.optim.Optimizer) -> dict:
    """``optimizer.defaults`` less the keys its class's constructor does not take.

    A class may record a default it sets itself and refuses as an argument (torch 2.13's
    ``AdamW`` records ``decoupled_weight_decay=True``): passing every default back would fail.
    The groups carry every default of their own, so nothing the constructor drops is lost.

    Example:
        >>> w = torch.optim.AdamW([nn.Parameter(torch.ones(1))])
        >>> "decoupled_weight_decay" in _constructor_defaults(w)
        False
    """
    params = inspect.signature(type(optimizer).__init__).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return dict(optimizer.defaults)
    accepted = {p.name for p in params}
    return {k: v for k, v in optimizer.defaults.items() if k in accepted}


def _same_kind(optimizer: torch.optim.Optimizer, groups: list[dict]) -> torch.optim.Optimizer:
    """A new optimizer of ``optimizer``'s class and defaults over ``groups`` (each group keeps
    its own values: weight decay on some groups only stays so).

    Raises:
        StrategyError: the class does not accept its own defaults as keyword arguments.
    """
    return _rebuilt(optimizer, lambda **defaults: type(optimizer)(groups, **defaults))


def _rebuilt(optimizer: torch.optim.Optimizer, make: Callable[..., Any]) -> Any:
    """``make(**defaults)`` with the defaults ``optimizer``'s constructor takes.

    Raises:
        StrategyError: the constructor refused them (a ``TypeError``).
    """
    try:
        return make(**_constructor_defaults(optimizer))
    except TypeError as err:
        raise StrategyError(
            f"sharding: cannot rebuild {type(optimizer).__name__} over the sharded parameters "
            f"from its defaults ({err}); its constructor must accept its own defaults as "
            f"keyword arguments") from None


def rebound_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module,
                      record: ShardRecord) -> torch.optim.Optimizer:
    """``optimizer`` itself when it already holds the sharded parameters, else a new one of the
    same class, groups and hyperparameters over them (old parameter -> name -> new parameter).

    Args:
        optimizer: the user's optimizer, built before or after the model was sharded.
        model: the sharded module.
        record: the module's :class:`ShardRecord` from :func:`shard_in_place`.

    Raises:
        StrategyError: the optimizer holds a parameter that is not the model's, or already
            holds state.
    """
    current = dict(model.named_parameters())
    mine = {id(p) for p in current.values()}
    groups, moved = [], False
    for index, group in enumerate(optimizer.param_groups):
        params = []
        for p in group["params"]:
            name = None if id(p) in mine else record.names.get(p)
            if id(p) not in mine and name is None:
                raise StrategyError(
                    f"sharding: param group {index} of the {type(optimizer).__name__} holds a "
                    f"parameter of shape {tuple(p.shape)} that is not a parameter of the model "
                    f"given to fleet.distributed_model; build the optimizer over that model's "
                    f"parameters only")
            params.append(p if name is None else current[name])
            moved = moved or name is not None
        groups.append(dict(group, params=params))
    if not moved:
        return optimizer
    key = ("fsdp", id(model), record.stage)
    return _cached(optimizer, key, lambda: _same_kind(optimizer, groups))


def sharding_group(groups: list[list[int]], rank: int) -> Any:
    """This rank's process group among ``groups`` (the sharding groups); None (the default
    group) when there is one group. Every rank creates every group, once per default group.

    Args:
        groups: the ranks of each sharding group (every rank is in exactly one).
        rank: this process's global rank.
    """
    if len(groups) == 1:
        return None
    key = (id(dist.group.WORLD), tuple(map(tuple, groups)))
    if key not in _GROUPS:
        made = [dist.new_group(ranks) for ranks in groups]
        _GROUPS[key] = next(g for g, ranks in zip(made, groups) if rank in ranks)
    return _GROUPS[key]


def zero_optimizer(optimizer: torch.optim.Optimizer,
                   group: Optional[Any]) -> "ZeroRedundancyOptimizer":
    """A ``ZeroRedundancyOptimizer`` over ``group`` with ``optimizer``'s class, parameter groups
    and defaults (built once per user optimizer; a re-plan reuses it).

    Args:
        optimizer: the user's optimizer (no state yet).
        group: the sharding group (None: the default group), see :func:`sharding_group`.

    Raises:
        StrategyError: the user's optimizer already holds state, or its class does not accept
            its own defaults as keyword arguments.
    """
    # the engines are imported when a plan shards, not with fleetx: a process that never
    # shards does not pay for them at start-up
    from torch.distributed.optim import ZeroRedundancyOptimizer

    groups = [dict(g) for g in optimizer.param_groups]
    key = ("zero", id(group), tuple(id(p) for g in groups for p in g["params"]))
    return _cached(optimizer, key, lambda: _rebuilt(optimizer, lambda **defaults: (
        ZeroRedundancyOptimizer(groups, optimizer_class=type(optimizer), process_group=group,
                                **defaults))))
