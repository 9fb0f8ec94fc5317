"""Per-rank records of a training checkpoint: JSON with tensors as references to DCP keys.

A rank's strategy state (counters, DGC buffers), its gradients and its own copy of diverging
replicated tensors are nested dicts and lists of JSON values and tensors. :func:`encode` turns
such a value into JSON in which each tensor is ``{"__tensor__": key}``, and puts the tensor
under that key into the dict that ``torch.distributed.checkpoint`` saves beside the model;
:func:`tensor_templates` makes the empty tensors DCP loads them into, and :func:`decode` puts
them back in place.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from fleetx.checkpoint.api import CheckpointError

__all__ = ["REF", "local", "encode", "decode", "tensor_templates"]

#: the key of a tensor reference in a record
REF = "__tensor__"


def local(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` detached; a DTensor (FSDP2) gives its local shard, as per-rank state is
    plain tensors."""
    to_local = getattr(tensor, "to_local", None)
    return (to_local() if to_local is not None else tensor).detach()


def encode(value: Any, key: str, tensors: dict) -> Any:
    """``value`` as JSON, each tensor replaced by a reference to its DCP key in ``tensors``."""
    if isinstance(value, torch.Tensor):
        tensors[key] = local(value).clone()
        return {REF: key}
    if isinstance(value, Mapping):
        return {str(k): encode(v, f"{key}/{k}", tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode(v, f"{key}/{i}", tensors) for i, v in enumerate(value)]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise CheckpointError(f"cannot save strategy state {key!r}: a {type(value).__name__} is "
                          "neither a tensor nor a JSON value")


def tensor_templates(record: Any, available: Mapping) -> dict:
    """Empty tensors for every per-rank tensor the record references, shaped as saved."""
    keys: list = []
    _collect_refs(record, keys)
    templates = {}
    for key in keys:
        meta = available.get(key)
        if not isinstance(meta, TensorStorageMetadata):
            raise CheckpointError(f"strategy tensor {key!r} is referenced but not saved")
        templates[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
    return templates


def _collect_refs(value: Any, keys: list) -> None:
    if isinstance(value, dict):
        if set(value) == {REF}:
            keys.append(value[REF])
        for v in value.values():
            _collect_refs(v, keys)
    elif isinstance(value, list):
        for v in value:
            _collect_refs(v, keys)


# what decode leaves out of its containers (a tensor leaf, without keep_tensors)
_DROP = object()


def decode(value: Any, tensors: Mapping, keep_tensors: bool) -> Any:
    """Inverse of :func:`encode`; without ``keep_tensors`` tensor leaves are left out."""
    if isinstance(value, dict) and set(value) == {REF}:
        return tensors[value[REF]] if keep_tensors else _DROP
    if isinstance(value, dict):
        out = {k: decode(v, tensors, keep_tensors) for k, v in value.items()}
        return {k: v for k, v in out.items() if v is not _DROP}
    if isinstance(value, list):
        return [v for v in (decode(v, tensors, keep_tensors) for v in value) if v is not _DROP]
    return value
