"""Gradient communication as a pipeline: the one DDP comm hook, composed from strategy stages.

``DistributedDataParallel`` takes exactly one comm hook, registered once before the first
backward. Several strategies change how gradients travel: ``fp16_allreduce`` casts them, ``dgc``
sparsifies them, ``use_hierarchical_allreduce`` changes their route and ``nccl_comm_num`` spreads
buckets over several process groups. Each adds one stage to ``ctx.comm_hooks`` as
``(None, stage)``; :func:`compose` turns the stages into the hook::

    bucket -> / world size -> codec -> codec -> ... -> topology.all_reduce(channel = index mod n)

* :class:`GradientCodec`: changes the gradient around communication (cast, sparsify). Codecs
  nest in the order they were added, first outermost (strategies add them in plan order, which
  their ``runs_after`` relations fix: ``dgc`` before ``fp16_allreduce``); each passes what
  continues down the pipeline to ``link.all_reduce`` and may run collectives of its own with
  ``link.all_gather``.
* :class:`AllReducePath`: how a sum travels, :class:`FlatAllReduce` unless a strategy gives another
  (at most one).
* :class:`Channels`: how many independent process-group sets carry the buckets, round-robin by
  bucket index, all in flight at once (at most one).

DDP hands each bucket over as a *sum* of local gradients, not yet averaged. The pipeline divides
by the world size before any stage runs, so every stage sees a gradient whose sum over ranks is
the average, and a float16 sum cannot overflow where the float32 average would not.

Every collective is counted in a :class:`Traffic` record (payload bytes this process contributed
and a ring-model estimate of the bytes it put on the wire).

A plain DDP hook (``(state, hook)`` with DDP's signature) is still accepted when it is the only
entry; it cannot be mixed with stages, since it does its own communication.

With ``FLEETX_DEBUG_COLLECTIVES=1`` every bucket's all-reduce (whatever the topology) and the
flat topology's all-gathers are checked first (:func:`fleetx.comm.api.check_call`), and a model with no stages gets the plain pipeline (divide,
all-reduce: DDP's own arithmetic) so that its gradient all-reduces are checked too.
"""
from __future__ import annotations

import abc
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch.futures import Future

from fleetx.comm.api import check_call, checking

__all__ = ["CommHookError", "Traffic", "Downstream", "GradientCodec", "AllReducePath",
           "FlatAllReduce", "Channels", "Pipeline", "compose", "done"]


class CommHookError(RuntimeError):
    """Strategies installed gradient-communication hooks that cannot be composed."""


def done(value: Any) -> Future:
    """A future that already holds ``value``."""
    fut: Future = Future()
    fut.set_result(value)
    return fut


# Bytes each rank puts on the wire per payload byte, for the usual ring / tree algorithms over
# n ranks: an all-reduce sends its buffer about twice, a reduce or broadcast once, and an
# all-gather forwards every other rank's contribution.
_WIRE_FACTOR: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce": lambda n: (n - 1) / n,
    "broadcast": lambda n: (n - 1) / n,
    "all_gather": lambda n: float(n - 1),
}


@dataclass
class Traffic:
    """What this process contributed to gradient collectives since the model was built.

    Attributes:
        payload_bytes: bytes of the tensors this process handed to collectives.
        wire_bytes: estimated bytes it sent (ring model: see ``_WIRE_FACTOR``).
        collectives: number of collectives, and ``per_channel`` the same by channel.
        rounds: gradient synchronisations (one per backward that communicated).
    """

    payload_bytes: int = 0
    wire_bytes: float = 0.0
    collectives: int = 0
    rounds: int = 0
    per_channel: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()  # hierarchical channels record from their own threads

    def record(self, op: str, tensor: torch.Tensor, group_size: int, channel: int = 0) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        with self._lock:
            self.payload_bytes += nbytes
            self.wire_bytes += nbytes * _WIRE_FACTOR[op](group_size)
            self.collectives += 1
            self.per_channel[channel] = self.per_channel.get(channel, 0) + 1

    def state_dict(self) -> dict:
        return {"payload_bytes": self.payload_bytes, "wire_bytes": self.wire_bytes,
                "collectives": self.collectives, "rounds": self.rounds,
                "per_channel": dict(self.per_channel)}

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, dict(value) if key == "per_channel" else value)


