"""One consolidated file of a trained model's weights, under the plain model's keys, from any
layout (``fleet.export_model``, ``DistributedModel.save_pretrained``).

What every rank holds is put back together in three steps, all collectives:

* each tensor is made full where it lives: a ``DTensor`` shard (sharding stages 2 and 3) by
  ``full_tensor()``, a shard of a tensor-parallel layer by the layer's own ``gathered(name)``
  (an all-gather over its model-parallel group along its ``split_dims``, the contract of
  :mod:`fleetx.parallel.layers`), a replicated tensor as it is;
* the keys are those of ``module.state_dict()`` (a pipeline stage's are the global indexes of
  the unsplit ``nn.Sequential``), and the lowest rank that holds a key sends it to rank 0;
* rank 0 writes the file atomically (a temporary name in the same folder, flushed to disk,
  renamed into place) and tells the others it is done, or what went wrong (every rank raises).

Ties (a weight used at two places, such as GPT-2's embedding and head, or a pipeline's
``SharedLayerDesc``) are found by identity in the module and, across pipeline stages, from the
pipeline's description. ``torch`` files keep them as one shared tensor, as ``torch.save`` of
the plain model does. safetensors refuses shared tensors, so a tie is written once, as
Hugging Face does: the key its ``_tied_weights_keys`` lists (or, without one, every alias after
the first in key order) is left out; ``safetensors.torch.load_model(model, file)`` (strict) and
``from_pretrained`` re-tie it.

A Hugging Face model (a ``transformers.PreTrainedModel``, recognised only if transformers is
already imported) is exported as the directory ``from_pretrained`` reads: ``config.json``,
``generation_config.json`` when the model generates, and ``model.safetensors`` (or
``pytorch_model.bin``). Any other model is exported as one file at ``path``.

Example:
    >>> export_model(plain_or_sharded_module, "model.safetensors")          # doctest: +SKIP
"""
from __future__ import annotations

import copy
import os
import secrets
import shutil
import sys
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from fleetx.comm.api import check_call
from fleetx.parallel.api import is_dtensor

__all__ = ["export_model", "consolidate", "check_format", "FORMATS", "is_hugging_face"]

#: format -> the weights file's name inside a Hugging Face directory
FORMATS = {"safetensors": "model.safetensors", "torch": "pytorch_model.bin"}


# -- tensor-parallel layers ---------------------------------------------------------------------
def _tp_shards(module: nn.Module) -> dict:
    """id(parameter) -> (layer, name) of every tensor-parallel shard in ``module``.

    A layer says how it is split through the contract of :mod:`fleetx.parallel.layers`
    (``split_dims``, and ``gathered(name)``, which puts the shards together): a layer class
    that keeps that contract is exported whole with no change here.
    """
    from fleetx.parallel.layers import _ShardedModule  # loaded only for an export
    found: dict = {}
    for layer in module.modules():
        if isinstance(layer, _ShardedModule) and layer.world_size > 1:
            for name, dim in layer.split_dims.items():
                param = getattr(layer, name, None)
                if param is not None and dim is not None:
                    found[id(param)] = (layer, name)
    return found


def _full(value: Any, shard: Optional[tuple]) -> Any:
    """The whole tensor behind this rank's ``value`` (a collective for shards): a DTensor's
    ``full_tensor()``, a tensor-parallel layer's ``gathered(name)``, or ``value`` itself."""
    if not isinstance(value, torch.Tensor):
        return value
    with torch.no_grad():
        if shard is not None:
            layer, name = shard
            return layer.gathered(name)
        t = value.detach()
        return t.full_tensor() if is_dtensor(t) else t


def _on_cpu(t: Any) -> Any:
    """A CPU tensor that owns exactly its storage (a view of a larger buffer would make
    safetensors refuse it and torch.save write the whole buffer)."""
    if not isinstance(t, torch.Tensor):
        return t
    t = t.detach().to("cpu")
    whole = t.untyped_storage().nbytes() == t.numel() * t.element_size()
    return t if whole and t.is_contiguous() else t.contiguous().clone()


