"""Training checkpoints of collective jobs: model, optimizer and strategy state.

The tensors travel through ``torch.distributed.checkpoint`` (DCP), which writes each rank's
share and re-shards on load, so a checkpoint written by N processes (plain, data parallel,
FSDP2-sharded or with a ZeRO optimizer) loads into M processes under any of those. The files
are committed with this package's manifest (:class:`~fleetx.checkpoint.manifest.SaveWriter`):
every file's SHA-256, one save id, an atomic rename as commit point.

A save is two steps: :func:`stage` (the collective part, in the call: the save id, this rank's
share of the state, copied to CPU memory for an asynchronous save) and :func:`write` (the
files, their hashes and the commit, whose collectives run on the group the stage names, so that
it may run on a background thread). Per-rank state to save goes into the staged record.

Layout of the save folder (``path/save-<id>/``)::

    .metadata, __<r>_0.distcp     DCP: "model.<name>", "optim.state.<name>.<key>",
                                  "optim.param_groups.<name>.<key>" (names as in
                                  ``named_parameters()``), and each rank's own tensors
                                  "fleetx/rank<r>/..." (strategy tensors, gradients, and
                                  its copy of each replicated tensor whose copies differ
                                  between ranks)
    fleetx.json                   rank 0: format, world size, applied strategies, ``extra``
    strategy-rank<r>.json         rank r: each strategy's state, tensors as references, and
                                  the position of each data loader (``loaders``)

What is global and what is per rank:

* parameters, optimizer moments and step counts, learning rates: global; they load exactly at
  any world size and under any strategy (DCP re-shards them), sharded or not. A sharded job
  writes each of them once: a ZeRO partition's state by the rank that owns it, FSDP2's
  DTensors shard by shard. When the ranks' copies of a replicated tensor differ at the save
  (Local SGD between averages, its momenta), each rank also saves its own copy: a job that
  resumes at the same world size under the same strategies loads each rank's own, any other
  (another size, other strategies, a sharded job) rank 0's on every rank.
* strategy state (loss scale, Local SGD and adaptive Local SGD counters, gradient-merge
  micro-step, DGC step, traffic counters) and gradients still being accumulated (gradient
  merge between updates): saved by every rank. At the same world size each rank loads its
  own. At another world size every rank loads rank 0's numbers, and per-rank tensors (DGC
  residuals and momentum, accumulated gradients) are dropped: DGC rebuilds its buffers as it
  does when it starts, and gradients start from none, so save at an update boundary
  (``minimize`` returned True) to resume at another world size without losing micro-steps.
  Under FSDP2 (sharding stages 2 and 3) the gradients of an unfinished merge are kept
  outside the sharded parameters, so a save there is refused.
* data loader positions (``fleet.distributed_loader``): per rank, in the loaders' creation
  order. At the same world size each rank loads its own (torchdata's state with it); at another
  every rank loads rank 0's epoch and sample count, which all saving ranks must share, and the
  new ranks split the rest of the epoch (:mod:`fleetx.data.loader`).
* strategies applied now but absent from the checkpoint keep their fresh state; state of
  strategies not applied now is ignored, and so is state a strategy creates only with the
  engine at the first forward (data parallel's traffic counters, a diagnostic) when loading
  before it.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch import nn
from torch.distributed.tensor import distribute_tensor
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict,
                                                     set_model_state_dict,
                                                     set_optimizer_state_dict)

from fleetx.checkpoint.api import CheckpointError, FileEntry, Manifest
from fleetx.checkpoint.manifest import Checkpoint, SaveWriter, file_sha256
from fleetx.checkpoint.records import decode, encode, local, tensor_templates
from fleetx.optim.wrapper import OptimizerWrapper

__all__ = ["TrainingState", "StagedSave", "save", "stage", "write", "load", "FORMAT"]

log = logging.getLogger("fleetx.checkpoint")

#: format of ``fleetx.json``; a reader refuses any other
FORMAT = 1
META = "fleetx.json"
# Optimizer state keyed by parameter name ("state.<name>.exp_avg"), not by group index: ranks
# owning different parameters (ZeRO) write different keys, and any layout reads them back.
_OPTIM = StateDictOptions(flatten_optimizer_state_dict=True)


@dataclass
class TrainingState:
    """What a training checkpoint saves from, and loads into, in one process.

    Args:
        module: the user's module (plain, or sharded in place by FSDP2).
        optimizer: the optimizer over its parameters (fleetx wrappers are looked through; a
            ``ZeroRedundancyOptimizer`` contributes its local partition), or None.
        strategy_state: each applied strategy's state by name, objects with ``state_dict`` /
            ``load_state_dict`` (the training context's ``state``).
        rank: this process's rank.
        world_size: processes in the job (collectives run on the default group when > 1).
        strategies: names of the applied strategies, recorded in the checkpoint.
        steps: optimizer steps taken so far, recorded by a save and set by a load (0 for a
            checkpoint that did not record them).
        loaders: the data loaders whose position is saved, in creation order (objects with
            JSON-able ``state_dict`` / ``load_state_dict``: ``fleet.distributed_loader``'s).
        saved_loaders: set by a load: how many loader positions the checkpoint held.
    """

    module: nn.Module
    optimizer: Optional[torch.optim.Optimizer] = None
    strategy_state: Optional[dict] = None
    rank: int = 0
    world_size: int = 1
    strategies: tuple = ()
    steps: int = 0
    loaders: tuple = ()
    saved_loaders: int = 0


@dataclass
class StagedSave:
    """One rank's part of a save, held in memory: what :func:`write` puts into the files.

    :func:`stage` makes it in the call (the collective part); :func:`write` writes, hashes and
    commits it, in the call (a synchronous save) or on a background thread (an asynchronous
    one, whose tensors are then copies, since training changes the live ones in place).

    Attributes:
        writer: the files of the save (one save id on every rank).
        state: the tensors DCP writes (model, optimizer, this rank's own tensors).
        record: this rank's ``strategy-rank<r>.json`` (tensors as references into ``state``).
        meta: ``fleetx.json`` on rank 0, None on the others.
        rank, world_size: this process in the job.
        group: the process group of the write's collectives (None: the default group).
        on_commit: run on rank 0 once the manifest is committed (keep_last's rotation).
    """

    writer: SaveWriter
    state: dict
    record: dict
    meta: Optional[dict]
    rank: int = 0
    world_size: int = 1
    group: Any = None
    on_commit: Optional[Callable[[], None]] = None


def save(path: str, ts: TrainingState, extra: Optional[Mapping] = None) -> Manifest:
    """Save ``ts`` into folder ``path``, replacing its checkpoint atomically (every rank calls).

    The same as ``write(stage(path, ts, extra))``: nothing is copied, the files are written
    from the live tensors before it returns.

    Args:
        path: the checkpoint folder (created if needed).
        ts: what to save.
        extra: a JSON-able dict stored beside (``{"step": 500}``), returned by :func:`load`.

    Returns:
        The committed manifest.

    Raises:
        TypeError: ``extra`` is not a dict that JSON can encode (nothing is written).
        CheckpointError: a file cannot be written or committed (the previous checkpoint stays).
    """
    return write(stage(path, ts, extra))


def stage(path: str, ts: TrainingState, extra: Optional[Mapping] = None,
          stager: Any = None, group: Any = None) -> StagedSave:
    """The collective part of a save (every rank calls): check, join the save rank 0 starts,
    and take this rank's share of the state, copied to CPU memory when a ``stager`` is given.

    Args:
        path: the checkpoint folder (created if needed).
        ts: what to save.
        extra: a JSON-able dict stored beside.
        stager: a ``torch.distributed.checkpoint.staging`` stager whose ``stage`` returns a
            copy (kept between saves, it reuses its buffers), or None to write the live tensors.
        group: the process group :func:`write` will use (None: the default group).

    Raises:
        TypeError: ``extra`` is not a JSON-able dict (nothing is written).
        CheckpointError: sharding stage 2 or 3 holds unsynchronised gradients, or the folder
            cannot be created.
    """
    extra = _checked_extra(extra)
    _refuse_unreduced_grads(ts.module)
    writer = _joined_writer(path, ts)
    tensors: dict[str, torch.Tensor] = {}  # encode() copies each of these
    prefix = f"fleetx/rank{ts.rank}/"
    record = {"strategies": encode(_strategy_dicts(ts), prefix + "strategy", tensors),
              "grads": encode(_local_grads(ts.module), prefix + "grad", tensors),
              "loaders": encode([loader.state_dict() for loader in ts.loaders],
                                prefix + "loader", tensors)}
    state: dict[str, Any] = {"model": get_model_state_dict(ts.module)}
    optimizer = _torch_optimizer(ts.optimizer)
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(ts.module, optimizer, options=_OPTIM)
    if stager is not None:
        state = stager.stage(state)
    state.update(tensors)
    meta = {"format": FORMAT, "world_size": ts.world_size, "strategies": list(ts.strategies),
            "extra": extra, "steps": ts.steps} if ts.rank == 0 else None
    return StagedSave(writer, state, record, meta, ts.rank, ts.world_size, group)


def write(staged: StagedSave) -> Manifest:
    """Write, hash and commit a staged save (every rank calls; collectives on ``staged.group``
    only, so it may run on a background thread beside training on the default group).

    The manifest is committed by rank 0 after every rank's files are written and hashed: a
    rank that fails or dies before that leaves the previous checkpoint in place.

    Returns:
        The committed manifest.

    Raises:
        CheckpointError: a file cannot be written or committed, on any rank (the same error on
            every rank).
    """
    s = staged
    prefix = f"fleetx/rank{s.rank}/"
    record = dict(s.record, replica=_replica(s, s.state, prefix + "replica"))
    error = _attempt(lambda: _write_files(s, record))
    _raise_any(s, error)  # every file is written before anyone hashes the folder
    share, error = [], None
    try:
        share = _hash_share(s.writer.folder, s.rank, s.world_size)
    except OSError as e:
        error = (f"cannot hash the files of {s.writer.folder}: {e}", s.writer.folder)
    entries = _gather(s, (share, error))
    manifest, error = None, next((e for _, e in entries if e is not None), None)
    if s.rank == 0 and error is None:
        s.writer.add(FileEntry(*e) for part, _ in entries for e in part)
        try:
            manifest = s.writer.commit()
        except CheckpointError as e:
            error = (str(e), e.path)
        if manifest is not None and s.on_commit is not None:
            try:
                s.on_commit()
            except Exception as e:  # noqa: BLE001 - committed: a failed clean-up costs space
                log.warning("checkpoint %s: after the commit: %s", s.writer.dirname, e)
    _raise_any(s, error)
    return manifest if manifest is not None else Checkpoint(s.writer.dirname).manifest


def _write_files(s: StagedSave, record: dict) -> None:
    with _quiet_single_process(s):
        dcp.save(s.state, storage_writer=dcp.FileSystemWriter(s.writer.folder),
                 process_group=s.group, no_dist=s.world_size <= 1)
    s.writer.write_json(_state_file(s.rank), record)
    if s.meta is not None:
        s.writer.write_json(META, s.meta)


def _attempt(fn: Callable[[], None]) -> Optional[tuple]:
    """Run ``fn``; a failure is returned as ``(message, path)`` for :func:`_raise_any`, so
    that every rank learns of it instead of waiting for the failed one."""
    try:
        fn()
    except CheckpointError as e:
        return str(e), e.path
    except CheckpointException as e:  # a BaseException, the same on every rank
        causes = "; ".join(f"rank {rank}: {type(exc).__name__}: {str(exc).strip()}"
                           for rank, (exc, _) in sorted(e.failures.items()))
        return f"torch.distributed.checkpoint could not write the files ({causes})", None
    except (OSError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}", None
    return None


def load(path: str, ts: TrainingState) -> dict:
    """Load the checkpoint in folder ``path`` into ``ts`` (every rank calls).

    Every file is verified against the manifest before anything is loaded (the ranks share
    the hashing); see the module docstring for what loads at another world size.

    Returns:
        The ``extra`` dict given to :func:`save` (``ts.steps`` is set to the steps it recorded).

    Raises:
        CheckpointError: no checkpoint, a damaged or missing file ("checksum mismatch" naming
            it; nothing is loaded), another format, or a parameter of the model that the
            checkpoint does not hold (named).
    """
    ckpt = _verified(path, ts)
    meta = ckpt.read_json(META)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{ckpt.path(META)}: training checkpoint format "
                              f"{meta.get('format') if isinstance(meta, dict) else meta!r}, "
                              f"this version reads {FORMAT}", ckpt.path(META))
    same = meta["world_size"] == ts.world_size
    record = ckpt.read_json(_state_file(ts.rank if same else 0))
    _load_loaders(ckpt, ts, meta["world_size"], record.get("loaders") or [])
    reader = dcp.FileSystemReader(ckpt.folder)
    available = reader.read_metadata().state_dict_metadata
    optimizer = _torch_optimizer(ts.optimizer)
    with _grads_set_aside(ts.module):
        state = {"model": get_model_state_dict(ts.module)}
        _check_model_keys(ckpt, state["model"], available)
        if optimizer is not None:
            state["optim"] = _optimizer_template(ts.module, optimizer, available)
        # Each rank takes its own copy of diverging replicas only when it resumes the job that
        # saved them (same world size and strategies); a job that keeps the ranks' copies equal
        # (data parallel, ZeRO) or shards them (FSDP2) takes rank 0's on every rank.
        own = (same and list(ts.strategies) == meta.get("strategies")
               and not any(_is_sharded(v) for part in state.values() for v in part.values()))
        replica = (record if own else ckpt.read_json(_state_file(0))).get("replica")
        refs = tensor_templates(dict(record if same else {}, replica=replica), available)
        with _quiet_single_process(ts):
            dcp.load({**state, **refs}, storage_reader=reader, no_dist=ts.world_size <= 1)
        _put_replica(state, decode(replica or {}, refs, True))
        set_model_state_dict(ts.module, state["model"])
        if optimizer is not None:
            _set_optimizer(ts.module, optimizer, state["optim"], ts.optimizer)
    _restore_grads(ts.module, decode(record.get("grads", {}), refs, same))
    _load_strategies(ts, decode(record.get("strategies", {}), refs, same))
    ts.steps = int(meta.get("steps", 0))
    return meta.get("extra") or {}


# -- saving helpers ---------------------------------------------------------------------------
def _checked_extra(extra: Any) -> dict:
    if extra is None:
        return {}
    if not isinstance(extra, Mapping):
        raise TypeError(f"save_checkpoint(extra=...) expects a dict, got {type(extra).__name__}")
    try:
        return json.loads(json.dumps(dict(extra)))
    except (TypeError, ValueError) as e:
        raise TypeError(f"save_checkpoint(extra=...) must be JSON-able: {e}") from None


def _joined_writer(path: str, ts: TrainingState) -> SaveWriter:
    """Rank 0 starts a save; the others join it under the id rank 0 broadcasts."""
    writer = SaveWriter(path) if ts.rank == 0 else None
    if ts.world_size > 1:
        box = [writer.save_id if writer is not None else None]
        dist.broadcast_object_list(box, src=0)
        if writer is None:
            writer = SaveWriter(path, box[0])
    return writer


def _state_file(rank: int) -> str:
    return f"strategy-rank{rank}.json"


def _strategy_dicts(ts: TrainingState) -> dict:
    return {name: value.state_dict() if hasattr(value, "state_dict") else value
            for name, value in (ts.strategy_state or {}).items()}


def _replica(s: StagedSave, state: dict, key: str) -> Any:
    """This rank's copy of the replicated tensors whose copies differ between ranks, or None.

    DCP writes a tensor that several ranks hold once, as if they all held the same. They do
    under data parallel, but not under Local SGD between averages, nor its momenta ever: then
    every rank also saves its own copy of those, to load back at the same world size (rank
    0's at another). A tensor only one rank holds (its share of a ZeRO partition) is not
    replicated, and a DTensor (FSDP2) is written shard by shard. The copies are added to
    ``state`` under ``key``."""
    if s.world_size <= 1:  # one copy of everything: nothing can differ
        return None
    plain = {f"{section}.{k}": v for section, part in state.items()
             if isinstance(part, Mapping) for k, v in part.items()
             if isinstance(v, torch.Tensor) and not hasattr(v, "to_local")}
    digests = {name: hashlib.sha256(t.detach().cpu().reshape(-1).view(torch.uint8).numpy())
               .hexdigest() for name, t in plain.items()}
    seen: dict[str, set] = {}
    for part in _gather(s, digests):
        for name, digest in part.items():
            seen.setdefault(name, set()).add(digest)
    differ = {name: t for name, t in plain.items() if len(seen[name]) > 1}
    return encode(differ, key, state) if differ else None


def _put_replica(state: dict, copies: Mapping) -> None:
    """Put saved copies of replicated tensors in place of what DCP loaded (one rank's copy).

    A tensor this rank does not hold (another rank's share of a ZeRO partition) is skipped; a
    DTensor takes its shard of the copy, which is then rank 0's on every rank, as shards of
    different copies would not make one tensor."""
    for key, value in copies.items():
        section, name = key.split(".", 1)
        held = state.get(section, {}).get(name)
        if not isinstance(held, torch.Tensor):
            continue
        if _is_sharded(held):
            value = distribute_tensor(value.to(held.to_local().device, held.dtype),
                                      held.device_mesh, held.placements, src_data_rank=None)
        state[section][name] = value


def _is_sharded(tensor: Any) -> bool:
    return hasattr(tensor, "device_mesh")


def _refuse_unreduced_grads(module: nn.Module) -> None:
    """Refuse to save while FSDP2 holds gradients accumulated without synchronisation.

    Between the micro-steps of a gradient merge (or inside ``model.no_sync()``), FSDP2 keeps
    each rank's gradients unsharded inside its own parameter records, not on the sharded
    parameters a checkpoint reads: saving would drop them, and resuming would silently differ.
    """
    from torch.distributed.fsdp import FSDPModule
    pending = []
    for sub in module.modules():
        group = sub._get_fsdp_state()._fsdp_param_group if isinstance(sub, FSDPModule) else None
        for fp in getattr(group, "fsdp_params", ()):
            unsharded = getattr(fp, "_unsharded_param", None)
            if fp.unsharded_accumulated_grad is not None or getattr(unsharded, "grad", None) \
                    is not None:
                pending.append(fp._param_fqn or type(sub).__name__)
    if pending:
        raise CheckpointError(
            f"cannot save while sharding stage 2 or 3 (FSDP2) holds gradients accumulated "
            f"without synchronisation ({len(pending)} parameters, first {pending[0]!r}): they "
            f"are kept outside the sharded parameters and would be lost; save where "
            f"minimize() returned True (after the update that ends a gradient merge)")


def _local_grads(module: nn.Module) -> dict:
    """Gradients held now (accumulated between updates), this rank's part of each."""
    return {name: local(p.grad) for name, p in module.named_parameters() if p.grad is not None}


def _hash_share(folder: str, rank: int, world_size: int) -> list:
    """(relative path, SHA-256, size) of this rank's share of the folder's files."""
    names = sorted(os.path.relpath(os.path.join(root, f), folder)
                   for root, _, files in os.walk(folder) for f in files)
    share = []
    for rel in names[rank::world_size]:
        with open(os.path.join(folder, rel), "rb") as f:
            digest, size = file_sha256(f)
        share.append((rel.replace(os.sep, "/"), digest, size))
    return share


# -- loading helpers --------------------------------------------------------------------------
def _verified(path: str, ts: TrainingState) -> Checkpoint:
    """The checkpoint, every file's hash checked (each rank its share; any failure fails all)."""
    error = None
    try:
        ckpt = Checkpoint(path)
        for rel in ckpt.names()[ts.rank::max(ts.world_size, 1)]:
            ckpt.verify(rel)
    except CheckpointError as e:
        error = (str(e), e.path)
    _raise_any(ts, error)
    return ckpt


def _check_model_keys(ckpt: Checkpoint, model: dict, available: Mapping) -> None:
    missing = [k for k in model if f"model.{k}" not in available]
    if missing:
        held = sorted(k[len("model."):] for k in available if k.startswith("model."))
        raise CheckpointError(f"checkpoint {ckpt.dirname} holds no parameter {missing[0]!r} of "
                              f"the model ({len(missing)} missing; it holds {held[:8]})",
                              ckpt.dirname)


def _optimizer_template(module: nn.Module, optimizer: torch.optim.Optimizer,
                        available: Mapping) -> dict:
    """This rank's optimizer state dict to load into, limited to what the checkpoint holds
    (a checkpoint saved before the first step has learning rates but no moments)."""
    template = get_optimizer_state_dict(module, optimizer, options=_OPTIM)
    return {k: v for k, v in template.items() if f"optim.{k}" in available}


def _set_optimizer(module: nn.Module, optimizer: torch.optim.Optimizer, state: dict,
                   given: Any) -> None:
    held = {k.split(".", 1)[1].rsplit(".", 1)[0] for k in state if k.startswith("state.")}
    set_optimizer_state_dict(module, optimizer, state, options=_OPTIM)
    # Parameters without moments in the checkpoint (saved before their first step) start
    # without any, as they did then, rather than with the zeros DCP initialised.
    for name, param in module.named_parameters():
        if name not in held:
            optimizer.state.pop(param, None)
    zero = _zero_of(given)
    if zero is not None:  # the partition's learning rates are copied back at every step
        zero._sync_param_groups(optimizer.param_groups, zero.param_groups)


@contextlib.contextmanager
def _grads_set_aside(module: nn.Module) -> Iterator[None]:
    # DCP creates missing optimizer state with a zero-gradient step, and silently skips it when
    # any parameter holds a gradient: then nothing would be loaded into the optimizer.
    grads = {p: p.grad for p in module.parameters()}
    for p in grads:
        p.grad = None
    try:
        yield
    finally:
        for p, g in grads.items():
            p.grad = g


def _restore_grads(module: nn.Module, grads: Mapping) -> None:
    for name, param in module.named_parameters():
        grad = grads.get(name)
        if grad is None:
            param.grad = None
        elif hasattr(param, "to_local"):  # a sharded parameter: the grad is this rank's shard
            param.grad = param.new_zeros(param.shape)  # a DTensor laid out as the parameter
            param.grad.to_local().copy_(grad)
        else:
            param.grad = grad.to(param.device, param.dtype)


def _load_strategies(ts: TrainingState, saved: Mapping) -> None:
    current = ts.strategy_state if ts.strategy_state is not None else {}
    for name, value in saved.items():
        target = current.get(name)
        if hasattr(target, "load_state_dict"):
            target.load_state_dict(value)
        elif name in current:
            current[name] = value


def _load_loaders(ckpt: Checkpoint, ts: TrainingState, saved_world: int, saved: list) -> None:
    """Give each data loader its saved position (in creation order), before anything else loads.

    At the same world size each rank's loaders take its own states; at another, rank 0's, whose
    positions every rank of the saving job must share (the ranks consume the epoch in
    lock-step), so that the new ranks can split the rest of the epoch among them."""
    ts.saved_loaders = len(saved)
    if not ts.loaders or not saved:
        if ts.loaders:
            warnings.warn(f"{ckpt.dirname} holds no data loader position (saved without "
                          f"fleet.distributed_loader): the {len(ts.loaders)} loader(s) start "
                          f"at epoch 0", stacklevel=4)
        return
    if len(saved) != len(ts.loaders):
        raise CheckpointError(f"{ckpt.dirname} holds the position of {len(saved)} data "
                              f"loader(s), this job built {len(ts.loaders)} with "
                              f"fleet.distributed_loader before the load: build the same "
                              f"loaders, in the same order, as the job that saved", ckpt.dirname)
    if saved_world != ts.world_size:
        _refuse_uneven_positions(ckpt, saved_world)
    for loader, state in zip(ts.loaders, saved):
        try:
            loader.load_state_dict(state)
        except ValueError as e:
            raise CheckpointError(f"{ckpt.dirname}: {e}", ckpt.dirname) from None


def _refuse_uneven_positions(ckpt: Checkpoint, saved_world: int) -> None:
    positions = [[(s.get("epoch"), s.get("position")) for s in
                  ckpt.read_json(_state_file(r)).get("loaders") or []] for r in range(saved_world)]
    for r, mine in enumerate(positions):
        if mine != positions[0]:
            raise CheckpointError(
                f"{ckpt.dirname}: the saving ranks' data loaders stood at different positions "
                f"(rank 0 at (epoch, sample) {positions[0]}, rank {r} at {mine}), so the rest "
                f"of the epoch cannot be split among another number of ranks: resume at world "
                f"size {saved_world}", ckpt.dirname)


# -- optimizers and collectives ---------------------------------------------------------------
def _zero_of(optimizer: Any) -> Any:
    while isinstance(optimizer, OptimizerWrapper):
        optimizer = optimizer.inner
    from torch.distributed.optim import ZeroRedundancyOptimizer
    return optimizer if isinstance(optimizer, ZeroRedundancyOptimizer) else None


def _torch_optimizer(optimizer: Any) -> Optional[torch.optim.Optimizer]:
    """The optimizer that holds the state: fleetx wrappers looked through, and a ZeRO
    optimizer's local partition (DCP refuses the ZeRO object; its partition is an ordinary
    optimizer over the parameters this rank owns)."""
    while isinstance(optimizer, OptimizerWrapper):
        optimizer = optimizer.inner
    zero = _zero_of(optimizer)
    return zero.optim if zero is not None else optimizer


@contextlib.contextmanager
def _quiet_single_process(ts: Any) -> Iterator[None]:
    # DCP warns that it assumes a single process when no process group exists: that is the
    # intent of a one-process job, not news to its user.
    with warnings.catch_warnings():
        if ts.world_size <= 1:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _gather(peers: Any, value: Any) -> list:
    """Every rank's ``value`` (``peers``: a TrainingState or StagedSave; its ``group`` if it
    has one, else the default group)."""
    if peers.world_size <= 1:
        return [value]
    out: list = [None] * peers.world_size
    dist.all_gather_object(out, value, group=getattr(peers, "group", None))
    return out


def _raise_any(peers: Any, error: Optional[tuple]) -> None:
    """Raise on every rank the first failing rank's ``(message, path)``, so that no rank goes
    on (and waits) past a failure on another."""
    errors = [e for e in _gather(peers, error) if e is not None]
    if errors:
        raise CheckpointError(*errors[0])
