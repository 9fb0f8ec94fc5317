"""Per-rank memory accounting: the bytes of training state this process holds now.

``fleet.state_bytes()`` answers with three figures, ``parameters``, ``gradients`` and
``optimizer``, for the model given to ``distributed_model`` and the optimizer given to
``distributed_optimizer``. What is counted is what the process really holds, so it shows what
sharding saves:

* local shards only: a ``DTensor`` (FSDP2 parameters, their gradients and optimizer state) counts
  its ``to_local()`` part;
* each storage once, at its full size: tied weights count once, gradients that are views into
  one flat buffer (FSDP2's reduce-scatter output) count the buffer, padding included;
* gradients as they are at the moment of the call (none after ``zero_grad``, all after a
  backward); the parameters too (with sharding stage 2 the gathered parameters live from the
  forward to the backward, and the module then holds them as well as its shards);
* the inner optimizer's state, and, for an optimizer that keeps its own optimizer as ``.optim``
  (``ZeroRedundancyOptimizer``: its ``.optim`` holds this rank's partition, its own ``.state``
  is empty until a ``load_state_dict`` fills it with this rank's entries), both.

A storage is counted under the first of parameters, gradients, optimizer that holds it.
``fleet.explain()`` prints the figures expected for the plan (:mod:`fleetx.strategy.footprint`).
"""
from __future__ import annotations

from typing import Any, Iterable, Iterator, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fleetx.fleet.api import FleetError

__all__ = ["measure", "MemoryQueries"]


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
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
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


class MemoryQueries:
    """``Fleet.state_bytes``: the bytes of training state this process holds (a mixin of
    ``Fleet``, which supplies ``_rm``, ``_models`` and ``_dist_optimizer``)."""

    def state_bytes(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state held by this process now.

        Local shards only (a sharded parameter counts its local part), gradients as they are
        at the call (none after ``zero_grad``; call it after ``backward`` to see them), the
        state of the optimizer given to ``distributed_optimizer`` (0 without one); each
        storage counted once. ``fleet.explain()`` prints what the plan should hold.

        Returns:
            ``{"parameters": int, "gradients": int, "optimizer": int}``.

        Raises:
            FleetError: before ``fleet.init``, or before ``distributed_model`` /
                ``distributed_optimizer`` (there is nothing to measure yet).

        Example:
            >>> opt.backward(loss)                      # doctest: +SKIP
            >>> fleet.state_bytes()                     # doctest: +SKIP
            {'parameters': 40400, 'gradients': 40400, 'optimizer': 0}
        """
        self._rm("state_bytes")
        dist_opt = self._dist_optimizer
        if not self._models and dist_opt is None:
            raise FleetError("fleet.state_bytes() measures the model and optimizer given to "
                             "fleet.distributed_model / fleet.distributed_optimizer; call them "
                             "first")
        inner = dist_opt.inner if dist_opt is not None else None
        return measure([m.module for m in self._models], inner)
