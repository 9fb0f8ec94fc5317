"""Pipeline parallelism, the model side: Paddle's ``PipelineLayer``, ``LayerDesc`` and
``SharedLayerDesc``.

A ``PipelineLayer`` is described by a flat list of layers (built modules or ``LayerDesc``
recipes), the layers of an ``nn.Sequential``. Each stage of the pipe group builds only its own
slice of that list, so a model too large for one process is never built whole. The stage keeps
the global indexes as its sub-module names, so ``state_dict()`` keys are those of
``nn.Sequential(*layers)`` (``"4.weight"``) and the stages' dicts merge into the unsplit
model's.

A ``SharedLayerDesc`` names a layer used at several places of the list (Paddle's example: the
token embedding reused as the output projection). Every stage holding one of those places builds
the layer; the first such stage's weights are broadcast to the others at construction, and after
backward the gradients of the shared weight are summed over those stages (an all-reduce over a
group of exactly the stages that hold it), so the copies stay equal step after step.

The schedule that runs the stages is in :mod:`fleetx.parallel.schedule`.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from fleetx.parallel.stage import PipeGroup, resolve_pipe_group, transfer_device

__all__ = ["LayerDesc", "SharedLayerDesc", "PipelineLayer", "segment"]


class LayerDesc:
    """A layer to be built later, on the stage that owns it: ``LayerDesc(cls, *args, **kw)``.

    Args:
        layer_func: an ``nn.Module`` subclass.
        *inputs, **kwargs: its constructor arguments.

    Raises:
        TypeError: ``layer_func`` is not an ``nn.Module`` subclass.

    Example:
        >>> LayerDesc(nn.Linear, 16, 16).build_layer()
        Linear(in_features=16, out_features=16, bias=True)
    """

    def __init__(self, layer_func: type, *inputs: Any, **kwargs: Any) -> None:
        if not (isinstance(layer_func, type) and issubclass(layer_func, nn.Module)):
            raise TypeError(f"LayerDesc expects an nn.Module subclass, got {layer_func!r}")
        self.layer_func, self.inputs, self.kwargs = layer_func, inputs, kwargs

    def build_layer(self) -> nn.Module:
        return self.layer_func(*self.inputs, **self.kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.layer_func.__name__})"


class SharedLayerDesc(LayerDesc):
    """A layer shared by several places of the list, tied across the stages that hold them.

    Args:
        key: the name that ties the places together (one layer per key).
        layer_func: an ``nn.Module`` subclass (built once per stage that holds the key).
        forward_func: ``forward_func(layer, *inputs)`` used at this place instead of
            ``layer(*inputs)`` (e.g. the embedding's weight as an output projection).
        shared_weight_attr: the attribute (or attributes) whose gradients are summed across
            stages.
        *inputs, **kwargs: the constructor arguments of ``layer_func``.

    Example:
        >>> head = SharedLayerDesc("embed", nn.Embedding, lambda emb, h: h @ emb.weight.t(),
        ...                        "weight", 100, 16)
    """

    def __init__(self, key: str, layer_func: type, forward_func: Optional[Callable] = None,
                 shared_weight_attr: str | Sequence[str] = "weight", *inputs: Any,
                 **kwargs: Any) -> None:
        super().__init__(layer_func, *inputs, **kwargs)
        self.layer_name, self.forward_func = key, forward_func
        attrs = shared_weight_attr
        self.shared_weight_attr = (attrs,) if isinstance(attrs, str) else tuple(attrs)


def _class_name(item: Any) -> str:
    return item.layer_func.__name__ if isinstance(item, LayerDesc) else type(item).__name__


def segment(layers: Sequence[Any], num_stages: int, seg_method: str = "uniform") -> list[int]:
    """Stage boundaries: stage ``s`` holds ``layers[bounds[s]:bounds[s + 1]]``.

    ``"uniform"`` splits the count of layers as evenly as possible (the first stages take one
    more when it does not divide). ``"layer:<ClassName>"`` splits the layers whose class name
    matches ``<ClassName>`` (a regular expression, case-insensitive, as in Paddle) as evenly as
    possible; a stage ends right after its last matching layer, so the layers before the first
    match go to the first stage and the layers after the last match to the last.

    Args:
        layers: the ``PipelineLayer`` list (modules and descriptions).
        num_stages: the number of stages.
        seg_method: ``"uniform"`` or ``"layer:<ClassName>"``.

    Raises:
        ValueError: an unknown method, or fewer layers (matching layers) than stages.

    Example:
        >>> segment([nn.ReLU()] * 5, 2)
        [0, 3, 5]
    """
    n = len(layers)
    if seg_method == "uniform":
        if n < num_stages:
            raise ValueError(f"cannot split {n} layers into {num_stages} pipeline stages")
        return [0] + _cumulative(_even(n, num_stages))
    if not seg_method.startswith("layer:") or not seg_method[len("layer:"):]:
        raise ValueError(f"unknown seg_method {seg_method!r}: use 'uniform' or "
                         f"'layer:<ClassName>'")
    pattern = re.compile(seg_method[len("layer:"):], re.IGNORECASE)
    matches = [i for i, item in enumerate(layers) if pattern.search(_class_name(item))]
    if len(matches) < num_stages:
        raise ValueError(f"seg_method {seg_method!r} matches {len(matches)} layers, fewer than "
                         f"the {num_stages} pipeline stages (classes: "
                         f"{sorted({_class_name(item) for item in layers})})")
    ends = _cumulative(_even(len(matches), num_stages))
    return [0] + [matches[e - 1] + 1 for e in ends[:-1]] + [n]


def _even(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if s < total % parts else 0) for s in range(parts)]


def _cumulative(sizes: list[int]) -> list[int]:
    out, acc = [], 0
    for size in sizes:
        acc += size
        out.append(acc)
    return out


class _Place:
    """One place of a shared layer whose ``forward_func`` replaces the layer's forward (not a
    module: the layer itself is registered at the place's index)."""

    def __init__(self, layer: nn.Module, forward_func: Callable) -> None:
        self.layer, self.forward_func = layer, forward_func

    def __call__(self, *inputs: Any) -> Any:
        return self.forward_func(self.layer, *inputs)


class PipelineLayer(nn.Module):
    """The stage of a pipelined ``nn.Sequential`` that this process runs.

    Args:
        layers: the whole model as a list of ``nn.Module`` / ``LayerDesc`` / ``SharedLayerDesc``.
            Built modules are kept as given (every stage then holds them all; descriptions are
            built only on their stage).
        num_stages: the number of stages; defaults to the pipe group's size and must equal it.
        topology: Paddle's ``CommunicateTopology`` (its ``get_dim("pipe")`` is the number of
            stages), or None.
        loss_fn: ``loss_fn(output, labels)``, computed on the last stage.
        seg_method: ``"uniform"`` or ``"layer:<ClassName>"`` (see :func:`segment`).
        recompute_interval: when > 0, each run of that many consecutive layers of the stage is
            recomputed in backward instead of keeping its activations (training only).
        group: (fleetx extension) the pipe group, a torch process group; by default the hybrid
            group's pipe group, or the whole world as one pipeline without ``fleet.init``.

    Raises:
        ValueError: ``num_stages`` or ``topology`` disagrees with the pipe group, a bad
            ``seg_method`` or ``recompute_interval``.

    Example:
        >>> model = PipelineLayer([LayerDesc(nn.Linear, 8, 8), nn.ReLU(), LayerDesc(nn.Linear, 8, 2)],
        ...                       loss_fn=nn.MSELoss())
    """

    def __init__(self, layers: Sequence[Any], num_stages: Optional[int] = None,
                 topology: Any = None, loss_fn: Optional[Callable] = None,
                 seg_method: str = "uniform", recompute_interval: int = 0,
                 group: Optional[dist.ProcessGroup] = None) -> None:
        super().__init__()
        if recompute_interval < 0:
            raise ValueError(f"recompute_interval must be >= 0, got {recompute_interval}")
        self.pipe: PipeGroup = resolve_pipe_group(group, num_stages, topology)
        self.loss_fn, self.recompute_interval = loss_fn, recompute_interval
        self.layer_list = list(layers)
        self.bounds = segment(self.layer_list, self.pipe.num_stages, seg_method)
        self.start, self.end = self.bounds[self.pipe.stage], self.bounds[self.pipe.stage + 1]
        self._shared: dict[str, nn.Module] = {}
        self._build()
        self.shared_groups = self._tie_shared()

    @property
    def stage_id(self) -> int:
        return self.pipe.stage

    @property
    def num_stages(self) -> int:
        return self.pipe.num_stages

    def is_first_stage(self) -> bool:
        return self.pipe.stage == 0

    def is_last_stage(self) -> bool:
        return self.pipe.stage == self.pipe.num_stages - 1

    def _build(self) -> None:
        """Build this stage's layers, registered under their global indexes."""
        self.run_functions: list[Callable] = []
        for index in range(self.start, self.end):
            item = self.layer_list[index]
            if isinstance(item, SharedLayerDesc):
                if item.layer_name not in self._shared:
                    self._shared[item.layer_name] = item.build_layer()
                layer = self._shared[item.layer_name]
                # Registered at every place, as nn.Sequential would list a reused module:
                # state_dict has each index's keys, parameters() lists the layer once.
                self.add_module(str(index), layer)
                run = layer if item.forward_func is None else _Place(layer, item.forward_func)
            elif isinstance(item, LayerDesc):
                run = item.build_layer()
                self.add_module(str(index), run)
            elif isinstance(item, nn.Module):
                run = item
                self.add_module(str(index), run)
            else:  # a plain function (Paddle allows them): nothing to register
                if not callable(item):
                    raise TypeError(f"layer {index} is {item!r}: expected an nn.Module, a "
                                    f"LayerDesc or a callable")
                run = item
            self.run_functions.append(run)

    def _tie_shared(self) -> dict[str, tuple[dist.ProcessGroup, int, nn.Module, tuple]]:
        """One group per shared key and per pipeline, made by every rank in the same order;
        the first holding stage's weights are broadcast to the others.

        Returns:
            key -> (group, global rank of the first holder, layer, weight attributes), for the
            keys this stage holds with other stages.
        """
        keys: dict[str, list[int]] = {}
        attrs: dict[str, tuple] = {}
        for index, item in enumerate(self.layer_list):
            if isinstance(item, SharedLayerDesc):
                stage = next(s for s in range(self.num_stages) if index < self.bounds[s + 1])
                holders = keys.setdefault(item.layer_name, [])
                if stage not in holders:
                    holders.append(stage)
                attrs[item.layer_name] = item.shared_weight_attr
        tied: dict = {}
        for key, stages in keys.items():
            if len(stages) < 2:
                continue
            for pipeline in self.pipe.all_pipelines:  # every rank makes every group
                ranks = [pipeline[s] for s in stages]
                group = dist.new_group(ranks)
                if self.pipe.ranks == pipeline and self.stage_id in stages:
                    tied[key] = (group, ranks[0], self._shared[key], attrs[key])
        for group, src, layer, names in tied.values():
            with torch.no_grad():
                for name in names:
                    weight = getattr(layer, name)
                    # a stage is usually built on the CPU and moved to its GPU afterwards, but
                    # NCCL moves CUDA tensors only: the weights travel on the group's device
                    carrier = weight.to(transfer_device(group))
                    dist.broadcast(carrier, src=src, group=group)
                    if carrier is not weight:
                        weight.copy_(carrier)
        return tied

    def allreduce_shared_weight_gradients(self) -> None:
        """Sum the gradients of the shared weights over the stages that hold them."""
        for group, _, layer, names in self.shared_groups.values():
            for name in names:
                weight = getattr(layer, name)
                if weight.grad is None:
                    weight.grad = torch.zeros_like(weight)
                dist.all_reduce(weight.grad, group=group)

    def forward(self, *inputs: Any) -> Any:
        """Run this stage's layers (a tuple output is unpacked into the next layer)."""
        x = inputs if len(inputs) != 1 else inputs[0]
        step = self.recompute_interval
        if step > 0 and self.training and torch.is_grad_enabled():
            for begin in range(0, len(self.run_functions), step):
                x = _as_tuple(x)
                x = checkpoint(self._run, begin, begin + step, *x, use_reentrant=False)
            return x
        return self._run(0, len(self.run_functions), *_as_tuple(x))

    def _run(self, begin: int, end: int, *inputs: Any) -> Any:
        x: Any = inputs if len(inputs) != 1 else inputs[0]
        for run in self.run_functions[begin:end]:
            x = run(*x) if isinstance(x, tuple) else run(x)
        return x


def _as_tuple(x: Any) -> tuple:
    return x if isinstance(x, tuple) else (x,)
