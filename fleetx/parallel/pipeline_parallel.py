"""``PipelineParallel``: runs a :class:`~fleetx.parallel.pipeline.PipelineLayer` stage through a
schedule, one mini-batch per ``train_batch`` call (what ``fleet.distributed_model`` returns for a
``PipelineLayer``).

Why a schedule of our own rather than ``torch.distributed.pipelining``: the contract needs
Paddle's layer descriptions built per stage with the unsplit model's state-dict keys, weights tied
across stages, every transfer bounded by a timeout that names the silent stage, and runs on gloo
between CPU processes. ``torch.distributed.pipelining`` splits a traced or manually cut module of
its own and waits on its transfers with the process group's timeout and no stage in the error;
the two schedules here are a few lines each as data (:mod:`fleetx.parallel.schedule`) over
asynchronous point-to-point sends (:mod:`fleetx.parallel.p2p`).

The mini-batch ``data = [inputs, labels]`` is given identically to every stage; the first stage
reads the inputs, the last the labels. It is cut into ``accumulate_steps`` micro-batches of
``micro_batch_size`` samples; the last stage's loss of each is divided by their number before
backward, so the gradients are those of the mean loss over the mini-batch when ``loss_fn``
averages over samples, as the unsplit model's would be.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, ContextManager, Optional

import torch
import torch.distributed as dist
from torch import nn

from fleetx.parallel.api import PipelineError, StageOptimizer
from fleetx.parallel.p2p import P2P
from fleetx.parallel.pipeline import PipelineLayer
from fleetx.parallel.schedule import normalize_mode, steps

__all__ = ["PipelineParallel"]


class PipelineParallel(nn.Module):
    """A pipeline stage with its schedule: ``train_batch`` / ``eval_batch``.

    Args:
        layers: this process's ``PipelineLayer``.
        micro_batch_size: samples per micro-batch.
        accumulate_steps: micro-batches per mini-batch.
        schedule_mode: ``"1F1B"`` or ``"FThenB"`` (``"F-then-B"`` accepted).
        p2p_cache_shape: send the activation shapes once per mini-batch.
        timeout: seconds a transfer may wait for a neighbouring stage.
        autocast_dtype: when set, forwards (and their recomputation) run under
            ``torch.autocast`` in this dtype (the ``amp`` strategy).
        dp_group: (fleetx extension) the data-parallel group of this stage: the stages at
            the same place of the other pipelines, whose gradients ``train_batch`` averages
            before the step (``fleet.distributed_model`` passes the hybrid topology's when
            ``dp_degree > 1``); None: no data parallelism.
        forward_context: (fleetx extension) returns the context manager every forward (and
            loss) runs in, instead of ``autocast_dtype``'s autocast: ``fleet.distributed_model``
            passes its training context's, which holds amp's autocast and custom op lists.

    Raises:
        TypeError: ``layers`` is not a ``PipelineLayer``.
        ValueError: an unknown schedule, or a last stage without ``loss_fn``.

    Example:
        >>> model = fleet.distributed_model(PipelineLayer(descs, loss_fn=nn.MSELoss()))
        >>> loss = model.train_batch([x, y], optimizer)
    """

    def __init__(self, layers: PipelineLayer, micro_batch_size: int = 1,
                 accumulate_steps: int = 1, schedule_mode: str = "1F1B",
                 p2p_cache_shape: bool = True, timeout: float = 1800.0,
                 autocast_dtype: Optional[torch.dtype] = None,
                 dp_group: Optional[dist.ProcessGroup] = None,
                 forward_context: Optional[Callable[[], ContextManager]] = None) -> None:
        super().__init__()
        if not isinstance(layers, PipelineLayer):
            raise TypeError(f"PipelineParallel expects a PipelineLayer, got "
                            f"{type(layers).__name__}")
        if layers.is_last_stage() and layers.loss_fn is None:
            raise ValueError("the last pipeline stage needs PipelineLayer(loss_fn=...)")
        self._layers = layers
        self.micro_batch_size, self.accumulate_steps = micro_batch_size, accumulate_steps
        self.schedule_mode = normalize_mode(schedule_mode)
        self.autocast_dtype = autocast_dtype
        self.dp_group = dp_group
        self.forward_context = forward_context
        self.p2p = P2P(layers.pipe, timeout, p2p_cache_shape)
        self.timeline: list[tuple[str, int, float, float]] = []  # (kind, micro, start, end)
        self.peak_in_flight = 0

    def forward(self, *inputs: Any) -> Any:
        """This stage's layers alone (no transfers), as Paddle's wrapper does."""
        return self._layers(*inputs)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict:
        """The stage's parameters under the unsplit model's keys."""
        return self._layers.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        return self._layers.load_state_dict(state_dict, strict=strict, assign=assign)

    def train_batch(self, data: Any, optimizer: Any, lr_scheduler: Any = None,
                    scaler: Any = None) -> torch.Tensor:
        """Forward and backward every micro-batch of ``data``, then one optimizer step.

        Args:
            data: ``[inputs, labels]``, the same on every stage.
            optimizer: the optimizer over this stage's parameters. One from
                ``fleet.distributed_optimizer`` (a
                :class:`~fleetx.parallel.api.StageOptimizer`) runs every micro-batch's backward
                itself, so the strategies' hooks apply (amp's loss scaling and inf check).
            lr_scheduler: stepped once after the optimizer, when given.
            scaler: a ``GradScaler``-like object (``scale``, ``step``, ``update``), when given;
                not with an optimizer from ``fleet.distributed_optimizer`` (amp scales there).

        Returns:
            The mean loss over the micro-batches, on every stage.

        Raises:
            ValueError: the batch is not ``micro_batch_size * accumulate_steps`` samples, or
                ``scaler`` is given with a ``StageOptimizer``.
            PipelineError: a neighbouring stage failed or stayed silent past the timeout.
        """
        self.train()
        inputs, labels = self._micro_batches(data)
        loss = self._run(inputs, labels, training=True, backward=_Backward(optimizer, scaler))
        self._layers.allreduce_shared_weight_gradients()
        self._average_data_parallel_gradients()
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if lr_scheduler is not None:
            lr_scheduler.step()
        return loss

    def _average_data_parallel_gradients(self) -> None:
        """Average the stage's gradients over its data-parallel group (one flat all-reduce
        per dtype; after the tied weights' sums, so every replica steps the same)."""
        group = self.dp_group
        if group is None or dist.get_world_size(group) == 1:
            return
        grads: dict[torch.dtype, list] = {}
        for param in self._layers.parameters():
            if param.requires_grad:
                if param.grad is None:  # a replica must contribute every tensor
                    param.grad = torch.zeros_like(param)
                grads.setdefault(param.grad.dtype, []).append(param.grad)
        size = dist.get_world_size(group)
        for same in grads.values():
            flat = torch.cat([g.reshape(-1) for g in same]).div_(size)
            dist.all_reduce(flat, group=group)
            offset = 0
            for g in same:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()

    def eval_batch(self, data: Any, compute_loss: bool = True) -> Any:
        """Forward every micro-batch of ``data`` without gradients.

        Returns:
            With ``compute_loss``, the mean loss over the micro-batches on every stage; without,
            the last stage's outputs concatenated over the micro-batches there, None elsewhere.
        """
        self.eval()
        inputs, labels = self._micro_batches(data)
        with torch.no_grad():
            return self._run(inputs, labels, training=False, compute_loss=compute_loss)

    def _micro_batches(self, data: Any) -> tuple[list, list]:
        if not isinstance(data, (list, tuple)) or len(data) != 2:
            raise ValueError("data must be [inputs, labels] (the same on every stage)")
        m, size = self.accumulate_steps, self.micro_batch_size
        cut = []
        for part in data:
            first = part[0] if isinstance(part, (list, tuple)) else part
            if first is not None and first.shape[0] != m * size:
                raise ValueError(f"a batch of {first.shape[0]} samples, but pipeline_configs "
                                 f"micro_batch_size={size} x accumulate_steps={m} = {m * size}")
            cut.append([_slice(part, i * size, (i + 1) * size) for i in range(m)])
        return cut[0], cut[1]

    def _precision(self) -> Any:
        if self.forward_context is not None:
            return self.forward_context()
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        device = next(self._layers.parameters(), torch.empty(0)).device.type
        return torch.autocast(device, dtype=self.autocast_dtype)

    def _run(self, inputs: list, labels: list, training: bool,
             backward: Optional["_Backward"] = None, compute_loss: bool = True) -> Any:
        """Run the schedule; the mean loss broadcast from the last stage (or its outputs)."""
        layers, m = self._layers, self.accumulate_steps
        order = steps(self.schedule_mode, layers.num_stages, layers.stage_id, m)
        if not training:
            order = [s for s in order if s[0] == "F"]
        stash: dict[int, tuple] = {}
        results: list = []
        self.timeline = []
        if training:  # the last train_batch's figure survives eval_batch
            self.peak_in_flight = 0
        try:
            for kind, i in order:
                if kind == "F":
                    self._forward_step(i, inputs[i], labels[i], stash, results, compute_loss)
                    if training:
                        self.peak_in_flight = max(self.peak_in_flight, len(stash))
                else:
                    self._backward_step(i, stash, backward)
            self.p2p.flush()
        except PipelineError:
            raise
        except Exception as error:  # name the failing stage: its neighbours will see silence
            raise PipelineError(f"pipeline stage {layers.stage_id} (rank "
                                f"{layers.pipe.ranks[layers.stage_id]}) failed: {error!r}"
                                ) from error
        return self._result(results, compute_loss)

    def _forward_step(self, i: int, inputs: Any, labels: Any, stash: dict, results: list,
                      compute_loss: bool) -> None:
        layers = self._layers
        first_micro = i == 0
        if layers.is_first_stage():
            x = inputs if isinstance(inputs, tuple) else (inputs,)
        else:
            x = self.p2p.recv_forward(first_micro, _device_of(layers))
        start = time.perf_counter()
        with self._precision():
            out = layers(*x)
            if layers.is_last_stage() and compute_loss:
                out = layers.loss_fn(out, labels)
        self.timeline.append(("F", i, start, time.perf_counter()))
        if layers.is_last_stage():
            results.append(out.detach() if compute_loss else out)
        else:
            self.p2p.send_forward(out if isinstance(out, tuple) else (out,), first_micro)
        if torch.is_grad_enabled():
            stash[i] = (x, out)

    def _backward_step(self, i: int, stash: dict, backward: "_Backward") -> None:
        layers = self._layers
        x, out = stash.pop(i)
        start = time.perf_counter()
        if layers.is_last_stage():
            backward.loss(out / self.accumulate_steps)
        else:
            outs = [t for t in (out if isinstance(out, tuple) else (out,)) if t.requires_grad]
            grads = self.p2p.recv_backward(outs)
            start = time.perf_counter()  # the wait for the gradients is not backward time
            backward.from_outputs(outs, grads)
        self.timeline.append(("B", i, start, time.perf_counter()))
        if not layers.is_first_stage():
            self.p2p.send_backward(x)

    def _result(self, results: list, compute_loss: bool) -> Any:
        layers = self._layers
        if not compute_loss:
            return torch.cat(results) if layers.is_last_stage() else None
        pipe = layers.pipe
        loss = (torch.stack(results).float().mean() if layers.is_last_stage()
                else torch.zeros((), dtype=torch.float32, device=pipe.device))
        if pipe.group is not None and pipe.num_stages > 1:
            dist.broadcast(loss, src=pipe.ranks[-1], group=pipe.group)
        return loss


