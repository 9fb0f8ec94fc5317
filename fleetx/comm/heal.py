"""In-job healing of data-parallel training (``fleetrun --fault_tolerance heal``).

The launcher hosts the job's store and watches the processes; it restarts a dead rank alone and
writes what it knows there: which process died (``dead/<slot>``, a count per launch rank) and
every heartbeat it saw. The ranks decide the rest among themselves, through the store:

* **Generations.** The live processes form generation ``g``: a list of launch ranks ("slots")
  with their incarnations (0 for the first process of a slot, 1 after its first restart...),
  written once to ``gen/<g>`` with ``compare_set`` (the first proposal wins, every rank adopts
  the same list). Each generation has its own default process group, built over a
  ``PrefixStore`` of its own; its ranks are the members' positions in the list, ordered by
  launch rank, so ``fleet.worker_index()`` / ``worker_num()`` are the position and the count of
  live processes.
* **Collectives that heal.** The gradient all-reduce (at the optimizer step, on one flat
  buffer) and Local SGD's parameter average go through :meth:`Healer.all_reduce`. It runs the
  all-reduce asynchronously and, while it waits, looks for the death of a member. When a member
  died (or gloo raised), the survivors form the next generation without it and run the same
  all-reduce again on their own values, averaged over the survivors: the step is not lost.
  A survivor that had already finished that all-reduce (the dead rank's part had arrived) hands
  its result to those that had not, so every survivor applies the same update.
* **Joining.** A restarted process registers in the store (``joined/<slot>``) from
  ``fleet.distributed_optimizer`` and waits. The members' next healing all-reduce carries one
  number more, the count of registrations the first member read; after that step's update (a
  step boundary) they form a generation with the joiner, and the first member broadcasts the
  model, the optimizer with every strategy's state, and the step count. The joiner's
  ``fleet.start_step()`` then returns that step.

Example (what the fleet does; scripts never call this module)::

    healer = heal.start(slot=1, world_size=3, incarnation=0)
    mean = healer.average([p.grad for p in params])
"""
from __future__ import annotations

import io
import json
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from fleetx import env
from fleetx.comm.api import CommError

__all__ = ["Healer", "start", "current", "active", "enabled", "average_parameters"]

_POLL_S = 0.05      # how often a waiting collective looks for a member's death
_BEAT_S = 0.5       # heartbeat interval (the launcher declares a rank frozen after the timeout)
_CURRENT: Optional["Healer"] = None


def enabled() -> bool:
    """True when fleetrun runs this process under ``--fault_tolerance heal``."""
    return env.get("FLEETX_FAULT_TOLERANCE") == "heal"


def current() -> Optional["Healer"]:
    """The healer of this process, or None outside a healing job."""
    return _CURRENT


def active() -> Optional["Healer"]:
    """The healer while it heals (not after a fall-back to restart), else None."""
    return _CURRENT if _CURRENT is not None and _CURRENT.mode == "heal" else None


class _Broken(Exception):
    """The collective of the current generation cannot complete."""


