"""The trainer's side of a heter job: its link to a heter worker, and the autograd function
that runs a :class:`~fleetx.nn.HeterSection` there (``docs/heter.md``).

Trainer ``r`` of a job with ``N`` heter workers talks to heter worker ``r % N`` over one
authenticated link of the parameter server's transport (:mod:`fleetx.ps.handshake`,
:mod:`fleetx.ps.transport`: the job's secret, framed messages, heartbeats, frame limits, no
pickle), with the message kinds 31-36 of :class:`fleetx.ps.api.Kind`:

* ``HETER_HELLO``: rank, pid, host, the tables' fingerprint, the mode, the sections' names;
* ``HETER_FORWARD``: a section's inputs (``meta``: section, sequence number, the trainer's step,
  training or not, shapes, which inputs want a gradient); the reply carries the outputs;
* ``HETER_BACKWARD``: the outputs' gradients for a sequence number; the reply carries the
  inputs' gradients (the heter worker keeps the graph of every training forward until then);
* ``HETER_STEP``: the trainer's optimizer step is done (the heter worker then pushes the
  section's gradients: at once in async mode, once every trainer's step is in, in sync mode);
* ``HETER_BYE``: the trainer stops, or turns to inference (its sections then run locally);
* ``HETER_FLUSH``: answered once every step the trainer reported reached the servers (sent
  before a save or a barrier: an async heter worker queues its pushes).

In a training forward :class:`_Remote` (a ``torch.autograd.Function``) sends the inputs and
returns the outputs; its ``backward`` sends the outputs' gradients and returns the inputs'. An
evaluation forward (``no_grad`` or ``eval()``) keeps no graph on the heter worker.
"""
from __future__ import annotations

import logging
import math
import os
import socket
import threading
from typing import Any, Optional, Sequence

import numpy as np
import torch

from fleetx.nn.deferred import materialize
from fleetx.nn.heter import HeterSection
from fleetx.ps.api import (Kind, Message, PeerLostError, ProtocolError, PSConfig, PSConfigError,
                           PSTimeoutError, Tables)
from fleetx.ps.handshake import connect, resolve_secret
from fleetx.ps.tracker import Handle, Tracker
from fleetx.ps.transport import Heartbeats, Link

__all__ = ["HeterClient", "attach", "detach", "heter_endpoint", "pack", "unpack", "WIRE_DTYPES",
           "MAX_DIMS"]

log = logging.getLogger("fleetx.ps")

#: torch dtypes a section's inputs and outputs may have, and their wire dtypes
WIRE_DTYPES = {torch.float32: "<f4", torch.float64: "<f8", torch.int64: "<i8",
               torch.int32: "<i4", torch.uint8: "|u1"}
_TORCH = {np.dtype(v): k for k, v in WIRE_DTYPES.items()}
MAX_DIMS = 16


def heter_endpoint(config: PSConfig, rank: int) -> tuple[int, str]:
    """``(index, host:port)`` of the heter worker trainer ``rank`` talks to."""
    index = rank % config.num_heter_workers
    return index, config.heter_workers[index]


def check(tensors: Sequence[Any], what: str) -> None:
    """Refuse what cannot travel, before anything is sent.

    Raises:
        TypeError: a value that is not a tensor, or a dtype the wire does not carry.
    """
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what} {i} is a {type(t).__name__}; a HeterSection takes and "
                            "returns tensors only")
        if t.dtype not in WIRE_DTYPES:
            raise TypeError(f"{what} {i} has dtype {t.dtype}; a HeterSection's tensors must "
                            f"be one of {', '.join(str(d) for d in WIRE_DTYPES)}")


def pack(tensors: Sequence[torch.Tensor], what: str) -> tuple[list, list]:
    """``(shapes, arrays)`` of CPU copies of ``tensors`` for a frame.

    Raises:
        TypeError: as :func:`check`.
    """
    check(tensors, what)
    shapes, bufs = [], []
    for t in tensors:
        shapes.append(list(t.shape))
        bufs.append(np.ascontiguousarray(t.detach().cpu().numpy()).reshape(-1))
    return shapes, bufs