# -- ties ----------------------------------------------------------------------------------------
def _identity(t: Any) -> Any:
    if not isinstance(t, torch.Tensor) or is_dtensor(t) or t.numel() == 0:
        return id(t)  # a tied parameter is one object; empty tensors share no data
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
            tuple(t.stride()), t.dtype)


def _local_ties(entries: dict) -> list:
    """Keys of ``entries`` that name one tensor, in groups of two or more (key order)."""
    groups: dict = {}
    for key, value in entries.items():
        groups.setdefault(_identity(value), []).append(key)
    return [keys for keys in groups.values() if len(keys) > 1]


def _pipeline_ties(module: nn.Module) -> list:
    """The places of each ``SharedLayerDesc`` of the pipelines in ``module``, as groups of keys
    of the unsplit model (a stage knows the places it does not hold from the description)."""
    from fleetx.parallel.pipeline import PipelineLayer, SharedLayerDesc  # loaded if used
    groups = []
    for prefix, stage in module.named_modules():
        if not isinstance(stage, PipelineLayer):
            continue
        places: dict = {}
        for index, item in enumerate(stage.layer_list):
            if isinstance(item, SharedLayerDesc):
                places.setdefault(item.layer_name, []).append(index)
        head = f"{prefix}." if prefix else ""
        for name, indexes in places.items():
            layer = stage._shared.get(name)
            if layer is None or len(indexes) < 2:
                continue
            for key in layer.state_dict():
                groups.append([f"{head}{i}.{key}" for i in indexes])
    return groups


def _merged_ties(groups: list, order: dict) -> list:
    """Overlapping groups joined; each group's keys in ``order``."""
    merged: list[set] = []
    for group in groups:
        joined = set(group)
        for other in [m for m in merged if m & joined]:
            joined |= other
            merged.remove(other)
        merged.append(joined)
    return [sorted(m, key=lambda k: order.get(k, len(order))) for m in merged]


def _kept(group: list, listed: set) -> str:
    """The key a tie is written under in safetensors: the first not listed as a tied copy."""
    return next((k for k in group if k not in listed), group[0])


def _listed_tied_keys(module: nn.Module) -> set:
    listed = getattr(module, "_tied_weights_keys", None) or ()
    return set(listed)  # a list (transformers 4) or {copy: source} (transformers 5)


# -- the collective ------------------------------------------------------------------------------
def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _enter_collective(what: str) -> None:
    """The first step of an export on every rank, before it communicates: where the check that
    every rank made the same call is made (with ``FLEETX_DEBUG_COLLECTIVES=1``, through
    :func:`fleetx.comm.api.check_call`)."""
    if _world()[1] > 1:
        check_call(what, dist.group.WORLD, [])


def consolidate(module: nn.Module) -> tuple[dict, list]:
    """The full state of ``module`` on rank 0 (every rank calls; a collective).

    Returns:
        (state, ties): on rank 0 every key of the unsplit model's ``state_dict`` with a full CPU
        tensor (the keys of one tie share it) and the groups of tied keys; ``({}, [])``
        elsewhere.
    """
    rank, world = _world()
    entries = module.state_dict(keep_vars=True)
    ties = _local_ties(entries) + _pipeline_ties(module)
    known = [None] * world
    if world > 1:
        dist.all_gather_object(known, (list(entries), ties))
    else:
        known = [(list(entries), ties)]
    owner: dict = {}
    for r, (keys, _) in enumerate(known):
        for key in keys:
            owner.setdefault(key, r)
    shards, done, mine = _tp_shards(module), {}, {}
    for key, value in entries.items():
        ident = _identity(value)
        if ident not in done:  # an alias is gathered once
            full = _full(value, shards.get(id(value)))
            done[ident] = _on_cpu(full) if owner[key] == rank else None
        if owner[key] == rank:
            mine[key] = done[ident]
    return _assemble(rank, world, mine, known, module)