class AllReducePath(abc.ABC):
    """How a sum-all-reduce of one tensor travels among the data-parallel ranks."""

    @abc.abstractmethod
    def connect(self, group: Any, channels: int) -> None:
        """Create the process groups of ``channels`` independent sets from ``group``'s ranks.

        Collective: every rank calls it, in the same order relative to other group creations.
        """

    @abc.abstractmethod
    def all_reduce(self, tensor: torch.Tensor, channel: int, traffic: Traffic) -> Future:
        """Sum ``tensor`` over all ranks on ``channel``; the future holds the summed tensor."""

    def describe(self) -> str:
        return type(self).__name__


class FlatAllReduce(AllReducePath):
    """One all-reduce over every rank. Channel 0 is the data-parallel group itself."""

    def __init__(self) -> None:
        self.groups: list = []

    def connect(self, group: Any, channels: int) -> None:
        ranks = dist.get_process_group_ranks(group)
        self.groups = [group] + [dist.new_group(ranks) for _ in range(channels - 1)]

    def all_reduce(self, tensor: torch.Tensor, channel: int, traffic: Traffic) -> Future:
        group = self.groups[channel]
        traffic.record("all_reduce", tensor, dist.get_world_size(group), channel)
        work = dist.all_reduce(tensor, group=group, async_op=True)
        return work.get_future().then(lambda _: tensor)

    def all_gather(self, tensor: torch.Tensor, channel: int, traffic: Traffic) -> Future:
        """Every rank's ``tensor`` (all of one size), in rank order."""
        group = self.groups[channel]
        n = dist.get_world_size(group)
        check_call("all_gather", group, [tensor])
        traffic.record("all_gather", tensor, n, channel)
        out = [torch.empty_like(tensor) for _ in range(n)]
        work = dist.all_gather(out, tensor, group=group, async_op=True)
        return work.get_future().then(lambda _: out)

    def describe(self) -> str:
        return "flat all-reduce"


@dataclass(frozen=True)
class Channels:
    """Spread buckets round-robin over ``count`` process-group sets, all in flight at once."""

    count: int

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError(f"Channels.count must be >= 1, got {self.count}")


class Downstream:
    """What a codec sees of the rest of the pipeline for one bucket."""

    def __init__(self, pipeline: "Pipeline", depth: int, bucket: Any, channel: int) -> None:
        self._pipeline, self._depth, self._bucket, self.channel = pipeline, depth, bucket, channel

    @property
    def world_size(self) -> int:
        return self._pipeline.world_size

    def all_reduce(self, tensor: torch.Tensor) -> Future:
        """Send ``tensor`` through the rest of the pipeline; the future holds the sum over ranks
        (same shape and dtype as ``tensor``)."""
        return self._pipeline._run_from(self._depth + 1, self._bucket, tensor, self.channel)

    def all_gather(self, tensor: torch.Tensor) -> Future:
        """Every rank's ``tensor`` (same size on every rank), in rank order, over the flat
        group of this channel."""
        p = self._pipeline
        return p.flat.all_gather(tensor, self.channel, p.traffic)


class GradientCodec(abc.ABC):
    """A stage that changes gradients around their communication (compression and back)."""

    @abc.abstractmethod
    def run(self, bucket: Any, tensor: torch.Tensor, link: Downstream) -> Future:
        """Communicate ``tensor`` (the bucket's gradients, divided by the world size).

        Returns a future holding the averaged tensor, same shape and dtype as ``tensor``.
        ``bucket`` is DDP's ``GradBucket`` (``parameters()``, ``gradients()``, ``index()``,
        ``is_last()``); ``tensor`` may be a different tensor from ``bucket.buffer()`` when an
        outer codec transformed it.
        """

    def describe(self) -> str:
        return type(self).__name__