def unpack(shapes: Any, bufs: Sequence[np.ndarray], what: str) -> list[torch.Tensor]:
    """Tensors from a frame's ``shapes`` (checked against its buffers).

    Raises:
        ProtocolError: shapes that are not lists of at most ``MAX_DIMS`` sizes >= 0, a count
            or a size that does not match the buffers, or a dtype no section uses.
    """
    if not isinstance(shapes, list) or len(shapes) != len(bufs):
        raise ProtocolError(f"{what}: 'shapes' must list one shape per buffer "
                            f"({len(bufs)} buffers)")
    out = []
    for i, (shape, buf) in enumerate(zip(shapes, bufs)):
        if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(
                type(d) is int and d >= 0 for d in shape):
            raise ProtocolError(f"{what} {i}: shape {str(shape)[:60]} is not a list of at most "
                                f"{MAX_DIMS} sizes >= 0")
        # Python integers: a claimed shape whose product overflows 64 bits cannot wrap
        # around to the buffer's size
        if math.prod(shape) != buf.size or buf.dtype not in _TORCH:
            raise ProtocolError(f"{what} {i}: {buf.size} values of {buf.dtype} do not make "
                                f"shape {str(shape)[:120]}")
        out.append(torch.from_numpy(buf.reshape(shape)))
    return out


class _Remote(torch.autograd.Function):
    """A training forward on the heter worker; backward exchanges the gradients."""

    @staticmethod
    def forward(ctx, client: "HeterClient", name: str, *inputs: torch.Tensor) -> Any:
        wants = [bool(w) and inp.is_floating_point()
                 for w, inp in zip(ctx.needs_input_grad[2:], inputs)]
        seq, outputs = client.forward(name, inputs, train=True, wants=wants)
        ctx.client, ctx.seq, ctx.wants = client, seq, wants
        ctx.inputs = [(i.shape, i.dtype, i.device) for i in inputs]
        ctx.outputs = [(o.shape, o.dtype) for o in outputs]
        ctx.mark_non_differentiable(*[o for o in outputs if not o.is_floating_point()])
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads: Optional[torch.Tensor]) -> Any:
        full = [g if g is not None else torch.zeros(shape, dtype=dtype)
                for g, (shape, dtype) in zip(grads, ctx.outputs)]
        back = iter(ctx.client.backward(ctx.seq, full))
        out = [next(back).to(device) if want else None
               for want, (_, _, device) in zip(ctx.wants, ctx.inputs)]
        return (None, None, *out)


