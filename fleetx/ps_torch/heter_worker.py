"""The heter worker: it runs the model's :class:`~fleetx.nn.HeterSection` blocks for its
trainers and pushes their gradients to the servers (``docs/heter.md``).

Heter worker ``j`` of ``N`` serves the trainers ``r`` with ``r % N == j``. It connects to the
servers as rank ``num_workers + j`` (its pushes are applied on arrival in every mode, outside
the sync rounds) with the communicator of the job's mode over its own dense tables
(``heter.<group>``), loads their weights, and listens on its endpoint for its trainers, through
the parameter server's front door (:class:`fleetx.ps.acceptor.Acceptor`: the job's secret,
handshakes without a thread each, connection caps) and links (frame limits, heartbeats).

One thread owns the sections and handles every request in arrival order (``_serve``):

* ``HETER_FORWARD``: run the section on the inputs (on the chosen device); a training forward
  keeps its graph (at most :data:`MAX_PENDING` per trainer) until its ``HETER_BACKWARD``;
* ``HETER_BACKWARD``: back-propagate the outputs' gradients, answer the inputs' gradients; the
  parameters' gradients accumulate. A forward runs on the weights of the moment
  (:class:`~fleetx.ps_torch.heter_sections.Section`: fresh tensors after every push, never
  changed in place), so in async
  mode a graph still waiting for its backward when another trainer's step loads new weights
  back-propagates through the weights its forward used, as any async worker's gradient does;
* ``HETER_STEP``: async mode pushes the accumulated gradients at once and answers; sync mode
  (lock-step) answers every trainer once all of them reported the step, after pushing the sum
  of their gradients divided by their number, exactly as the servers average the trainers'
  pushes in a sync round: the job then trains as the same job without heter workers;
* ``HETER_BYE``: the trainer leaves (answered once its gradients reached the servers);
* ``HETER_FLUSH``: answered once the pushes queued so far reached the servers (a trainer
  sends it before a save or a barrier).

Liveness is the parameter server's: a trainer that dies, closes its link or falls silent for
``dead_after`` is lost, and so is one that does not connect within ``timeout``, or that sends
nothing for ``timeout`` while the others wait for its step; every waiting trainer then gets an
error naming it and :meth:`HeterWorker.run` raises it.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Optional

import numpy as np
import torch

from fleetx.ps.acceptor import HANDSHAKE_TIMEOUT, Acceptor
from fleetx.ps.api import (CommunicatorConfig, Kind, Message, PeerLostError, ProtocolError,
                           PSConfig, PSConfigError, PSError, PSMode, RequestError, endpoint_of)
from fleetx.ps.handshake import require_secret
from fleetx.ps.links import LinkSet
from fleetx.ps.transport import Link
from fleetx.ps_torch.heter import check_sections, pack, unpack
from fleetx.ps_torch.heter_sections import Section
from fleetx.ps_torch.layout import ModelLayout
from fleetx.ps_torch.worker import make_communicator

__all__ = ["HeterWorker", "MAX_PENDING"]

log = logging.getLogger("fleetx.ps")

#: training forwards of one trainer that may wait for their backward at once
MAX_PENDING = 64
_MAX_INFLIGHT = 16
_STALL_CHECK_S = 0.25


class _LinkEnded:
    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


class _Trainer:
    """A registered trainer: its link, the graphs waiting for backward, its step count."""

    def __init__(self, rank: int, name: str, link: Optional[Link]) -> None:
        self.rank, self.name, self.link, self.state = rank, name, link, "active"
        self.pending: dict[int, tuple] = {}  # seq -> (inputs, outputs, wants)
        self.steps = 0
        self.last_request = time.monotonic()


class HeterWorker:
    """One heter worker process's service.

    Args:
        config: the cluster (``config.heter_workers[index]`` is where it listens).
        index: this heter worker's index.
        layout: the model's layout (its ``heter`` sections and ``heter.*`` tables are used).
        comm: the communicator's knobs (``a_sync_configs``).
        device: where the sections run
            (:func:`~fleetx.ps_torch.heter_sections.heter_device`).

    Raises:
        PSConfigError: the model has no HeterSection, or GEO mode.

    Example:
        >>> HeterWorker(config, 0, layout, device=torch.device("cpu")).run()  # doctest: +SKIP
    """

    def __init__(self, config: PSConfig, index: int, layout: ModelLayout,
                 comm: Optional[CommunicatorConfig] = None,
                 device: torch.device = torch.device("cpu")) -> None:
        if not layout.heter:
            raise PSConfigError("a heter worker runs the model's HeterSections, and this model "
                                "has none: wrap its dense part in fleetx.nn.HeterSection")
        if config.mode == PSMode.GEO:
            raise PSConfigError("heter workers train in sync or async mode, not GEO")
        self.config, self.index, self.device = config, index, device
        self.name = f"heter worker {index} ({config.heter_workers[index]})"
        self.sections = {n: Section(s.module.to(device)) for n, s in layout.heter.items()}
        self.layout = layout.restricted(layout.heter_tables())
        self.lockstep = config.mode == PSMode.SYNC
        self.expected = [r for r in range(config.num_workers)
                         if r % config.num_heter_workers == index]
        self._comm_config = comm
        self._queue: queue.Queue = queue.Queue()
        self._trainers: dict[int, _Trainer] = {}
        self._waiting: list[tuple[_Trainer, Message]] = []  # STEP / BYE replies of this step
        self._reported: set[int] = set()
        self._step = 0  # lock-step: steps completed
        self._pushes = 0
        self._step_since: Optional[float] = None
        self._error: Optional[PSError] = None  # a lost trainer or server: the run fails
        self._done = threading.Event()
        self._handlers = {Kind.HETER_HELLO: self._on_hello, Kind.HETER_FORWARD: self._on_forward,
                          Kind.HETER_BACKWARD: self._on_backward, Kind.HETER_STEP: self._on_step,
                          Kind.HETER_BYE: self._on_bye, Kind.HETER_FLUSH: self._on_flush}

    # ------------------------------------------------------------------ life cycle
    def run(self) -> None:
        """Join the servers, serve the trainers until every one of them stopped, leave.

        Raises:
            PeerLostError: a trainer or a server was lost; the message names it.
            PSError: the servers refused the sections' gradients (e.g. NaN), named.
        """
        self.comm = make_communicator(self.config, self.config.num_workers + self.index,
                                      self.layout.tables, self._comm_config)
        # the trainers' worker 0 assigns the same values; whichever comes first counts
        self.layout.load_dense(self.comm.start(self.layout.dense_values(), assign=True,
                                               meet=False))
        for section in self.sections.values():
            section.refresh()
        host, port = endpoint_of(self.config.heter_workers, self.index)
        key = require_secret(self.config, host, self.name)
        self._links = LinkSet(2 * len(self.expected) + 16, self.config.heartbeat_interval,
                              self._done, {"on_message": self._on_message,
                                           "on_lost": self._on_link_lost,
                                           "dead_after": self.config.dead_after,
                                           "max_frame_bytes": self.config.max_frame_bytes,
                                           "queued": True, "max_inflight": _MAX_INFLIGHT})
        self._acceptor = Acceptor(host, port, key, self.name, self._links.has_room,
                                  self._links.adopt, handshake_timeout=min(
                                      HANDSHAKE_TIMEOUT, self.config.dead_after)).start()
        self._started = time.monotonic()
        log.info("%s: serving sections %s on %s for trainers %s, %s mode", self.name,
                 ", ".join(self.sections), self.device, self.expected,
                 "lock-step (sync)" if self.lockstep else "async")
        try:
            self._serve()
        finally:
            self._close()
        if self._error is not None:
            self.comm.client.stop()
            raise self._error
        self.comm.stop()
        log.info("%s: every trainer stopped (%d pushes); done", self.name, self._pushes)

    def _close(self) -> None:
        self._acceptor.close()
        self._links.close()

    def _on_message(self, link: Link, msg: Message) -> None:
        self._queue.put((link, msg))

    def _on_link_lost(self, link: Link, reason: str) -> None:
        self._queue.put((link, _LinkEnded(reason)))

    # ------------------------------------------------------------------ the handler thread
    def _serve(self) -> None:
        next_check = 0.0
        while not self._done.is_set():
            try:
                link, item = self._queue.get(timeout=0.25)
            except queue.Empty:
                link = item = None
            if isinstance(item, _LinkEnded):
                self._link_lost(link, item.reason)
            elif item is not None:
                self._dispatch(link, item)
                link.handled()
            now = time.monotonic()
            if now >= next_check:
                self._check_liveness(now)
                next_check = now + _STALL_CHECK_S
            if all(r in self._trainers and self._trainers[r].state != "active"
                   for r in self.expected) or self._error is not None:
                self._done.set()

    def _dispatch(self, link: Link, msg: Message) -> None:
        trainer = self._trainers.get(link.peer_info.get("rank"))
        try:
            handler = self._handlers.get(msg.kind)
            if handler is None or msg.is_reply:
                raise ProtocolError(f"unexpected {msg.kind.name} frame (a heter worker serves "
                                    "HETER_* requests)")
            if not isinstance(msg.meta, dict):
                raise RequestError(f"{msg.kind.name}: the meta block must be a JSON object")
            if msg.kind != Kind.HETER_HELLO and trainer is None:
                raise ProtocolError(f"{msg.kind.name} before HETER_HELLO")
            if trainer is not None:
                trainer.last_request = time.monotonic()
            reply = handler(link, trainer, msg)
        except _Fatal as e:  # the servers are gone: nothing can be trained any more
            self._fail(e.error)
            reply = msg.error_reply(e.error)
        except Exception as e:  # a bad request or a failing section: the sender hears of it
            log.warning("%s: refused %s from %s: %s: %s", self.name, msg.kind.name, link.name,
                        type(e).__name__, e)
            reply = msg.error_reply(e)
        if reply is not None:
            self._send(link, reply)

    def _send(self, link: Link, msg: Message) -> None:
        try:
            link.send(msg)
        except PeerLostError:
            pass  # the link reported itself lost
        except ProtocolError as e:  # a reply too large for the frame limit: say so
            try:
                link.send(Message(msg.kind, msg.req_id).error_reply(e))
            except PSError:
                pass

    # ------------------------------------------------------------------ requests
    def _on_hello(self, link: Link, trainer, msg: Message) -> Message:
        m = msg.meta
        rank = m.get("rank")
        if type(rank) is not int or rank not in self.expected:
            raise PSConfigError(f"HETER_HELLO: trainer rank {str(rank)[:20]} is not one of this "
                                f"heter worker's trainers {self.expected}")
        if m.get("fingerprint") != self.layout.tables.fingerprint() or \
                m.get("mode") != self.config.mode.value:
            raise PSConfigError(f"trainer {rank} has another table layout or mode than "
                                f"{self.name}; build the same model and strategy everywhere")
        check_sections(m.get("sections") if isinstance(m.get("sections"), list) else [],
                       list(self.sections))
        if rank in self._trainers:
            raise PSConfigError(f"trainer rank {rank} already {self._trainers[rank].state} "
                                f"({self._trainers[rank].name})")
        link.name = f"trainer {rank} (pid {m.get('pid')} on {m.get('host')})"
        link.peer_info["rank"] = rank
        self._trainers[rank] = _Trainer(rank, link.name, link)
        return msg.reply({"heter": self.index, "device": str(self.device),
                          "lockstep": self.lockstep})

    def _on_forward(self, link: Link, t: _Trainer, msg: Message) -> Message:
        m = msg.meta
        section = self.sections.get(m.get("section"))
        if section is None:
            raise RequestError(f"HETER_FORWARD: unknown section {str(m.get('section'))[:60]}; "
                               f"known: {', '.join(self.sections)}")
        train, step, seq, wants = m.get("train"), m.get("step"), m.get("seq"), m.get("grad")
        if type(train) is not bool or type(step) is not int or type(seq) is not int:
            raise RequestError("HETER_FORWARD: 'train' must be a boolean, 'step' and 'seq' "
                               "integers")
        if self.lockstep and step != self._step:
            raise RequestError(f"HETER_FORWARD: {t.name} is at step {step}, the sections at "
                               f"step {self._step} (lock-step)")
        inputs = unpack(m.get("shapes"), msg.bufs, "HETER_FORWARD input")
        if not isinstance(wants, list) or len(wants) != len(inputs) or not all(
                type(w) is bool and (not w or x.is_floating_point()) for w, x in zip(wants, inputs)):
            raise RequestError("HETER_FORWARD: 'grad' must hold one boolean per input, true "
                               "only for floating-point inputs")
        inputs = [x.to(self.device).requires_grad_(w) for x, w in zip(inputs, wants)]
        if train and (seq in t.pending or len(t.pending) >= MAX_PENDING):
            raise RequestError(f"HETER_FORWARD: {t.name} has {len(t.pending)} forwards waiting "
                               f"for their backward (at most {MAX_PENDING}), or reuses sequence "
                               f"number {seq}")
        section.module.train(train)
        with torch.set_grad_enabled(train):
            outputs = section(inputs)
        if train:
            t.pending[seq] = (inputs, outputs, wants, section, section.weights)
        shapes, bufs = pack(outputs, "output")
        return msg.reply({"shapes": shapes}, bufs)

    def _on_backward(self, link: Link, t: _Trainer, msg: Message) -> Message:
        seq = msg.meta.get("seq")
        if type(seq) is not int or seq not in t.pending:
            raise RequestError(f"HETER_BACKWARD: no training forward {str(seq)[:20]} of {t.name} "
                               "waits for its backward")
        inputs, outputs, wants, section, weights = t.pending.pop(seq)
        grads = unpack(msg.meta.get("shapes"), msg.bufs, "HETER_BACKWARD gradient")
        if len(grads) != len(outputs) or any(g.shape != o.shape or g.dtype != o.dtype
                                             for g, o in zip(grads, outputs)):
            raise RequestError("HETER_BACKWARD: the gradients do not match the outputs "
                               f"({[tuple(o.shape) for o in outputs]})")
        pairs = [(o, g.to(self.device)) for o, g in zip(outputs, grads) if o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            section.collect(weights)
        back = [x.grad if x.grad is not None else torch.zeros_like(x)
                for x, w in zip(inputs, wants) if w]
        shapes, bufs = pack(back, "input gradient")
        return msg.reply({"shapes": shapes}, bufs)

    def _on_step(self, link: Link, t: _Trainer, msg: Message) -> Optional[Message]:
        if msg.meta.get("step") != t.steps:
            raise RequestError(f"HETER_STEP: {t.name} reports step {str(msg.meta.get('step'))[:20]}"
                               f", expected {t.steps}")
        t.steps += 1
        t.pending.clear()  # a forward without backward in a finished step has no use
        if not self.lockstep:
            self._push(1)
            return msg.reply()
        self._reported.add(t.rank)
        self._waiting.append((t, msg))
        self._step_since = self._step_since or time.monotonic()
        self._try_step()
        return None

    def _on_bye(self, link: Link, t: _Trainer, msg: Message) -> Optional[Message]:
        t.state = "finished"
        if not self.lockstep:
            _servers(self.comm.flush)
            return msg.reply()
        if t.rank in self._reported:  # answered with its step, once that is pushed
            self._waiting.append((t, msg))
            self._try_step()
            return None
        self._try_step()
        return msg.reply()

    def _on_flush(self, link: Link, t: _Trainer, msg: Message) -> Message:
        _servers(self.comm.flush)  # async: the queued pushes; lock-step pushes are done
        return msg.reply()

    # ------------------------------------------------------------------ steps and pushes
    def _members(self) -> list[int]:
        return [r for r in self.expected
                if r not in self._trainers or self._trainers[r].state == "active"]

    def _try_step(self) -> None:
        """Lock-step: once every member reported the step, push and answer them all."""
        if not self._reported or not set(self._members()) <= self._reported:
            return
        self._push(len(self._reported))
        self._step += 1
        self._reported.clear()
        self._step_since = None
        waiting, self._waiting = self._waiting, []
        for t, msg in waiting:
            self._send(t.link, msg.reply())

    def _push(self, trainers: int) -> None:
        """Send the sections' accumulated gradients (divided by ``trainers``: the mean of a
        lock-step) and load the weights the servers answer."""
        for section in self.sections.values():
            section.hand_over()
        params, grads = self.layout.dense_values(), self.layout.dense_grads()
        if trainers > 1:
            grads = {n: g * np.float32(1.0 / trainers) for n, g in grads.items()}
        _servers(lambda: self.comm.step(params, grads, {}))
        self._pushes += 1
        self.layout.load_dense(params)
        for section in self.sections.values():
            section.module.zero_grad(set_to_none=True)
            section.refresh()

    # ------------------------------------------------------------------ liveness
    def _link_lost(self, link: Link, reason: str) -> None:
        t = self._trainers.get(link.peer_info.get("rank"))
        if t is not None and t.link is link and t.state == "active":
            self._mark_lost(t, reason)

    def _mark_lost(self, t: _Trainer, reason: str) -> None:
        t.state = "lost"
        self._fail(PeerLostError(t.name, reason))

    def _fail(self, error: PSError) -> None:
        """The run fails with ``error``: every trainer waiting for a step hears of it."""
        self._error = self._error or error
        log.error("%s: %s", self.name, self._error)
        waiting, self._waiting = self._waiting, []
        for other, msg in waiting:
            self._send(other.link, msg.error_reply(self._error))

    def _check_liveness(self, now: float) -> None:
        timeout = self.config.timeout
        if now - self._started > timeout:
            for r in self.expected:
                if r not in self._trainers:
                    self._trainers[r] = _Trainer(r, f"trainer {r}", None)
                    self._mark_lost(self._trainers[r], f"did not connect within {timeout:.0f} s")
        if self._step_since is None or now - self._step_since <= timeout:
            return
        for r in self._members():
            t = self._trainers.get(r)
            if t is not None and r not in self._reported and now - t.last_request > timeout:
                if t.link is not None:
                    t.link.close()
                waiters = ", ".join(f"trainer {w}" for w in sorted(self._reported))
                self._mark_lost(t, f"sent no request for {now - t.last_request:.0f} s while "
                                f"{waiters} waited in lock-step {self._step} (timeout "
                                f"{timeout:g} s, FLEETX_TIMEOUT)")


class _Fatal(Exception):
    """A push or flush to the servers failed: the heter worker cannot go on."""

    def __init__(self, error: PSError) -> None:
        super().__init__(str(error))
        self.error = error


def _servers(call):
    """``call()``, its failure (a lost server, a refused push) made fatal."""
    try:
        return call()
    except PSError as e:
        raise _Fatal(e) from e