class Healer:
    """This process's membership in a healing job; build it with :func:`start`.

    Attributes:
        slot: this process's launch rank (``RANK``), which never changes.
        incarnation: how many times this slot was restarted before this process.
        gen: the current generation; members: its ``(slot, incarnation)`` pairs.
        rank, size: this process's rank and the world size in the current generation.
        mode: ``heal``, or ``restart`` after :meth:`fall_back`.
        done: the healing collectives this process completed.
        log: where the healer says what happens (the rank's log).
    """

    def __init__(self, store: Any, slot: int, world_size: int, incarnation: int,
                 timeout: float, log: Callable[[str], None] = print) -> None:
        self.store, self.slot, self.incarnation = store, slot, incarnation
        self.timeout, self.log = timeout, log
        self.launch_world = world_size
        self.mode = "heal"
        self.gen, self.members = -1, []
        self.rank, self.size = -1, 0
        self.done = 0
        self._last: Optional[tuple[torch.Tensor, int]] = None  # last result, its world size
        self._deaths_seen = 0
        self._joins_seen = 0
        self._grow = False
        self._graveyard: list = []  # groups of earlier generations (their ops may still wait)
        self.on_generation: list[Callable[["Healer"], None]] = []
        self.state_source: Optional[Callable[[], dict]] = None
        self.state_sink: Optional[Callable[[dict], None]] = None
        self._beat = threading.Thread(target=self._heartbeat, daemon=True,
                                      name="fleetx-heal-beat")

    # -- store facts --------------------------------------------------------------------------
    def _count(self, key: str) -> int:
        return int(self.store.add(key, 0))

    def _dead(self, pairs: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
        """The ``(slot, incarnation)`` pairs among ``pairs`` whose process died."""
        return [(s, i) for s, i in pairs if self._count(f"dead/{s}") > i]

    def _heartbeat(self) -> None:
        while True:
            try:
                self.store.add(f"beat/{self.slot}", 1)
            except Exception:  # the launcher (and its store) is gone: the process ends soon
                return
            time.sleep(_BEAT_S)

    # -- generations --------------------------------------------------------------------------
    def _propose(self, members: list, new: list, why: str) -> dict:
        """Write generation ``gen + 1`` unless another rank did first; return the one written."""
        record = json.dumps({"members": sorted(members), "new": sorted(new), "why": why})
        key = f"gen/{self.gen + 1}"
        written = self.store.compare_set(key, "", record)
        return json.loads(written.decode() if isinstance(written, bytes) else written)

    def _adopt(self, g: int, record: dict) -> None:
        """Leave the current generation's group and build generation ``g``'s."""
        members = [tuple(m) for m in record["members"]]
        if (self.slot, self.incarnation) not in members:
            raise CommError(f"rank {self.slot} was left out of generation {g} of the healing "
                            f"job (members {[s for s, _ in members]}): it was thought dead")
        if dist.is_initialized():
            self._graveyard.append(dist.group.WORLD)
            dist.destroy_process_group()
        self.gen, self.members = g, members
        self.rank, self.size = members.index((self.slot, self.incarnation)), len(members)
        self.store.set("latest", str(g))
        dist.init_process_group("gloo", store=dist.PrefixStore(f"pg/{g}", self.store),
                                rank=self.rank, world_size=self.size,
                                timeout=timedelta(seconds=env.timeout()))
        self._deaths_seen = self._count("deaths")
        for hook in self.on_generation:
            hook(self)

    def _first_generation(self) -> None:
        self._adopt(0, {"members": [[s, 0] for s in range(self.launch_world)], "new": []})
        self._beat.start()

    def _shrink(self, reason: str) -> Optional[torch.Tensor]:
        """Form the next generation without the dead members; returns what an ahead member
        handed over when this process had not finished the collective, else None."""
        deadline = time.monotonic() + self.timeout
        dead = self._dead(self.members)
        while not dead and time.monotonic() < deadline and self._newer() is None:
            time.sleep(_POLL_S)
            dead = self._dead(self.members)
        newer = self._newer()
        if newer is not None:
            g, record = newer
        else:
            live = [m for m in self.members if m not in dead]
            why = (f"rank(s) {sorted(s for s, _ in dead)} died" if dead else
                   f"no member died within {self.timeout:g} s: the same ranks again")
            g, record = self.gen + 1, self._propose(live, [], why)
        gone = sorted(s for s, _ in set(self.members) - {tuple(m) for m in record["members"]})
        started = time.monotonic()
        self._adopt(g, record)
        self.log(f"fleetx heal: generation {g}: {self.size} rank(s) "
                 f"{[s for s, _ in self.members]}"
                 + (f" without rank(s) {gone}" if gone else "")
                 + f" ({record['why']}); group rebuilt in {time.monotonic() - started:.2f} s; "
                 f"this process is rank {self.rank} of {self.size}")
        return None

    def _newer(self) -> Optional[tuple[int, dict]]:
        """The generation after the current one, when another rank already wrote it."""
        key = f"gen/{self.gen + 1}"
        if not self.store.check([key]):
            return None
        return self.gen + 1, json.loads(self.store.get(key).decode())

    def _reconcile(self, pending: Optional[int]) -> Optional[torch.Tensor]:
        """After a shrink: members that finished one collective more than others hand its
        result over (``pending``: the size of this process's unfinished buffer, or None)."""
        counts = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        dist.all_gather(counts, torch.tensor([self.done], dtype=torch.int64))
        done = [int(c.item()) for c in counts]
        ahead = max(done)
        if ahead - min(done) > 1:
            raise CommError(f"healing job: the survivors' completed collectives differ by more "
                            f"than one ({done}); they cannot agree on the step")
        if ahead == min(done):
            return None
        src = done.index(ahead)
        if self.done == ahead:
            buf, world = self._last
        else:
            buf, world = torch.zeros(pending), 0
        size = torch.tensor([world], dtype=torch.int64)
        dist.broadcast(buf, src=src)
        dist.broadcast(size, src=src)
        if self.done == ahead:
            return None
        self.log(f"fleetx heal: the collective in flight had completed on rank {src}: its "
                 f"result (over {int(size.item())} ranks) is used here too")
        self._last = (buf, int(size.item()))
        return buf

    # -- collectives --------------------------------------------------------------------------
    def _sum(self, buf: torch.Tensor) -> None:
        if self._newer() is not None:
            raise _Broken("a newer generation exists")
        work = dist.all_reduce(buf, async_op=True)
        finished = threading.Event()
        work.get_future().add_done_callback(lambda _: finished.set())
        while not finished.wait(_POLL_S):
            if self._count("deaths") != self._deaths_seen:
                if self._dead(self.members):
                    raise _Broken("a member died")
                self._deaths_seen = self._count("deaths")
            if self._newer() is not None:
                raise _Broken("another rank formed a newer generation")
        try:
            work.wait()
        except RuntimeError as exc:
            raise _Broken(str(exc).splitlines()[0].split("] ")[-1][:120]) from None

    def all_reduce(self, build: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, int]:
        """Sum the float buffer ``build()`` returns over the live ranks; returns (sum, ranks).

        ``build`` is called again for each try, so a retry after a heal sums this process's
        own values anew. The buffer's last element is the join signal (set here).
        """
        while True:
            buf = build()
            buf = torch.cat([buf.reshape(-1), torch.zeros(1, dtype=buf.dtype)])
            if self.rank == 0:
                buf[-1] = float(self._count("joins"))
            try:
                self._sum(buf)
            except _Broken as exc:
                self.log(f"fleetx heal: all-reduce #{self.done + 1} of generation {self.gen} "
                         f"failed ({exc}); rebuilding the group with the live ranks")
                self._shrink(str(exc))
                rescued = self._reconcile(buf.numel())
                if rescued is None:
                    continue
                buf, world = rescued, self._last[1]
            else:
                world = self.size
            self.done += 1
            self._last = (buf, world)
            joins = int(round(float(buf[-1])))
            if joins > self._joins_seen:
                self._grow, self._joins_seen = True, joins
            return buf[:-1], world

    def average(self, tensors: Sequence[torch.Tensor]) -> None:
        """Replace every tensor by its mean over the live ranks (one flat all-reduce)."""
        tensors = list(tensors)
        if not tensors:
            return
        total, world = self.all_reduce(
            lambda: torch.cat([t.detach().reshape(-1).to(torch.float64) for t in tensors]))
        offset = 0
        with torch.no_grad():
            for t in tensors:
                n = t.numel()
                t.copy_((total[offset:offset + n] / world).view_as(t).to(t.dtype))
                offset += n

    # -- joining --------------------------------------------------------------------------------
    def at_boundary(self) -> None:
        """At a step boundary: admit the processes that asked to join (every member calls this
        at the same boundary, decided by the last all-reduce's join signal)."""
        if not self._grow:
            return
        self._grow = False
        joiners = []
        for slot in range(self.launch_world):
            key = f"joined/{slot}"
            if any(s == slot for s, _ in self.members) or not self.store.check([key]):
                continue
            inc = int(self.store.get(key).decode())
            if not self._dead([(slot, inc)]):
                joiners.append([slot, inc])
        record = self._propose([list(m) for m in self.members] + joiners, joiners,
                               f"rank(s) {[s for s, _ in joiners]} rejoin")
        self._adopt(self.gen + 1, record)
        self._send_state(record)

    def _send_state(self, record: dict) -> None:
        new = {tuple(m) for m in record["new"]}
        if not new:
            return
        started = time.monotonic()
        src = next(i for i, m in enumerate(self.members) if m not in new)
        data = torch.zeros(0, dtype=torch.uint8)
        if self.rank == src:
            out = io.BytesIO()
            torch.save(dict(self.state_source(), done=self.done, joins=self._joins_seen), out)
            data = torch.frombuffer(bytearray(out.getvalue()), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        dist.broadcast(size, src=src)
        if self.rank != src:
            data = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(data, src=src)
        if (self.slot, self.incarnation) in new:
            state = torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=False)
            self.done, self._joins_seen = int(state.pop("done")), int(state.pop("joins"))
            self.state_sink(state)
        self.log(f"fleetx heal: generation {self.gen}: rank(s) {sorted(s for s, _ in new)} "
                 f"joined; state ({int(size.item())} bytes) sent by rank {src} in "
                 f"{time.monotonic() - started:.2f} s; this process is rank {self.rank} of "
                 f"{self.size}")

    def join(self) -> None:
        """A restarted process: register, wait to be admitted at a step boundary, receive the
        state (through ``state_sink``).

        Raises:
            CommError: not admitted within ``FLEETX_TIMEOUT`` seconds.
        """
        self.store.set(f"joined/{self.slot}", str(self.incarnation))
        self.store.add("joins", 1)
        self._beat.start()
        self.log(f"fleetx heal: rank {self.slot} (restart {self.incarnation}) asks to rejoin; "
                 f"waiting for a step boundary of the live ranks")
        g = int(self.store.get("latest").decode()) if self.store.check(["latest"]) else 0
        deadline = time.monotonic() + env.timeout()
        while time.monotonic() < deadline:
            key = f"gen/{g}"
            if not self.store.check([key]):
                time.sleep(_POLL_S)
                continue
            record = json.loads(self.store.get(key).decode())
            if [self.slot, self.incarnation] in record["new"]:
                self.gen = g - 1
                self._adopt(g, record)
                self._send_state(record)
                self.store.set(f"admitted/{self.slot}", str(self.incarnation))
                return
            g += 1
        raise CommError(f"rank {self.slot} (restart {self.incarnation}) was not admitted by the "
                        f"live ranks within {env.timeout():.0f} s (FLEETX_TIMEOUT)")

    def fall_back(self, reason: str) -> None:
        """Tell fleetrun to restart the whole group on a failure instead of healing."""
        if self.mode == "restart":
            return
        self.mode = "restart"
        self.store.compare_set("fallback", "", reason)


def start(slot: int, world_size: int, incarnation: int, store: Optional[Any] = None,
          log: Callable[[str], None] = print) -> Healer:
    """Connect to fleetrun's store and take part in the healing job (the first generation for
    a first process, a join for a restarted one, from ``fleet.distributed_optimizer``).

    Raises:
        CommError: fleetrun's store cannot be reached.
    """
    global _CURRENT
    if store is None:
        addr, port = env.get("MASTER_ADDR"), env.get_int("MASTER_PORT")
        try:
            store = dist.TCPStore(addr, port, is_master=False,
                                  timeout=timedelta(seconds=env.timeout()))
        except (RuntimeError, OSError) as exc:
            raise CommError(f"rank {slot} could not reach fleetrun's store at {addr}:{port}: "
                            f"{exc}") from exc
    healer = Healer(dist.PrefixStore("heal", store), slot, world_size, incarnation,
                    env.get_float("FLEETX_HEAL_TIMEOUT"), log)
    healer._raw_store = store
    if incarnation == 0:
        healer._first_generation()
    _CURRENT = healer
    return healer


def average_parameters(params: Sequence[torch.Tensor]) -> None:
    """Average ``params`` over the live ranks, healing on a failure; over the default group
    (torch's ``average_parameters``) outside a healing job."""
    healer = active()
    if healer is not None:
        healer.average(list(params))
        return
    from torch.distributed.algorithms.model_averaging.utils import average_parameters as avg

    with torch.no_grad():
        avg(iter(params), None)
