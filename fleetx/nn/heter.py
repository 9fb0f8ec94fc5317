"""``HeterSection``: the part of a model that a heter worker runs (``docs/heter.md``).

A parameter-server job with heter workers splits each training step between processes: the
CPU trainers read the data and run the sparse part (embedding lookups and whatever the model
computes from them), a heter worker runs the dense part, on a GPU when it has one, and both
push their gradients to the servers. PyTorch has no ``device_guard`` over a static program, so
the user marks the dense part by wrapping it::

    self.mlp = HeterSection(nn.Sequential(nn.Linear(70, 64), nn.ReLU(), nn.Linear(64, 1)))

The wrapper is a plain module: its parameters are the wrapped module's (every role builds them
with the same seed), and with nothing bound (no heter workers, a one-process run, inference)
``forward`` simply calls the wrapped module. In a heter job the training layer binds a *runner*
(anything callable as ``runner(section, inputs)``) on the trainers, which ships the inputs to
the heter worker and brings the outputs back, with a custom autograd function that sends the
outputs' gradients back in ``backward`` and receives the inputs'. The section's parameters
never change on the trainer then: they live in their own dense tables (``heter.<group>``),
pushed by the heter worker.

What it may import: torch only (it is a marker; the runner comes from the adapter that binds
it, :mod:`fleetx.ps_torch.heter`).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from torch import nn

__all__ = ["HeterSection"]


class HeterSection(nn.Module):
    """Marks ``module`` as the dense part a heter worker runs.

    Its inputs must be tensors (the activations the trainer computed, dense features...), and
    its outputs a tensor or a tuple of tensors, of dtypes the wire carries (float32, float64,
    int64, int32, uint8). It must be deterministic given its inputs and parameters (dropout
    runs on the heter worker with that process's random state).

    Args:
        module: the dense block.
        name: the section's name between trainer and heter worker (default: its path in the
            model, set when the model is laid out for the parameter server).

    Example:
        >>> model.mlp = HeterSection(model.mlp)           # before fleet.distributed_model
        >>> out = model.mlp(torch.cat([emb, dense], 1))   # run by the heter worker in a heter job
    """

    def __init__(self, module: nn.Module, name: Optional[str] = None) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"HeterSection wraps an nn.Module, got {type(module).__name__}")
        self.module = module
        self.section_name = name
        self.__dict__["_runner"] = None  # not a submodule: the trainer's link to its heter worker

    def bind(self, runner: Optional[Callable[["HeterSection", tuple], Any]]) -> None:
        """Run ``forward`` through ``runner(self, inputs)`` (None: run the module here)."""
        self.__dict__["_runner"] = runner

    @property
    def remote(self) -> bool:
        """True while a runner is bound (a heter worker runs the module)."""
        return self._runner is not None

    def forward(self, *inputs: Any) -> Any:
        if self._runner is None:
            return self.module(*inputs)
        return self._runner(self, inputs)

    def extra_repr(self) -> str:
        return f"name={self.section_name!r}" + (", remote" if self.remote else "")


def sections(model: nn.Module) -> dict[str, HeterSection]:
    """Every :class:`HeterSection` of ``model`` by name, named after its path when unnamed.

    Raises:
        ValueError: two sections share a name, or a section sits inside another.
    """
    out: dict[str, HeterSection] = {}
    for path, m in model.named_modules():
        if not isinstance(m, HeterSection):
            continue
        m.section_name = m.section_name or path or "section"
        if m.section_name in out:
            raise ValueError(f"two HeterSections are named {m.section_name!r}; give each its own "
                             "name")
        if any(isinstance(inner, HeterSection) for inner in m.module.modules()):
            raise ValueError(f"HeterSection {m.section_name!r} holds another HeterSection; a "
                             "heter worker runs one level of sections")
        out[m.section_name] = m
    return out
