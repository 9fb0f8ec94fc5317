"""A plain copy of a distributed model, for evaluating or sampling on one rank.

Sharding stages 2 and 3 gather the parameters in every forward, a collective, so
``if rank == 0: evaluate(model)`` cannot run on the wrapped model. ``fleet.consolidated_model``
builds the copy the rank then uses alone: every rank calls it (the full state is gathered),
and the copy is an ordinary module of the user's class, holding whole tensors, with no hook of
fleetx's, so its forwards and ``generate`` communicate with nobody.

The copy's structure comes from a *skeleton* taken when the model was given to
``fleet.distributed_model``, before any strategy changed it in place: a deep copy whose
parameters are on the meta device (no memory) and whose buffers are real (a buffer outside the
state dict, such as rotary embeddings' ``inv_freq``, keeps its values).
"""
from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

__all__ = ["skeleton", "plain_copy"]

_TAKEN = "_fleetx_skeleton"  # the skeleton kept on the module it was taken from


def skeleton(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` whose parameters live on the meta device (shared ones stay
    shared); buffers are copied. Taken once per module: a module given again (FSDP2 modules,
    sharded in place, cannot be deep-copied) returns the skeleton of its first time.

    Example:
        >>> s = skeleton(torch.nn.Linear(2, 3))
        >>> s.weight.is_meta, s.weight.shape
        (True, torch.Size([3, 2]))
    """
    taken = module.__dict__.get(_TAKEN)
    if taken is not None:  # given to fleet.distributed_model again (already sharded in place)
        return taken
    memo: dict = {}
    for p in module.parameters():  # tied parameters once: the copy ties them too
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"),
                                   requires_grad=p.requires_grad)
    shape = copy.deepcopy(module, memo)
    module.__dict__[_TAKEN] = shape  # a plain attribute: not a sub-module, not in state_dict
    return shape


def plain_copy(shape: nn.Module, state: dict, training: bool) -> nn.Module:
    """A copy of ``shape`` (a :func:`skeleton`) holding ``state`` (the full state dict).

    Raises:
        RuntimeError: ``state`` does not fit the skeleton (``load_state_dict(strict=True)``).
    """
    plain = copy.deepcopy(shape)
    device = next((v.device for v in state.values() if isinstance(v, torch.Tensor)),
                  torch.device("cpu"))
    made: dict = {}
    for module in plain.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and p.is_meta:
                if id(p) not in made:
                    made[id(p)] = nn.Parameter(torch.empty_like(p, device=device),
                                               requires_grad=p.requires_grad)
                module._parameters[name] = made[id(p)]
    plain.load_state_dict(state, strict=True)
    return plain.train(training)


def find_wrapped(models: list, model: Any, what: str) -> Any:
    """The ``DistributedModel`` among ``models`` that is ``model`` or wraps it.

    Raises:
        ValueError: ``model`` was not given to ``fleet.distributed_model``.
    """
    for wrapped in models:
        if model is wrapped or model is wrapped.module:
            return wrapped
    raise ValueError(f"fleet.{what}: the {type(model).__name__} given is not a model "
                     f"fleet.distributed_model returned (or wrapped): pass that model")
