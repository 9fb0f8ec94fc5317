"""The optimizer wrapper returned by ``fleet.distributed_optimizer``.

It is a ``torch.optim.Optimizer`` (so learning-rate schedulers accept it) that holds the user's
optimizer by composition and runs every step through the training context: strategies decide how
the backward runs (loss scaling), whether a step is taken (skipped on overflow, or between
gradient-merge boundaries) and what follows it (parameter averaging).
"""
from __future__ import annotations

import numbers
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from fleetx.optim.wrapper import OptimizerWrapper
from fleetx.parallel.api import is_dtensor
from fleetx.parallel.clip import clip_grad_norm_

__all__ = ["DistributedOptimizer"]


class DistributedOptimizer(OptimizerWrapper):
    """A user optimizer made distributed by the strategies of the plan.

    Args:
        ctx: the training context (its ``optimizer`` is the inner optimizer).
        modules: returns the models the fleet distributed (where :meth:`clip_grad_norm_` finds
            tensor-parallel shards and tied pipeline weights).

    Example:
        >>> opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        >>> opt.minimize(loss)          # backward + step + zero_grad
    """

    def __init__(self, ctx: Any, modules: Callable[[], list] = list) -> None:  # noqa: D107
        super().__init__()
        self._ctx = ctx
        self._modules = modules
        #: whether the last ``step`` updated the parameters (see :meth:`step`)
        self.last_step_taken = False
        #: called after the gradients were cleared (the fleet's automatic checkpoints save
        #: there, with no gradient held)
        self.after_zero_grad: list[Callable[[], None]] = []

    @property
    def inner(self) -> torch.optim.Optimizer:
        """The torch optimizer that updates the parameters."""
        return self._ctx.optimizer

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        """Take one optimizer step unless a strategy's guard skips it.

        Returns:
            Without ``closure``: True when the parameters were updated, False when a strategy
            skipped the update (a gradient-merge micro-step, an AMP step with inf gradients).
            With ``closure``: its loss, as ``torch.optim.Optimizer.step`` does (the flag is then
            :attr:`last_step_taken`).
        """
        loss = None
        self.last_step_taken = all(guard() for guard in self._ctx.step_guards)
        if self.last_step_taken:
            # Hooks registered on this wrapper (register_step_pre_hook / _post_hook) run around
            # the steps actually taken, as they would on a plain optimizer.
            for hook in list(self._optimizer_step_pre_hooks.values()):
                hook(self, (), {})
            loss = self.inner.step(closure) if closure is not None else self.inner.step()
            for hook in list(self._optimizer_step_post_hooks.values()):
                hook(self, (), {})
        for hook in self._ctx.after_step:
            hook()
        return loss if closure is not None else self.last_step_taken

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients, unless a strategy is still accumulating them."""
        if all(guard() for guard in self._ctx.zero_grad_guards):
            self.inner.zero_grad(set_to_none=set_to_none)
            for hook in self.after_zero_grad:
                hook()

    clear_grad = zero_grad

    def backward(self, loss: torch.Tensor) -> None:
        """Run the backward pass as the strategies require (e.g. with loss scaling)."""
        for listener in self._ctx.loss_listeners:
            listener(loss)
        self._ctx.backward(loss)

    def backward_from(self, tensors: Any, grad_tensors: Any) -> None:
        """Run a pipeline stage's backward from the gradients of its outputs (a fleetx
        extension that ``PipelineParallel.train_batch`` calls on every stage but the last).

        The gradients came from the next stage's backward, so they already carry what the
        strategies applied to the loss (amp's scale); the strategies only note that a backward
        ran (amp's step guard then unscales these gradients too).

        Args:
            tensors: the stage's outputs that require grad.
            grad_tensors: their gradients, in the same order.
        """
        self._ctx.backward_from(tensors, grad_tensors)

    def minimize(self, loss: torch.Tensor) -> bool:
        """Backward, step and zero_grad in one call: the single seam strategies hook into.

        Returns:
            True when the parameters were updated on this call; False on a gradient-merge
            micro-step or an AMP step skipped for inf gradients. Step an LR scheduler only then
            (``if opt.minimize(loss): scheduler.step()``), so it counts updates, not micro-steps.
        """
        self.backward(loss)
        taken = self.step()
        self.zero_grad()
        return taken

    def average_parameters(self) -> None:
        """Average the parameters over the ranks where the plan lets them differ.

        Local SGD steps without communicating between its averages, so after the last step the
        ranks hold different parameters; call this on every rank (it is a collective) before
        saving or evaluating. It acts through the strategies that offer it (``localsgd``,
        ``adaptive_localsgd``); with any other plan it sends nothing (data parallel and gradient
        merge keep the ranks equal).

        Example:
            >>> opt.average_parameters()        # every rank
            >>> if fleet.is_first_worker():
            ...     torch.save(model.state_dict(), "model.pt")
        """
        method = self._ctx.optimizer_methods.get("average_parameters")
        if method is not None:
            method()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> Optional[torch.Tensor]:
        """Clip the gradients of every parameter by their global norm; return the norm.

        Call it after backward, before :meth:`step` (or from a step pre-hook, e.g. for a
        pipeline's ``train_batch``). The norm is that of the whole model across the hybrid
        topology: a tensor-parallel weight's shards each once, a parameter replicated over the
        model-parallel group once, every pipeline stage's parameters, a weight tied across
        stages once, sharding stages' shards once; so it equals
        ``torch.nn.utils.clip_grad_norm_`` on the unsplit model. Every rank of a replica must
        call it (the norm is summed over them).

        On a gradient-merge micro-step whose :meth:`step` will not update (all but the last of
        ``k_steps``) it does nothing and returns None: the gradients are a partial sum, not yet
        synchronised, so their norm is not the update's. The clipping belongs to the update, as
        Paddle's ``grad_clip`` does inside the optimizer: the same loop (``backward``,
        ``clip_grad_norm_``, ``step``) clips the merged gradients once, on the last micro-step.

        Args:
            max_norm: the largest norm left unscaled.
            norm_type: the p of the p-norm (``float("inf")``: the largest absolute value).
            error_if_nonfinite: raise when the norm is nan or inf.

        Returns:
            The total norm before clipping, a 0-d tensor, the same on every rank; None on a
            gradient-merge micro-step before the last (nothing clipped).

        Under ``strategy.amp`` the gradients are unscaled first (as ``GradScaler.unscale_``
        does), once per step: the norm returned and clipped to is the model's, and the step
        does not unscale again. Gradients with inf or nan give an inf or nan norm, and the step
        is skipped as without clipping.

        Raises:
            ValueError: ``norm_type`` is not positive.

        Example:
            >>> opt.backward(loss)
            >>> norm = opt.clip_grad_norm_(1.0)
            >>> opt.step(); opt.zero_grad()
        """
        # A micro-step's partial sum is left as it is: in particular amp must not unscale
        # gradients the next micro-steps still add scaled gradients to.
        if any(partial() for partial in self._ctx.partial_gradients):
            return None
        params = [p for group in self.inner.param_groups for p in group["params"]]
        for prepare in self._ctx.before_clip:
            prepare(params)
        return clip_grad_norm_(params, max_norm, norm_type, modules=self._modules(),
                               error_if_nonfinite=error_if_nonfinite)

    def get_lr(self) -> float:
        """The learning rate of the first parameter group."""
        return float(self.inner.param_groups[0]["lr"])

    def set_lr(self, value: float) -> None:
        """Set the learning rate of every parameter group.

        Raises:
            TypeError: ``value`` is not a real number.
        """
        if isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point():
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"set_lr expects a real number or a one-element float tensor, "
                            f"got {type(value).__name__}")
        for group in self.inner.param_groups:
            group["lr"] = float(value)
        for hook in self._ctx.lr_listeners:
            hook(float(value))

    def state_dict(self) -> dict:  # type: ignore[override]
        """The inner optimizer's whole state, as plain tensors, plus strategy state under
        ``"fleetx"`` if any.

        It has the plain optimizer's format (state by parameter index, full tensors) at every
        sharding stage, so it loads into an unsharded optimizer, and a state saved at one stage
        loads at another. With sharding the state is spread over the ranks and is gathered
        first: it is a collective, every rank calls it and every rank gets all of it, in host
        memory (save it on rank 0).

        Example:
            >>> sd = opt.state_dict()               # every rank
            >>> if fleet.is_first_worker():
            ...     torch.save(sd, "opt.pt")
        """
        sd = _full_tensors(_consolidated(self.inner))
        extra = {k: v.state_dict() if hasattr(v, "state_dict") else v
                 for k, v in self._ctx.state.items()}
        if extra:
            sd = dict(sd, fleetx=extra)
        return sd

    def load_state_dict(self, state_dict: dict) -> None:  # type: ignore[override]
        """Load what :meth:`state_dict` returned (the inner optimizer's and the strategies'),
        or a plain optimizer's state dict over the same parameter groups. Every rank loads the
        whole dict; a sharded rank keeps its own share of each tensor.

        Raises:
            ValueError: a state tensor's shape is not its parameter's (the dict belongs to
                another model).
        """
        state_dict = dict(state_dict)
        extra = state_dict.pop("fleetx", {})
        self.inner.load_state_dict(_sharded_like(self.inner, state_dict))
        for key, value in extra.items():
            target = self._ctx.state.get(key)
            if hasattr(target, "load_state_dict"):
                target.load_state_dict(value)
            else:
                self._ctx.state[key] = value

    set_state_dict = load_state_dict  # Paddle's name

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails: methods a strategy adds (``get_loss_scaling``).
        ctx = self.__dict__.get("_ctx")
        method = ctx.optimizer_methods.get(name) if ctx is not None else None
        if method is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return method

    def __getstate__(self) -> dict:
        return self.__dict__

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)


def _consolidated(inner: torch.optim.Optimizer) -> dict:
    """``inner.state_dict()``; a ``ZeroRedundancyOptimizer``'s state is first gathered on its
    group's first rank, then sent to the others (every rank gets the whole state)."""
    if not hasattr(inner, "consolidate_state_dict"):
        return inner.state_dict()
    inner.consolidate_state_dict(to=0)
    holder = [inner.state_dict() if inner.rank == 0 else None]
    inner._all_state_dicts = []  # the gathered copy: freed, it is the whole state
    group = inner.process_group
    dist.broadcast_object_list(holder, src=dist.get_global_rank(group, 0), group=group)
    return holder[0]


def _full_tensors(sd: dict) -> dict:
    """``sd`` with every ``DTensor`` of its state gathered into a plain full tensor in host
    memory (a collective over the tensor's mesh, which FSDP2 puts under sharding stages 2 and
    3). The whole state of a sharded model may not fit one device: one tensor at a time is
    whole there, as ZeroRedundancyOptimizer's consolidation at stage 1 keeps its copy on the
    host too."""
    state = {index: {k: v.full_tensor().cpu() if is_dtensor(v) else v for k, v in entry.items()}
             for index, entry in sd["state"].items()}
    return dict(sd, state=state)


def _sharded_like(inner: torch.optim.Optimizer, sd: dict) -> dict:
    """``sd`` with each full state tensor of a ``DTensor`` parameter cut to this rank's share,
    laid out as the parameter is (each rank holds the whole tensor: no communication).

    Raises:
        ValueError: a state tensor is neither a scalar nor of its parameter's shape.
    """
    params = [p for group in inner.param_groups for p in group["params"]]
    state = {}
    for index, entry in sd.get("state", {}).items():
        param = params[index] if isinstance(index, int) and index < len(params) else None
        state[index] = entry if not is_dtensor(param) else {
            key: _shard_of(value, param, index, key) for key, value in entry.items()}
    return dict(sd, state=state)


def _shard_of(value: Any, param: Any, index: int, key: str) -> Any:
    """This rank's share of the full state tensor ``value`` of the ``DTensor`` ``param``;
    a scalar (Adam's ``step``) or a value already sharded as it is."""
    if not isinstance(value, torch.Tensor) or is_dtensor(value) or value.dim() == 0:
        return value
    if value.shape != param.shape:
        raise ValueError(
            f"optimizer state {key!r} of parameter {index} has shape {tuple(value.shape)}, the "
            f"parameter {tuple(param.shape)}: the state dict was saved for another model or "
            f"other parameter groups")
    from torch.distributed.tensor import distribute_tensor  # loaded: param is a DTensor

    return distribute_tensor(value.to(param.device), param.device_mesh, param.placements,
                             src_data_rank=None)
