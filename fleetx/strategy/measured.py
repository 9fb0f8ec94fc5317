"""The bytes of training state a process holds now: parameters, gradients, optimizer state.

One counting for every reader: ``fleet.state_bytes()`` (:mod:`fleetx.fleet.memory`, which
documents the rules) and ``strategy.auto``'s candidate measurements. Local shards only (a
``DTensor`` counts its ``to_local()`` part), each storage once at its full size, freed buffers
(size 0) not at all, and the state of an optimizer wrapped as ``.optim``
(``ZeroRedundancyOptimizer``'s partition) with the wrapper's own.
"""
from __future__ import annotations

from typing import Any, Iterable, Iterator, Optional

import torch
from torch import nn

from fleetx.parallel.api import local_part

__all__ = ["measure", "SavedForBackward"]


def measure(modules: Iterable[nn.Module], optimizer: Optional[torch.optim.Optimizer]
            ) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state this process holds now.

    Args:
        modules: the models whose parameters count (the optimizer's parameters count too).
        optimizer: the optimizer whose state counts, or None.

    Returns:
        ``{"parameters": int, "gradients": int, "optimizer": int}``.

    Example:
        >>> m = nn.Linear(10, 10)
        >>> measure([m], None)
        {'parameters': 440, 'gradients': 0, 'optimizer': 0}
    """
    params: dict[int, torch.Tensor] = {}
    for module in modules:
        params.update((id(p), p) for p in module.parameters())
    for group in (optimizer.param_groups if optimizer is not None else ()):
        params.update((id(p), p) for p in group["params"])
    seen: set = set()
    return {
        "parameters": _bytes(params.values(), seen),
        "gradients": _bytes((p.grad for p in params.values() if p.grad is not None), seen),
        "optimizer": _bytes(_state_tensors(optimizer), seen),
    }


def _bytes(tensors: Iterable[torch.Tensor], seen: set) -> int:
    """Bytes of the storages behind ``tensors`` not in ``seen`` (which gains them)."""
    total = 0
    for tensor in tensors:
        local = local_part(tensor)
        storage = local.untyped_storage()
        if storage.nbytes() == 0:  # a freed buffer (FSDP2 resizes gathered ones to 0)
            continue
        key = (local.device, storage.data_ptr())
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def _state_tensors(optimizer: Any) -> Iterator[torch.Tensor]:
    """Every tensor in the optimizer's state, and in the state of the optimizer it wraps as
    ``.optim`` (``ZeroRedundancyOptimizer``'s partition)."""
    while isinstance(optimizer, torch.optim.Optimizer):
        for value in optimizer.state.values():
            yield from _tensors_in(value)
        optimizer = getattr(optimizer, "optim", None)


def _tensors_in(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors_in(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_in(item)


class SavedForBackward:
    """Counts the bytes the autograd graph built inside ``with`` saves for backward: the
    activations, each storage once, parameters left out.

    A saved tensor is a parameter when it, or the tensor it is a view of, is a leaf that
    requires grad (this covers the parameters FSDP2 gathers for a forward, which are not the
    module's sharded ones), or when its storage is one of ``exclude``'s.

    Args:
        exclude: tensors whose storages never count (local shards are taken of DTensors).

    Example:
        >>> layer = nn.Linear(4, 4)
        >>> with SavedForBackward() as saved:
        ...     y = torch.relu(layer(torch.ones(2, 4)))
        >>> saved.bytes  # the input (32) and relu's output (32); the weight is left out
        64
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._excluded = {_local(t).untyped_storage().data_ptr() for t in exclude}
        self._seen: dict[int, int] = {}
        self._hooks: Any = None

    @property
    def bytes(self) -> int:
        """Bytes counted so far."""
        return sum(self._seen.values())

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if not (base.is_leaf and base.requires_grad) and ptr not in self._excluded:
            self._seen[ptr] = storage.nbytes()
        return t

    def __enter__(self) -> "SavedForBackward":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)


def _local(t: torch.Tensor) -> torch.Tensor:
    return local_part(t)


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t
