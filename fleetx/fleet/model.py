"""The model wrapper returned by ``fleet.distributed_model``.

It holds the user's module and builds the distributed engine (DDP, or the plain module with one
process) from the fleet's current training context the first time it runs, so the model may
still be moved to its device after being wrapped. ``state_dict`` keys are the plain model's, so a
checkpoint written by N processes loads into 1 and back. With sharded parameters (sharding
stage 3, and stage 2 between steps) ``state_dict`` gathers full plain tensors (a collective:
every rank calls it, and every rank gets them all) and ``load_state_dict`` takes such a full
dict, each rank keeping its own shard.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from fleetx.parallel.api import is_dtensor

__all__ = ["DistributedModel", "state_dict_entry"]


def state_dict_entry(wrapped: nn.Module, *_: Any) -> None:
    """``state_dict`` of a sharded model gathers its parameters, a collective: the fleet's
    entry names a rank that does not call it (``if rank == 0: torch.save(model.state_dict())``).
    A copy of the model (``copy.deepcopy``, ``torch.save``) carries no entry and checks nothing."""
    enter = wrapped.__dict__.get("_enter_collective")
    if enter is not None and any(is_dtensor(p) for p in wrapped.module.parameters()):
        enter("model.state_dict")


class DistributedModel(nn.Module):
    """A user model made distributed by the strategies of the plan.

    With sharded parameters (sharding stages 2 and 3) every forward gathers them, in eval mode
    too: every rank must run the same eval forwards, and an eval forward waits for all of them
    (a rank that does not come within ``FLEETX_TIMEOUT`` is a ``CommError`` naming it). To
    evaluate on one rank, call ``state_dict()`` on every rank and load it into a plain model
    there.

    Args:
        module: the user's model (its parameters are shared, not copied).
        context_of: returns the training context to build with (the fleet's current one).

    Example:
        >>> model = fleet.distributed_model(Net())
        >>> loss = loss_fn(model(x), y)
    """

    def __init__(self, module: nn.Module, context_of: Callable[[], Any]) -> None:
        super().__init__()
        self.module = module
        # Plain attributes, kept out of the module tree on purpose: the engines wrap ``module``
        # (registering them would list every parameter twice).
        self.__dict__["_context_of"] = context_of
        self.__dict__["_user_no_sync"] = False  # inside ``with model.no_sync()`` (FSDP2)
        self._forget_engines()
        # Checkpoints carry the plain model's keys (no ``module.`` prefix), also when this
        # wrapper sits inside another module.
        self._register_state_dict_hook(_strip_prefix)
        self._register_load_state_dict_pre_hook(_add_prefix, with_module=True)

    def _forget_engines(self) -> None:
        self.__dict__.update(_engine=None, _eval_engine=None, _built_for=None)

    def _engines_for(self, ctx: Any) -> tuple[nn.Module, nn.Module]:
        """(training engine, evaluation engine) built from the context's model wrappers.

        Wrappers marked ``train_only`` (gradient synchronisation such as DDP) are left out of the
        evaluation engine, so a forward in eval mode never waits for other processes.
        """
        if self._built_for is not ctx:
            engine, eval_engine = self.module, self.module
            for wrap in ctx.model_wrappers:
                engine = wrap(engine)
                if not getattr(wrap, "train_only", False):
                    eval_engine = engine if eval_engine is not engine else wrap(eval_engine)
            engine.train(self.training)
            self.__dict__.update(_engine=engine, _eval_engine=eval_engine, _built_for=ctx)
        return self._engine, self._eval_engine

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        context_of = self._context_of
        if context_of is None:  # a copy made with copy.deepcopy / pickle: a plain model
            return self.module(*args, **kwargs)
        ctx = context_of()
        if ctx.first_batch and self.training and torch.is_grad_enabled():
            hooks, ctx.first_batch[:] = list(ctx.first_batch), []
            for hook in hooks:  # e.g. auto's search, which may put a new context in force
                hook(args, kwargs)
            ctx = context_of()
        engine, eval_engine = self._engines_for(ctx)
        if not self.training:
            with ctx.forward_context():
                return eval_engine(*args, **kwargs)
        skip_sync = torch.is_grad_enabled() and not ctx.sync_gradients()
        no_sync = getattr(engine, "no_sync", None) if skip_sync else None
        if hasattr(engine, "set_requires_gradient_sync"):
            # FSDP2 reads its flag in backward, not in forward (as DDP's no_sync does): set it
            # for this micro-step's backward, and leave it until the next forward sets it.
            engine.set_requires_gradient_sync(not skip_sync and not self._user_no_sync)
        with (no_sync() if no_sync else contextlib.nullcontext()), ctx.forward_context():
            return engine(*args, **kwargs)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped model's own ``generate`` (Hugging Face ``GenerationMixin``), run in the
        strategies' forward context (amp's autocast) without building a graph.

        Data parallel leaves the model's parameters whole on every rank, so any rank may
        generate alone. With sharded parameters (sharding stages 2 and 3) every forward gathers
        them: every rank must call ``generate``, and ``synced_gpus`` defaults to True (as
        transformers sets it under FSDP), so a rank whose sequences end early keeps running
        forwards until every rank is done instead of leaving the others waiting.

        Args:
            *args, **kwargs: those of the model's ``generate``.

        Raises:
            AttributeError: the wrapped model has no ``generate`` method.

        Example:
            >>> model = fleet.distributed_model(GPT2LMHeadModel(config))
            >>> tokens = model.generate(ids, max_new_tokens=20, do_sample=False)
        """
        generate = getattr(self.module, "generate", None)
        if not callable(generate):
            raise AttributeError(
                f"{type(self.module).__name__} has no generate method: generate() calls the "
                "wrapped model's own (a Hugging Face GenerationMixin model has one)")
        if any(is_dtensor(p) for p in self.module.parameters()):
            kwargs.setdefault("synced_gpus", True)
        ctx = self._context_of() if self._context_of is not None else None
        with torch.no_grad(), (ctx.forward_context() if ctx else contextlib.nullcontext()):
            return generate(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Run forward and backward without synchronising gradients (accumulate locally)."""
        engine, _ = self._engines_for(self._context_of())
        if hasattr(engine, "set_requires_gradient_sync"):  # FSDP2 (sharding stage 2 or 3)
            self.__dict__["_user_no_sync"] = True
            engine.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                self.__dict__["_user_no_sync"] = False
                engine.set_requires_gradient_sync(True)
            return
        with (engine.no_sync() if hasattr(engine, "no_sync") else contextlib.nullcontext()):
            yield

    def train(self, mode: bool = True) -> "DistributedModel":
        super().train(mode)
        for engine in (self._engine, self._eval_engine):
            if engine is not None and engine is not self.module:
                engine.train(mode)
        return self

    def save_pretrained(self, save_directory: str, *, safe_serialization: bool = True,
                        is_main_process: bool = True, **kwargs: Any) -> None:
        """Hugging Face's ``save_pretrained`` for the wrapped model, at every layout: the
        directory ``from_pretrained`` reads, written by ``fleet.export_model`` (every rank
        calls; a collective; rank 0 writes). The weights are gathered whole, also from sharded
        parameters, into one ``model.safetensors`` (``pytorch_model.bin`` with
        ``safe_serialization=False``).

        Args:
            save_directory: the directory (created; other files in it are kept).
            safe_serialization: safetensors (default) or a torch file.
            is_main_process: accepted for scripts written for Accelerate and ignored: every
                rank must call, and rank 0 writes.
            **kwargs: none is supported (``max_shard_size``, ``push_to_hub``, ``state_dict``...).

        Raises:
            AttributeError: the wrapped model is not a Hugging Face ``PreTrainedModel``.
            TypeError: a keyword argument other than those above, naming
                ``fleet.export_model``.

        Example:
            >>> fleet.distributed_model(hf_model).save_pretrained("out")   # every rank
        """
        from fleetx.checkpoint.export import export_model, is_hugging_face
        if not is_hugging_face(self.module):
            raise AttributeError(f"{type(self.module).__name__} has no save_pretrained (not a "
                                 f"Hugging Face PreTrainedModel): use fleet.export_model(path)")
        if kwargs:
            raise TypeError(f"DistributedModel.save_pretrained takes save_directory, "
                            f"safe_serialization and is_main_process; {sorted(kwargs)} are not "
                            f"supported: it writes one consolidated file with "
                            f"fleet.export_model(path, format=...)")
        enter = self.__dict__.get("_enter_collective")
        if enter is not None:
            enter("DistributedModel.save_pretrained")
        export_model(self.module, save_directory,
                     "safetensors" if safe_serialization else "torch",
                     what="DistributedModel.save_pretrained")

    def __getstate__(self) -> dict:
        # A copy (EMA models, torch.save of the module) is a plain model: it neither carries
        # the process groups nor takes part in the job.
        state = dict(self.__dict__)
        state.update(_context_of=None, _engine=None, _eval_engine=None, _built_for=None,
                     _enter_collective=None)
        return state

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            module: Optional[nn.Module] = self._modules.get("module")
            if module is None:
                raise
            return getattr(module, name)


def _strip_prefix(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    # Sharded parameters (DTensor shards of FSDP2) are gathered into full plain tensors: a
    # collective, in the same key order on every rank, so every rank must call state_dict.
    inner = prefix + "module."
    for key in [k for k in state_dict if k.startswith(inner)]:
        value = state_dict.pop(key)
        if is_dtensor(value):
            value = value.full_tensor()
        state_dict[prefix + key[len(inner):]] = value


def _add_prefix(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    # A full tensor meant for a sharded parameter becomes that parameter's shard (each rank
    # cuts its own from the full tensor it was given: no communication).
    inner = prefix + "module."
    sharded = {name: p for name, p in module.module.named_parameters(remove_duplicate=False)
               if is_dtensor(p)}
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        value, name = state_dict.pop(key), key[len(prefix):]
        target = sharded.get(name)
        if target is not None and isinstance(value, torch.Tensor) and not is_dtensor(value):
            from torch.distributed.tensor import distribute_tensor  # loaded: target is one

            value = distribute_tensor(value.to(target.device), target.device_mesh,
                                      target.placements, src_data_rank=None)
        state_dict[inner + name] = value