def _assemble(rank: int, world: int, mine: dict, known: list, module: nn.Module) -> tuple:
    parts = [None] * world if rank == 0 else None
    if world > 1:
        dist.gather_object(mine, parts, dst=0)
    else:
        parts = [mine]
    if rank != 0:
        return {}, []
    order: dict = {}
    for keys, _ in known:
        for key in keys:
            order.setdefault(key, len(order))
    state = {}
    for part in parts:
        state.update(part)
    state = {key: state[key] for key in order}
    ties = _merged_ties([g for _, groups in known for g in groups], order)
    for group in ties:  # one tensor for every key of a tie (pipeline stages sent copies)
        for key in group[1:]:
            state[key] = state[group[0]]
    return state, ties


def _finish(error: Optional[BaseException]) -> None:
    """Rank 0 tells every rank that the file is written, or what went wrong (a barrier)."""
    rank, world = _world()
    if world > 1:
        box = [None if error is None else f"{type(error).__name__}: {error}"]
        dist.broadcast_object_list(box, src=0)
        if rank != 0 and box[0] is not None:
            raise RuntimeError(f"export failed on rank 0, which writes the file: {box[0]}")
    if error is not None:
        raise error


# -- writing -------------------------------------------------------------------------------------
def is_hugging_face(module: nn.Module) -> bool:
    """Whether ``module`` is a ``transformers.PreTrainedModel`` (without importing
    transformers: a model of that class cannot exist before it is imported)."""
    tf = sys.modules.get("transformers")
    base = getattr(tf, "PreTrainedModel", None) if tf is not None else None
    return base is not None and isinstance(module, base)


def _temp_name(folder: str, name: str) -> str:
    return os.path.join(folder, f".{name}.fleetx-tmp-{secrets.token_hex(4)}")


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _tensors_for(state: dict, ties: list, fmt: str, listed: set) -> dict:
    if fmt == "torch":
        return state
    dropped = {k for group in ties for k in group if k != _kept(group, listed)}
    out = {}
    for key, value in state.items():
        if key in dropped:
            continue
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"export: state_dict key {key!r} holds a {type(value).__name__}, "
                            f"not a tensor; safetensors stores tensors only: use "
                            f"format='torch'")
        out[key] = value
    return out


def _write_weights(tensors: dict, fmt: str, target: str) -> None:
    """Write ``tensors`` to a temporary name beside ``target``, flush it to disk, rename."""
    folder = os.path.dirname(os.path.abspath(target))
    temp = _temp_name(folder, os.path.basename(target))
    try:
        if fmt == "safetensors":
            from safetensors.torch import save_file
            # "format": "pt" is what from_pretrained requires of a safetensors archive
            save_file(tensors, temp, metadata={"format": "pt"})
        else:
            torch.save(tensors, temp)
        _fsync(temp)
        os.replace(temp, target)
    finally:
        if os.path.exists(temp):
            os.remove(temp)
    _fsync(folder)


def _write_file(path: str, tensors: dict, fmt: str) -> str:
    if os.path.isdir(path):
        raise IsADirectoryError(f"export: {path!r} is a directory; a model that is not a "
                                f"Hugging Face PreTrainedModel is exported as one file: "
                                f"give the file's path")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    _write_weights(tensors, fmt, path)
    return path


#: the weights files ``from_pretrained`` looks for, in its order: one that comes before the
#: file an export writes would be read instead of it
_HF_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
               "pytorch_model.bin.index.json")