class HeterClient:
    """A trainer's link to its heter worker (the callable bound into its sections).

    Args:
        config: the cluster (``config.heter_workers`` lists the heter workers).
        rank: this trainer's rank.
        tables: every table of the job (the heter worker checks the fingerprint).
        names: the model's section names.

    Example:
        >>> client = HeterClient(config, rank, layout.tables, list(layout.heter))  # doctest: +SKIP
        >>> client.start(); section.bind(client)
    """

    def __init__(self, config: PSConfig, rank: int, tables: Tables, names: Sequence[str]) -> None:
        self.config, self.rank, self.tables, self.names = config, rank, tables, list(names)
        self.index, self.endpoint = heter_endpoint(config, rank)
        self.name = f"heter worker {self.index} ({self.endpoint})"
        self.steps = 0  # optimizer steps this trainer finished
        self._seq = 0
        self._tracker = Tracker()
        self._lost: Optional[PeerLostError] = None
        self._link: Optional[Link] = None
        self._heartbeats: Optional[Heartbeats] = None
        self._lock = threading.Lock()
        self.device = "?"

    def start(self) -> "HeterClient":
        """Connect (waiting up to ``config.timeout`` for the heter worker), authenticate and
        say HELLO.

        Raises:
            PSTimeoutError: the heter worker is not reachable (named).
            AuthError: it does not hold the job's secret, or rejects this one.
            RemoteError: it refused the HELLO (another table layout, mode or sections).
        """
        c = self.config
        host, _, port = self.endpoint.rpartition(":")
        sock = connect(host, int(port), self.name, c.timeout, resolve_secret(c) or b"")
        self._link = Link(sock, self.name, self._on_reply, self._on_lost, c.dead_after,
                          max_frame_bytes=c.max_frame_bytes).start()
        self._heartbeats = Heartbeats(c.heartbeat_interval)
        self._heartbeats.add(self._link)
        meta = {"rank": self.rank, "pid": os.getpid(), "host": socket.gethostname(),
                "fingerprint": self.tables.fingerprint(), "mode": c.mode.value,
                "sections": self.names}
        reply = self._call(Kind.HETER_HELLO, meta)
        self.device = reply[0].meta.get("device", "?")
        log.info("trainer %d: sections %s run on %s, %s", self.rank, ", ".join(self.names),
                 self.name, self.device)
        return self

    def __call__(self, section: HeterSection, inputs: tuple) -> Any:
        """Run ``section`` on the heter worker (what :meth:`HeterSection.bind` calls)."""
        inputs = tuple(materialize(i) if isinstance(i, torch.Tensor) else i for i in inputs)
        check(inputs, "input")
        if section.training and torch.is_grad_enabled():
            out = _Remote.apply(self, section.section_name, *inputs)
        else:
            _, out = self.forward(section.section_name, inputs, train=False,
                                  wants=[False] * len(inputs))
            out = tuple(out)
        return out[0] if len(out) == 1 else out

    def forward(self, name: str, inputs: Sequence[torch.Tensor], train: bool,
                wants: list) -> tuple[int, list]:
        """``(sequence number, outputs)`` of ``name`` on ``inputs``."""
        shapes, bufs = pack(inputs, "input")
        with self._lock:
            self._seq += 1
            seq = self._seq
        meta = {"section": name, "seq": seq, "step": self.steps, "train": train,
                "shapes": shapes, "grad": wants}
        reply, = self._call(Kind.HETER_FORWARD, meta, bufs)
        device = inputs[0].device if inputs else torch.device("cpu")
        return seq, [t.to(device) for t in unpack(reply.meta.get("shapes"), reply.bufs,
                                                  f"{self.name}: output")]

    def backward(self, seq: int, grads: Sequence[torch.Tensor]) -> list:
        """The inputs' gradients (those that wanted one) for the outputs' ``grads``."""
        shapes, bufs = pack(grads, "gradient")
        reply, = self._call(Kind.HETER_BACKWARD, {"seq": seq, "shapes": shapes}, bufs)
        return unpack(reply.meta.get("shapes"), reply.bufs, f"{self.name}: input gradient")

    def step(self) -> None:
        """This trainer's optimizer step is done: the heter worker pushes the sections'
        gradients (in sync mode it answers once every trainer's step is in)."""
        self._call(Kind.HETER_STEP, {"step": self.steps}, lockstep=True)
        self.steps += 1

    def flush(self) -> None:
        """Wait until every step this trainer reported reached the servers (the heter
        worker's async pushes are queued, as a trainer's are); before a save or a barrier."""
        self._call(Kind.HETER_FLUSH, {})

    def stop(self) -> None:
        """Say BYE (the heter worker answers once what this trainer sent reached the servers)
        and disconnect."""
        try:
            if self._link is not None and self._lost is None:
                self._call(Kind.HETER_BYE, {})
        finally:
            if self._link is not None:
                self._link.close()
            if self._heartbeats is not None:
                self._heartbeats.stop()

    # -- plumbing -------------------------------------------------------------------------
    def _call(self, kind: Kind, meta: dict, bufs: Sequence[np.ndarray] = (),
              lockstep: bool = False) -> list:
        """Send a request and wait for its reply, at most ``FLEETX_TIMEOUT`` seconds (twice as
        long for a step, which in sync mode waits for the other trainers: the heter worker
        names one that holds up the lock-step after ``FLEETX_TIMEOUT``).

        Raises:
            PSTimeoutError: no reply in time (naming the heter worker and the request).
            PeerLostError: the heter worker was lost.
            RemoteError: it refused the request.
        """
        timeout = self.config.timeout * (2 if lockstep else 1)
        try:
            return self._request(kind, meta, bufs).wait(timeout)
        except PSTimeoutError:
            raise PSTimeoutError(f"{self.name} did not answer {kind.name} of trainer "
                                 f"{self.rank} within {timeout:g} s (FLEETX_TIMEOUT); it is "
                                 "alive but its sections did not return in time") from None

    def _request(self, kind: Kind, meta: dict, bufs: Sequence[np.ndarray] = ()) -> Handle:
        if self._lost is not None:
            raise self._lost
        handle = Handle(1)
        req = self._tracker.register(handle, 0, 0)
        try:
            self._link.send(Message(kind, req, meta, bufs))
        except PeerLostError as e:
            self._tracker.forget(req, e)
        return handle

    def _on_reply(self, link: Link, msg: Message) -> None:
        if not msg.is_reply:  # the heter worker only answers
            return self._on_lost(link, f"protocol error: unexpected {msg.kind.name} request")
        self._tracker.resolve(msg, link.name)

    def _on_lost(self, link: Link, reason: str) -> None:
        err = PeerLostError(link.name, reason)
        self._lost = self._lost or err
        self._tracker.fail_all(err)


def attach(sections: dict, config: PSConfig, rank: int, tables: Tables) -> HeterClient:
    """Connect trainer ``rank`` to its heter worker and run ``sections`` there."""
    client = HeterClient(config, rank, tables, list(sections)).start()
    for section in sections.values():
        section.bind(client)
    return client


def detach(sections: dict) -> None:
    """Run ``sections`` on this process again (inference, or after the heter worker left)."""
    for section in sections.values():
        section.bind(None)


def check_sections(names: Sequence[str], known: Sequence[str]) -> None:
    """Both sides must have the same sections.

    Raises:
        PSConfigError: they differ (naming both lists).
    """
    if sorted(names) != sorted(known):
        raise PSConfigError(f"the trainer's heter sections {sorted(names)} differ from the heter "
                            f"worker's {sorted(known)}; build the same model everywhere")