class Pipeline:
    """The composed hook's state: codecs, topology and channels for one DDP model."""

    def __init__(self, codecs: Sequence[GradientCodec], topology: Optional[AllReducePath],
                 channels: int, group: Any) -> None:
        self.codecs = list(codecs)  # as given: the first is outermost
        self.flat = FlatAllReduce()
        self.flat.connect(group, channels)
        self.topology = topology or self.flat
        if topology is not None:
            topology.connect(group, channels)
        self.channels = channels
        self.world_size = dist.get_world_size(group)
        self.traffic = Traffic()

    def describe(self) -> str:
        stages = [c.describe() for c in self.codecs] + [self.topology.describe()]
        if self.channels > 1:
            stages.append(f"{self.channels} channels")
        return " -> ".join(stages)

    def hook(self, bucket: Any) -> Future:
        buffer = bucket.buffer()
        buffer.div_(self.world_size)
        fut = self._run_from(0, bucket, buffer, bucket.index() % self.channels)
        if bucket.is_last():
            self.traffic.rounds += 1

        def into_buffer(f: Future) -> torch.Tensor:
            result = f.value()
            if result is not buffer:
                buffer.copy_(result)
            return buffer
        return fut.then(into_buffer)

    def _run_from(self, depth: int, bucket: Any, tensor: torch.Tensor, channel: int) -> Future:
        if depth == len(self.codecs):
            # checked here, not in one topology: a hierarchical all-reduce is checked too
            check_call("all_reduce", self.flat.groups[channel], [tensor])
            return self.topology.all_reduce(tensor, channel, self.traffic)
        return self.codecs[depth].run(bucket, tensor, Downstream(self, depth, bucket, channel))


def _pipeline_hook(state, bucket):  # type: ignore[no-untyped-def]
    # Unannotated on purpose: DDP checks the annotations it finds against dist.GradBucket and
    # Future[Tensor], and this module's postponed annotations would be strings.
    return state.hook(bucket)


def _name(obj: Any) -> str:
    return getattr(obj, "__name__", type(obj).__name__)


def compose(entries: Sequence[tuple[Any, Any]], group: Any) -> Optional[tuple[Any, Callable]]:
    """The ``(state, hook)`` to register on DDP for ``ctx.comm_hooks``; None when empty.

    Args:
        entries: ``(None, stage)`` with a :class:`GradientCodec`, :class:`AllReducePath` or
            :class:`Channels` stage, or a single plain DDP ``(state, hook)`` pair. Empty gives
            None (DDP's own all-reduce), or the plain pipeline when the debug checks are on.
        group: the data-parallel process group. Process groups for channels and topologies are
            created here, so every rank must compose at the same point.

    Raises:
        CommHookError: a plain hook beside other entries, or two topologies / two channel
            settings (the message names them).

    Example (what ``data_parallel`` does when it wraps the model)::

        composed = compose([(None, Fp16Codec()), (None, Channels(2))], ddp.process_group)
        if composed is not None:
            ddp.register_comm_hook(*composed)
    """
    if not entries and not checking():
        return None
    codecs, topologies, channels, plain = [], [], [], []
    for state, stage in entries:
        if isinstance(stage, GradientCodec):
            codecs.append(stage)
        elif isinstance(stage, AllReducePath):
            topologies.append(stage)
        elif isinstance(stage, Channels):
            channels.append(stage)
        else:
            plain.append((state, stage))
    if plain and len(entries) > 1:
        names = ", ".join(_name(s) for _, s in entries)
        raise CommHookError(f"a plain DDP comm hook cannot be composed with other gradient "
                            f"communication stages ({names}); write it as a GradientCodec")
    if plain:
        return plain[0]
    for kind, found in (("topologies", topologies), ("channel settings", channels)):
        if len(found) > 1:
            raise CommHookError(f"only one of these gradient {kind} can be used: "
                                f"{', '.join(_name(s) for s in found)}")
    count = channels[0].count if channels else 1
    pipeline = Pipeline(codecs, topologies[0] if topologies else None, count, group)
    return pipeline, _pipeline_hook
