"""Stage-to-stage transfers of a pipeline over ``torch.distributed`` point-to-point.

Activations go forward with a small header (count, dtype, shape and requires-grad of each tensor)
so the receiver can allocate them; gradients come back without one (the sender of the
activations knows their shapes). Sends are asynchronous and waited for only at the end of the
mini-batch: 1F1B has a stage send an activation forward while its successor sends a gradient
back, and two blocking sends facing each other would deadlock whether or not the transport
buffers them. Every wait has a timeout, and a peer that dies or stays silent is an error naming
its stage and rank.

The headers live on the pipe group's device (``PipeGroup.device``): NCCL moves CUDA tensors
only. NCCL also ignores tags; the order still holds there, because each direction carries its
messages in the order the receiver asks for them (headers and activations forward, gradients
back).
"""
from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from fleetx.parallel.api import PipelineError
from fleetx.parallel.stage import PipeGroup

# PipelineError is defined in the contract module; it stays importable from here.
__all__ = ["PipelineError", "P2P"]

_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64,
           torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)
_HEADER = 64  # int64 words: room for e.g. 4 tensors of 8 dimensions
_ACT, _GRAD, _HEAD = 1, 2, 3  # tags: one per kind of message, so no kind overtakes another


class P2P:
    """The transfers of one stage with its neighbours.

    Args:
        pipe: this process's pipeline.
        timeout: seconds any single transfer may wait for its peer.
        cache_shape: send the activation header only for the first micro-batch of each
            mini-batch (Paddle's ``p2p_cache_shape``); every micro-batch has the same shapes.
    """

    def __init__(self, pipe: PipeGroup, timeout: float, cache_shape: bool = True) -> None:
        self.pipe, self.cache_shape = pipe, cache_shape
        self.timeout = timedelta(seconds=timeout)
        self._pending: list[tuple[Any, torch.Tensor, str]] = []
        self._header: Optional[list[tuple[torch.dtype, bool, tuple]]] = None

    def _peer(self, stage: int) -> str:
        return f"stage {stage} (rank {self.pipe.ranks[stage]})"

    @contextlib.contextmanager
    def _naming(self, what: str) -> Iterator[None]:
        """Turn the transport's error (a closed connection, a timeout) into one naming the
        peer stage."""
        try:
            yield
        except RuntimeError as error:
            me = self._peer(self.pipe.stage)
            raise PipelineError(f"pipeline {me}: {what} failed within "
                                f"{self.timeout.total_seconds():.0f} s ({error})") from error

    def _wait(self, work: Any, what: str) -> None:
        with self._naming(what):
            work.wait(self.timeout)

    def _send(self, tensor: torch.Tensor, stage: int, tag: int, what: str) -> None:
        tensor = tensor.detach().contiguous()
        what = f"sending {what} to {self._peer(stage)}"
        with self._naming(what):
            work = dist.isend(tensor, self.pipe.ranks[stage], group=self.pipe.group, tag=tag)
        self._pending.append((work, tensor, what))

    def _recv(self, like: torch.Tensor, stage: int, tag: int, what: str) -> torch.Tensor:
        what = f"receiving {what} from {self._peer(stage)}"
        with self._naming(what):
            work = dist.irecv(like, self.pipe.ranks[stage], group=self.pipe.group, tag=tag)
        self._wait(work, what)
        return like

    def send_forward(self, tensors: Sequence[torch.Tensor], first: bool) -> None:
        """Send this stage's output to the next stage (the header too unless cached)."""
        nxt = self.pipe.stage + 1
        if first or not self.cache_shape:
            self._send(_encode(tensors, self.pipe.device), nxt, _HEAD, "the activation header")
        for t in tensors:
            self._send(t, nxt, _ACT, "an activation")

    def recv_forward(self, first: bool, device: torch.device) -> tuple[torch.Tensor, ...]:
        """Receive the previous stage's output; floating tensors its sender computed with grad
        come back requiring grad, so this stage's backward yields their gradients."""
        prev = self.pipe.stage - 1
        if first or not self.cache_shape or self._header is None:
            head = torch.empty(_HEADER, dtype=torch.int64, device=self.pipe.device)
            self._header = _decode(self._recv(head, prev, _HEAD, "the activation header"))
        out = []
        for dtype, needs_grad, shape in self._header:
            t = self._recv(torch.empty(shape, dtype=dtype, device=device), prev, _ACT,
                           "an activation")
            out.append(t.requires_grad_(needs_grad))
        return tuple(out)

    def send_backward(self, inputs: Sequence[torch.Tensor]) -> None:
        """Send the gradients of this stage's received inputs back (zeros for unused ones)."""
        for t in inputs:
            if t.requires_grad:
                grad = t.grad if t.grad is not None else torch.zeros_like(t)
                self._send(grad, self.pipe.stage - 1, _GRAD, "a gradient")

    def recv_backward(self, outputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The next stage's gradients of ``outputs`` (those requiring grad, in order)."""
        return [self._recv(torch.empty_like(t), self.pipe.stage + 1, _GRAD, "a gradient")
                for t in outputs if t.requires_grad]

    def flush(self) -> None:
        """Wait for every send of the mini-batch."""
        pending, self._pending = self._pending, []
        for work, _, what in pending:
            self._wait(work, what)


def _encode(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    words = [len(tensors)]
    for t in tensors:
        if t.dtype not in _DTYPES:
            raise PipelineError(f"cannot send a {t.dtype} tensor between pipeline stages "
                                f"(supported: {[str(d) for d in _DTYPES]})")
        words += [_DTYPES.index(t.dtype), int(t.requires_grad), t.dim(), *t.shape]
    if len(words) > _HEADER:
        raise PipelineError(f"a stage output of {len(tensors)} tensors with "
                            f"{sum(t.dim() for t in tensors)} dimensions in all does not fit the "
                            f"{_HEADER}-word transfer header")
    return torch.tensor(words + [0] * (_HEADER - len(words)), dtype=torch.int64, device=device)


def _decode(head: torch.Tensor) -> list[tuple[torch.dtype, bool, tuple]]:
    words, out, at = head.tolist(), [], 1
    for _ in range(words[0]):
        dtype, needs_grad, ndim = words[at:at + 3]
        out.append((_DTYPES[dtype], bool(needs_grad), tuple(words[at + 3:at + 3 + ndim])))
        at += 3 + ndim
    return out