class _Backward:
    """How ``train_batch`` runs a stage's backward: through a
    :class:`~fleetx.parallel.api.StageOptimizer` when it is given one (the training context's
    loss scaling, backward regions and bookkeeping apply), else with ``torch.autograd`` on the
    loss scaled by ``scaler`` when there is one.

    Raises:
        ValueError: both a ``StageOptimizer`` and a ``scaler``: the loss would be scaled by
            one and unscaled by the other.
    """

    def __init__(self, optimizer: Any, scaler: Any) -> None:
        self.wrapper = optimizer if isinstance(optimizer, StageOptimizer) else None
        if self.wrapper is not None and scaler is not None:
            raise ValueError("train_batch: scaler= with an optimizer from "
                             "fleet.distributed_optimizer: its strategies run the backward "
                             "(strategy.amp scales the loss there); pass scaler=None")
        self.scaler = scaler

    def loss(self, loss: torch.Tensor) -> None:
        if self.wrapper is not None:
            self.wrapper.backward(loss)
        else:
            torch.autograd.backward(self.scaler.scale(loss) if self.scaler is not None
                                    else loss)

    def from_outputs(self, outputs: list, grads: list) -> None:
        if self.wrapper is not None:
            self.wrapper.backward_from(outputs, grads)
        else:
            torch.autograd.backward(outputs, grads)


def _slice(part: Any, begin: int, end: int) -> Any:
    if isinstance(part, (list, tuple)):
        return tuple(t[begin:end] for t in part)
    return part[begin:end]


def _device_of(layers: nn.Module) -> torch.device:
    return next(layers.parameters(), torch.empty(0)).device
