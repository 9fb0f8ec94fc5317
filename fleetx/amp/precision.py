"""Precision lists at module granularity: Paddle op names, ``torch.nn`` types and forward hooks.

Paddle's AMP lists name *ops* (``softmax``, ``layer_norm``, ``matmul``...). ``torch.autocast``
keeps its own per-op lists and offers no way to edit them, so ``custom_white_list`` and
``custom_black_list`` act on *modules* instead: a Paddle op name stands for the ``torch.nn``
module types that run it (:data:`PADDLE_OPS`), and a ``torch.nn`` class name (``"LayerNorm"``,
``"nn.LayerNorm"``) stands for itself. Functional calls (``F.softmax(x)`` inside a ``forward``)
are not covered: only modules can be hooked.

While the autocast region of the ``amp`` strategy is active, the hooks of :class:`PrecisionHooks`

* run a **black-listed** module with autocast off and its floating-point inputs cast to float32,
  so everything inside it computes in float32;
* run a **white-listed** module on inputs cast to the low-precision dtype; a module without
  parameters (softmax, activations, pooling) also runs with autocast off, so no op inside it is
  promoted back to float32; a module with parameters keeps autocast on, which casts its weights
  for the ops autocast runs in low precision (linear, conv) and leaves the ops autocast pins to
  float32 (on CUDA: layer_norm, group_norm) where they are;
* cast the floating-point outputs of the whole model to float32, so the loss the user computes
  outside the model is computed in float32.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch
from torch import nn

__all__ = ["PADDLE_OPS", "resolve", "low_precision_dtype", "PrecisionHooks"]

_POOL2D = (nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveMaxPool2d, nn.AdaptiveAvgPool2d)
_POOL3D = (nn.MaxPool3d, nn.AvgPool3d, nn.AdaptiveMaxPool3d, nn.AdaptiveAvgPool3d)
_BATCH_NORM = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
_CROSS_ENTROPY = (nn.CrossEntropyLoss,)

#: Paddle op name -> the ``torch.nn`` module types that run it.
PADDLE_OPS: Mapping[str, tuple[type[nn.Module], ...]] = {
    "conv2d": (nn.Conv2d,),
    "depthwise_conv2d": (nn.Conv2d,),
    "conv3d": (nn.Conv3d,),
    "conv2d_transpose": (nn.ConvTranspose2d,),
    "conv3d_transpose": (nn.ConvTranspose3d,),
    "matmul": (nn.Linear, nn.Bilinear),
    "matmul_v2": (nn.Linear, nn.Bilinear),
    "mul": (nn.Linear, nn.Bilinear),
    "lookup_table": (nn.Embedding, nn.EmbeddingBag),
    "lookup_table_v2": (nn.Embedding, nn.EmbeddingBag),
    "softmax": (nn.Softmax,),
    "log_softmax": (nn.LogSoftmax,),
    "layer_norm": (nn.LayerNorm,),
    "batch_norm": _BATCH_NORM,
    "sync_batch_norm": (nn.SyncBatchNorm,),
    "group_norm": (nn.GroupNorm,),
    "instance_norm": (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d),
    "pool2d": _POOL2D,
    "pool3d": _POOL3D,
    "dropout": (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d),
    "relu": (nn.ReLU,),
    "relu6": (nn.ReLU6,),
    "leaky_relu": (nn.LeakyReLU,),
    "elu": (nn.ELU,),
    "gelu": (nn.GELU,),
    "sigmoid": (nn.Sigmoid,),
    "tanh": (nn.Tanh,),
    "swish": (nn.SiLU,),
    "silu": (nn.SiLU,),
    "hard_swish": (nn.Hardswish,),
    "hard_sigmoid": (nn.Hardsigmoid,),
    "softplus": (nn.Softplus,),
    "prelu": (nn.PReLU,),
    "cos_sim": (nn.CosineSimilarity,),
    "softmax_with_cross_entropy": _CROSS_ENTROPY,
    "cross_entropy": _CROSS_ENTROPY,
    "cross_entropy2": _CROSS_ENTROPY,
    "sigmoid_cross_entropy_with_logits": (nn.BCEWithLogitsLoss,),
    "mse_loss": (nn.MSELoss,),
    "multihead_matmul": (nn.MultiheadAttention,),
    "fused_attention": (nn.MultiheadAttention,),
}


def resolve(name: str) -> tuple[type[nn.Module], ...]:
    """The module types a list entry names: a Paddle op of :data:`PADDLE_OPS`, or a ``torch.nn``
    module class (``"LayerNorm"``, ``"nn.LayerNorm"``, ``"torch.nn.LayerNorm"``).

    Raises:
        ValueError: neither; the message lists the Paddle op names.

    Example:
        >>> resolve("layer_norm") == (nn.LayerNorm,), resolve("nn.GELU") == (nn.GELU,)
        (True, True)
    """
    if name in PADDLE_OPS:
        return PADDLE_OPS[name]
    bare = name
    for prefix in ("torch.nn.", "nn."):
        if bare.startswith(prefix):
            bare = bare[len(prefix):]
    cls = getattr(nn, bare, None)
    if isinstance(cls, type) and issubclass(cls, nn.Module) and bare[:1].isupper():
        return (cls,)
    raise ValueError(f"unknown op or module {name!r}: name a torch.nn module class (e.g. "
                     f"'LayerNorm') or one of the Paddle ops {', '.join(sorted(PADDLE_OPS))}; "
                     f"functional calls cannot be listed")


def low_precision_dtype(device: str) -> torch.dtype:
    """float16 on CUDA (Paddle's AMP dtype), bfloat16 on CPU (what CPU autocast supports best)."""
    return torch.float16 if device == "cuda" else torch.bfloat16


def _cast(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with every floating-point tensor in it (tuples, lists, dicts) cast to ``dtype``."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(_cast(v, dtype) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_cast(v, dtype) for v in value)
    if isinstance(value, dict):
        return type(value)((k, _cast(v, dtype)) for k, v in value.items())
    return value


class PrecisionHooks:
    """Forward hooks pinning listed modules to float32 or low precision, active only inside
    :meth:`region` (the autocast region of one training context). When the fleet re-plans (a new
    training context), the hooks of the old one stay registered but never run again: only the
    new context enters its own region.

    Args:
        device: ``"cpu"`` or ``"cuda"`` (the autocast device type).
        dtype: the low-precision dtype.

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.Softmax(-1))
        >>> hooks = PrecisionHooks("cpu", torch.bfloat16)
        >>> hooks.install(model, black=(nn.Softmax,), white=())
        >>> with hooks.region():
        ...     model(torch.randn(2, 4)).dtype
        torch.float32
    """

    def __init__(self, device: str, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype
        self.active = 0
        self._entered: list[Any] = []
        self.handles: list[Any] = []

    def install(self, model: nn.Module, black: tuple[type, ...], white: tuple[type, ...],
                black_names: Iterable[str] = ()) -> None:
        """Hook the modules of ``model`` whose type is listed, or whose qualified name (in
        ``model.named_modules()``) is in ``black_names``, and the model's output.

        Raises:
            ValueError: a name of ``black_names`` names no module of the model.
        """
        names = set(black_names)
        modules = dict(model.named_modules())
        missing = sorted(names - set(modules))
        if missing:
            raise ValueError(f"custom_black_varnames {missing} name no module of the model "
                             f"(module names look like {sorted(modules)[1:4]})")
        for name, module in modules.items():
            if name in names or isinstance(module, black):
                self._hook(module, torch.float32, autocast=False)
            elif isinstance(module, white):
                has_params = any(p.is_floating_point() for p in module.parameters())
                self._hook(module, self.dtype, autocast=has_params)
        self.handles.append(model.register_forward_hook(self._outputs_to_float32))

    def _hook(self, module: nn.Module, dtype: torch.dtype, autocast: bool) -> None:
        def enter(mod: nn.Module, args: tuple, kwargs: dict) -> Any:
            if not self.active:
                self._entered.append(None)
                return None
            region = torch.autocast(self.device, dtype=self.dtype, enabled=autocast)
            region.__enter__()
            self._entered.append(region)
            return _cast(args, dtype), _cast(kwargs, dtype)

        def leave(mod: nn.Module, args: tuple, output: Any) -> None:
            region = self._entered.pop()
            if region is not None:
                region.__exit__(None, None, None)

        # always_call: the region is left even when the forward raises.
        self.handles.append(module.register_forward_pre_hook(enter, with_kwargs=True))
        self.handles.append(module.register_forward_hook(leave, always_call=True))

    def _outputs_to_float32(self, module: nn.Module, args: tuple, output: Any) -> Any:
        return _cast(output, torch.float32) if self.active else None

    def region(self) -> "_Region":
        """The context manager of a forward in mixed precision: autocast plus these hooks."""
        return _Region(self)

    def backward_region(self) -> "_Region":
        """The context manager of a backward: these hooks only, no autocast. A module that
        ``recompute`` checkpoints runs its forward again inside backward; torch.utils.checkpoint
        restores the autocast state of the forward but knows nothing of these hooks, so without
        them a float32-listed layer would be recomputed in low precision (and checkpoint would
        refuse the mismatch)."""
        return _Region(self, autocast=False)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


class _Region:
    def __init__(self, hooks: PrecisionHooks, autocast: bool = True) -> None:
        self.hooks = hooks
        self.autocast = torch.autocast(hooks.device, dtype=hooks.dtype, enabled=autocast)

    def __enter__(self) -> None:
        self.autocast.__enter__()
        self.hooks.active += 1

    def __exit__(self, *exc: Any) -> None:
        self.hooks.active -= 1
        self.autocast.__exit__(*exc)
