"""What a heter worker runs: the device of its sections (``heter_worker_device_guard``) and
each section's module with the weights of the moment (``docs/heter.md``)."""
from __future__ import annotations

from typing import Optional

import torch

from fleetx.ps.api import PSConfigError

__all__ = ["Section", "heter_device", "DEVICE_GUARDS"]

#: ``a_sync_configs["heter_worker_device_guard"]`` values
DEVICE_GUARDS = ("cpu", "gpu", "xpu")


def heter_device(guard: str, cuda: Optional[bool] = None, xpu: Optional[bool] = None
                 ) -> tuple[torch.device, str]:
    """The device a heter worker runs its sections on, and why.

    ``"gpu"`` is CUDA when this process sees a CUDA device, ``"xpu"`` torch's XPU when it sees
    one; otherwise, and for ``"cpu"``, the CPU (the note says so).

    Raises:
        PSConfigError: ``guard`` is not one of :data:`DEVICE_GUARDS`.
    """
    if guard not in DEVICE_GUARDS:
        raise PSConfigError(f"heter_worker_device_guard={guard!r}: expected one of "
                            f"{', '.join(DEVICE_GUARDS)}")
    if guard == "gpu":
        if torch.cuda.is_available() if cuda is None else cuda:
            return torch.device("cuda", 0), "heter_worker_device_guard='gpu': CUDA device 0"
        return torch.device("cpu"), "heter_worker_device_guard='gpu', but no CUDA device: CPU"
    if guard == "xpu":
        seen = (hasattr(torch, "xpu") and torch.xpu.is_available()) if xpu is None else xpu
        if seen:
            return torch.device("xpu", 0), "heter_worker_device_guard='xpu': XPU device 0"
        return torch.device("cpu"), "heter_worker_device_guard='xpu', but no XPU device: CPU"
    return torch.device("cpu"), "heter_worker_device_guard='cpu': CPU"


class Section:
    """A section's module and the parameter tensors its forwards run on.

    The tensors are replaced (never changed in place) when new weights arrive, so a graph that
    still waits for its backward keeps the weights its forward saw; its backward leaves the
    gradients on those tensors, and :meth:`collect` adds them to the step's sums.

    Args:
        module: the section's module (on the heter worker's device).

    Example:
        >>> section = Section(torch.nn.Linear(4, 1))
        >>> section([torch.ones(2, 4)])[0].shape
        torch.Size([2, 1])
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.sums: dict[str, torch.Tensor] = {}
        self.refresh()

    def refresh(self) -> None:
        """Forwards from now on use the module's current weights."""
        self.weights = {n: p.detach().clone().requires_grad_(p.requires_grad)
                        for n, p in self.module.named_parameters()}

    def __call__(self, inputs: list) -> tuple:
        return _as_tuple(torch.func.functional_call(self.module, self.weights, tuple(inputs)))

    @torch.no_grad()
    def collect(self, weights: dict) -> None:
        """Add the gradients a backward left on ``weights`` (a forward's) to the sums."""
        for n, w in weights.items():
            if w.grad is not None:
                self.sums[n] = self.sums[n] + w.grad if n in self.sums else w.grad
                w.grad = None

    def hand_over(self) -> None:
        """Put the sums where the layout reads gradients (the parameters' ``grad``), and
        start new ones."""
        for n, p in self.module.named_parameters():
            p.grad = self.sums.get(n)
        self.sums = {}


def _as_tuple(value) -> tuple:
    if isinstance(value, torch.Tensor):
        return (value,)
    if isinstance(value, (tuple, list)) and all(isinstance(v, torch.Tensor) for v in value):
        return tuple(value)
    raise TypeError(f"a HeterSection's module returned {type(value).__name__}; it must return "
                    "a tensor or a tuple of tensors")