def _check_hf_dir(path: str, fmt: str) -> None:
    """Raises: NotADirectoryError, FileExistsError: see :func:`export_model`."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise NotADirectoryError(f"export: {path!r} is a file; a Hugging Face model is exported "
                                 f"as the directory from_pretrained reads: give a directory")
    before = _HF_WEIGHTS[:_HF_WEIGHTS.index(FORMATS[fmt])]
    shadows = [n for n in before if os.path.exists(os.path.join(path, n))]
    if shadows:
        raise FileExistsError(f"export: {path!r} already holds {', '.join(shadows)}, which "
                              f"from_pretrained reads before the {FORMATS[fmt]} written now: "
                              f"remove it or export to another directory")


def _write_hf_dir(path: str, module: nn.Module, tensors: dict, fmt: str) -> str:
    """The files of ``from_pretrained`` in a staging folder beside ``path``; then the folder is
    renamed into place, or (``path`` exists: it may hold a tokenizer) each file renamed into
    it, the weights last."""
    _check_hf_dir(path, fmt)
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    staging = _temp_name(parent, os.path.basename(os.path.abspath(path)))
    os.makedirs(staging)
    try:
        names = _stage_hf_files(staging, module, tensors, fmt)
        if not os.path.exists(path):
            os.rename(staging, path)
        else:
            for name in names:  # the weights are the last name
                os.replace(os.path.join(staging, name), os.path.join(path, name))
        _fsync(path)
        _fsync(parent)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return os.path.join(path, FORMATS[fmt])


def _plain_class(module: nn.Module) -> type:
    """The model's own class: sharding stage 2/3 (FSDP2's ``fully_shard``) swaps it for a
    subclass named ``FSDP<name>``, which ``from_pretrained`` would not find."""
    fsdp = getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)
    return next(c for c in type(module).__mro__ if fsdp is None or not issubclass(c, fsdp))


def _stage_hf_files(staging: str, module: nn.Module, tensors: dict, fmt: str) -> list:
    config = copy.deepcopy(module.config)
    # what save_pretrained records: the class from_pretrained builds, the weights' dtype
    config.architectures = [_plain_class(module).__name__]
    floats = [t for t in tensors.values() if isinstance(t, torch.Tensor)
              and t.is_floating_point()]
    if floats:
        config.dtype = str(floats[0].dtype).split(".")[1]
    config.save_pretrained(staging)
    names = ["config.json"]
    generation = getattr(module, "generation_config", None)
    if generation is not None and module.can_generate():
        generation.save_pretrained(staging)
        names.append("generation_config.json")
    for name in names:
        _fsync(os.path.join(staging, name))
    _write_weights(tensors, fmt, os.path.join(staging, FORMATS[fmt]))
    return names + [FORMATS[fmt]]


def check_format(fmt: Any) -> str:
    """Raises: ValueError: ``fmt`` is not one of :data:`FORMATS`."""
    if fmt not in FORMATS:
        raise ValueError(f"export format must be one of {sorted(FORMATS)}, got {fmt!r}")
    return fmt


def export_model(module: nn.Module, path: str, format: str = "safetensors",
                 what: str = "fleet.export_model") -> Optional[str]:
    """Write the full weights of ``module`` (the user's model: plain, sharded in place, with
    tensor-parallel layers or a pipeline stage) under its plain keys (every rank calls).

    Args:
        module: the user's module on this rank.
        path: a Hugging Face model's directory, or any other model's file.
        format: ``"safetensors"`` or ``"torch"``.
        what: the call named in errors.

    Returns:
        The weights file written (on every rank).

    Raises:
        ValueError: an unknown ``format`` (before any communication).
        IsADirectoryError, NotADirectoryError: ``path`` is not the kind the model is exported
            as.
        FileExistsError: ``path`` is a directory holding a weights file that
            ``from_pretrained`` reads before the one written (``model.safetensors`` beside a
            ``"torch"`` export).
        TypeError: a non-tensor state entry with safetensors.
        RuntimeError: on the ranks other than 0, when rank 0 failed to write (naming its
            error; rank 0 raises the error itself).
    """
    fmt = check_format(format)
    path = os.fspath(path)
    hf = is_hugging_face(module)
    _enter_collective(what)
    state, ties = consolidate(module)
    error: Optional[BaseException] = None
    if _world()[0] == 0:
        try:
            tensors = _tensors_for(state, ties, fmt, _listed_tied_keys(module))
            _write_hf_dir(path, module, tensors, fmt) if hf else _write_file(path, tensors, fmt)
        except Exception as err:  # every rank learns of it, then raises
            error = err
    _finish(error)
    return os.path.join(path, FORMATS[fmt]) if hf else path
