"""Joining the collective world: the rendezvous, the training process group, and a gloo side
group for host-side utilities (``fleet.util``) even when training runs on NCCL.

The rendezvous is our own thin layer over ``torch.distributed.TCPStore`` so that a missing peer
is named: every rank announces itself under ``fleetx/join/<rank>``; whoever waits past the timeout
reports exactly which ranks (and endpoints) never arrived. Once joined, each rank reports its
collective progress to the same store and explains a failed collective by naming the rank that
did not arrive (:mod:`fleetx.comm.blame`); ``FLEETX_DEBUG_COLLECTIVES=1`` also checks that every
rank makes the same calls (:mod:`fleetx.comm.debug`).
"""
from __future__ import annotations

import contextlib
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterator, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from fleetx import env
from fleetx.comm import debug, entry
from fleetx.comm.api import Blame, CommError, check_call
from fleetx.comm.blame import Watch

__all__ = ["CommError", "ProcessGroups", "current", "default_timeout", "join_alone",
           "leave_alone", "pick_backend"]

_POLL_S = 0.05
# Seconds between progress reports: often enough that a report is fresh when a collective
# times out, rarely enough to cost the store nothing (one small set per rank per second).
_REPORT_S = 1.0


def default_timeout(environ: Optional[Mapping[str, str]] = None) -> float:
    """Seconds a rendezvous or collective may wait for a peer (``FLEETX_TIMEOUT``, read by
    :func:`fleetx.env.timeout`), from ``environ`` (the process environment by default).

    Raises:
        fleetx.env.EnvError: it is not a whole number of seconds above 0.
    """
    return env.timeout(environ)


def pick_backend(requested: Optional[str] = None) -> str:
    """``nccl`` when CUDA is usable and nothing else was asked for, else ``gloo``."""
    requested = (requested or env.get("PADDLE_DISTRI_BACKEND")).lower()
    if requested == "auto":
        return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    if requested not in ("gloo", "nccl"):
        raise ValueError(f"backend {requested!r} is not supported; choose auto, gloo or nccl")
    return requested


# The communicator of the job this process joined (None: none, or it closed).
_CURRENT: Optional["ProcessGroups"] = None


def current() -> Optional["ProcessGroups"]:
    """The :class:`ProcessGroups` this process joined last and has not closed, or None (what a
    strategy's hook finds the job's store through, for :meth:`ProcessGroups.enter`)."""
    return _CURRENT


# The one-rank default group join_alone created (None: it created none, or it was left).
_ALONE: Optional[object] = None


def join_alone(backend: str) -> bool:
    """Give a one-process job the one-rank default process group torchrun's single process has
    (rank 0 of 1), so ``torch.distributed`` calls (``get_rank``, ``all_reduce``,
    ``DistributedSampler()``) work in ``python script.py`` too.

    Its store is an in-process ``HashStore``: no port is opened, so two one-process jobs on one
    host never collide. A default group that already exists (the script made one) is left.

    Returns:
        True when it created the group (:func:`leave_alone` destroys it).
    """
    global _ALONE
    if dist.is_initialized():
        return False
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    _ALONE = dist.group.WORLD
    return True


def leave_alone() -> None:
    """Destroy the group :func:`join_alone` created, if it is still the default group."""
    global _ALONE
    if _ALONE is not None and dist.is_initialized() and dist.group.WORLD is _ALONE:
        dist.destroy_process_group()
    _ALONE = None


def _master_address(endpoints: Sequence[str],
                    master: Optional[tuple] = None) -> tuple[str, int]:
    addr, port = env.get("MASTER_ADDR"), env.get_int("MASTER_PORT")
    if addr and port:
        return addr, port
    if master:  # found by the role maker (a Slurm or MPI launch)
        return master[0], int(master[1])
    if not endpoints:
        raise env.EnvError("cannot find the rendezvous: set MASTER_ADDR and MASTER_PORT, or "
                           "PADDLE_TRAINER_ENDPOINTS")
    host, _, p = endpoints[0].rpartition(":")
    return host.strip("[]"), int(p)


def _local_ip(master: str) -> str:
    """The address this host uses to reach the master (what peers can reach us on)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((master, 9))  # UDP connect sends nothing; it only picks a route
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


@dataclass
class ProcessGroups:
    """The process groups of one job. Build it with :meth:`join`.

    Attributes:
        rank, world_size: this process in the world.
        backend: backend of the training group.
        group: the training process group (the default group).
        host_group: a gloo group for CPU-side utilities (the default group when it is gloo).
        endpoints: ``ip:port`` of every rank (gathered at join when the launcher gave none).
    """

    rank: int
    world_size: int
    backend: str
    group: object
    host_group: object
    endpoints: list
    timeout: float

    @classmethod
    def join(cls, rank: int, world_size: int, endpoints: Sequence[str] = (),
             backend: Optional[str] = None, timeout: Optional[float] = None,
             master: Optional[tuple] = None) -> "ProcessGroups":
        """Rendezvous with every peer and create the process groups.

        The store is at ``MASTER_ADDR:MASTER_PORT`` when both are set, else at ``master``
        (``(host, port)``, e.g. the first node of a Slurm job), else at the first endpoint.

        If the script already created the default process group itself, it is reused (its rank
        and size must match the role) and only the gloo side group is added.

        Raises:
            CommError: the store at the master could not be reached, some ranks did not arrive
                within ``timeout`` seconds (they are named), or an existing process group
                contradicts the role.
        """
        timeout = default_timeout() if timeout is None else timeout
        if dist.is_initialized():
            return cls._adopt(rank, world_size, endpoints, timeout)
        backend = pick_backend(backend)
        addr, port = _master_address(endpoints, master)
        agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        store = _connect_store(addr, port, rank, world_size, timeout, agent_store)
        # An elastic restart reuses the agent's store: keep each attempt's keys apart.
        store = dist.PrefixStore(f"fleetx/{env.get_int('TORCHELASTIC_RESTART_COUNT')}", store)
        me = endpoints[rank] if endpoints else f"{_local_ip(addr)}:{port + 1 + rank}"
        store.set(f"fleetx/join/{rank}", me)
        _wait_for_ranks(store, world_size, timeout, endpoints)
        if not endpoints:
            endpoints = [store.get(f"fleetx/join/{r}").decode() for r in range(world_size)]
        dist.init_process_group(backend, store=dist.PrefixStore("pg", store), rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout))
        comm = cls._with_groups(rank, world_size, backend, list(endpoints), timeout, owned=True)
        comm._store = store  # keep the store (and its server on rank 0) alive until close()
        comm._watch(store)
        return comm

    @classmethod
    def _adopt(cls, rank: int, world_size: int, endpoints: Sequence[str],
               timeout: float) -> "ProcessGroups":
        if (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
            raise CommError(f"the existing process group has rank {dist.get_rank()} of "
                            f"{dist.get_world_size()}, but this process's role is rank {rank} of "
                            f"{world_size}")
        backend = dist.get_backend()
        comm = cls._with_groups(rank, world_size, backend, list(endpoints), timeout, owned=False)
        if not comm.endpoints:
            hosts: list = [None] * world_size
            dist.all_gather_object(hosts, _local_ip(env.get("MASTER_ADDR") or "127.0.0.1"),
                                   group=comm.host_group)
            port = env.get_int("MASTER_PORT") or 0  # only names nominal ports here
            comm.endpoints = [f"{h}:{port + 1 + r}" for r, h in enumerate(hosts)]
        # The script's own store: progress reports go under a prefix of their own.
        comm._watch(dist.PrefixStore("fleetx/progress",
                                     dist.distributed_c10d._get_default_store()))
        return comm

    @classmethod
    def _with_groups(cls, rank: int, world_size: int, backend: str, endpoints: list,
                     timeout: float, owned: bool) -> "ProcessGroups":
        group = dist.group.WORLD
        host_group = group if backend == "gloo" else dist.new_group(
            backend="gloo", timeout=timedelta(seconds=timeout))
        comm = cls(rank, world_size, backend, group, host_group, endpoints, timeout)
        comm._owned = owned
        return comm

    def _watch(self, store: "dist.Store") -> None:
        global _CURRENT
        interval = min(_REPORT_S, self.timeout / 5)
        self._progress = (store, interval, entry.Entries())
        _CURRENT = self
        checked = debug.requested()  # a malformed value fails before any thread starts
        self.watch = Watch(store, self.rank, self.timeout, env.get("FLEETX_LOG_DIR"), interval)
        self.watch.start()
        self.checker = None
        if checked:
            self.checker = debug.Checker(store, self.rank, self.timeout, self.watch.report,
                                         interval)
            self.checker.start()

    def enter(self, what: str, timeout: Optional[float] = None) -> None:
        """Wait until every rank entered the fleetx collective call ``what``
        (:func:`fleetx.comm.entry.enter`); one that will not is named at once, one that keeps
        reporting is waited for up to ``timeout`` seconds (the job's collective timeout).

        Raises:
            CommError: a rank went elsewhere, stopped, or did not come within the timeout.
        """
        found = getattr(self, "_progress", None)
        if found is not None and self.world_size > 1:
            store, interval, entries = found
            entry.enter(store, self.rank, self.world_size, what, entries,
                        self.timeout if timeout is None else timeout, interval)

    def side_group(self, name: str) -> object:
        """A gloo group of every rank for ``name``'s traffic alone, created at the first call
        (every rank makes that call, in the same order as its other groups). Work on another
        thread beside training (an asynchronous checkpoint's commit) must not share a group
        with the training loop's collectives, whose order it would break.

        Example::

            group = comm.side_group("checkpoint")
        """
        groups = self.__dict__.setdefault("_side_groups", {})
        if name not in groups:
            groups[name] = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout))
        return groups[name]

    def check(self, op: str, group: object, tensors: Sequence[torch.Tensor]) -> None:
        """With ``FLEETX_DEBUG_COLLECTIVES=1``, raise unless every rank of ``group`` is about
        to make the same call (see :mod:`fleetx.comm.debug`); otherwise nothing.

        Raises:
            CommError: the calls differ, or a rank did not come (the message names it).
        """
        check_call(op, group, tensors)

    def explain(self, exc: BaseException) -> Optional[Blame]:
        """Which rank made the collective that raised ``exc`` fail (None: cannot tell). The
        answer is also added to ``exc`` as a note and, under fleetrun, left for the launcher."""
        watch = getattr(self, "watch", None)
        return watch.explain(exc) if watch is not None else None

    @contextlib.contextmanager
    def explaining(self, what: str) -> Iterator[None]:
        """Run collectives named ``what``; a failure whose cause :meth:`explain` finds is raised
        as a :class:`CommError` naming the rank at fault (others pass unchanged).

        Example::

            with comm.explaining("fleet.util.all_reduce"):
                dist.all_reduce(tensor, group=comm.host_group)
        """
        try:
            yield
        except RuntimeError as exc:
            blame = self.explain(exc)
            if blame is None:
                raise
            error = CommError(f"{what} failed: {blame.message}")
            error._fleetx_blame = blame
            raise error from exc

    def barrier(self) -> None:
        """Wait for every rank; on timeout the error names the ranks that did not arrive."""
        self.check("barrier", self.host_group, ())
        try:
            with self.explaining("barrier"):
                dist.monitored_barrier(self.host_group, timeout=timedelta(seconds=self.timeout))
        except CommError:
            raise
        except RuntimeError as exc:
            raise CommError(f"barrier failed: {exc}") from exc

    def close(self) -> None:
        """Destroy the groups this communicator created and release its store.

        Called at interpreter exit by the fleet: leaving a process group (and a store client)
        to the interpreter's teardown can abort the process after a successful run.
        """
        global _CURRENT
        if _CURRENT is self:
            _CURRENT = None
        if getattr(self, "checker", None) is not None:
            self.checker.stop()
            self.checker = None
        if getattr(self, "watch", None) is not None:
            self.watch.stop()  # before the store it reports to goes
            self.watch = None
        for side in self.__dict__.pop("_side_groups", {}).values():
            if dist.is_initialized():
                dist.destroy_process_group(side)
        if getattr(self, "_owned", False) and dist.is_initialized():
            dist.destroy_process_group()
        elif self.host_group is not self.group and dist.is_initialized():
            dist.destroy_process_group(self.host_group)
        self._owned = False
        self.__dict__.pop("_store", None)


def _connect_store(addr: str, port: int, rank: int, world_size: int, timeout: float,
                   agent_store: bool) -> "dist.TCPStore":
    try:
        return dist.TCPStore(addr, port, world_size, is_master=(rank == 0 and not agent_store),
                             timeout=timedelta(seconds=timeout), wait_for_workers=False)
    except (RuntimeError, OSError) as exc:
        who = "listen" if rank == 0 else "reach rank 0's rendezvous store"
        raise CommError(f"rank {rank} could not {who} at {addr}:{port} within {timeout:.0f} s: "
                        f"{exc}") from exc


def _wait_for_ranks(store: "dist.Store", world_size: int, timeout: float,
                    endpoints: Sequence[str]) -> None:
    keys = [f"fleetx/join/{r}" for r in range(world_size)]
    deadline = time.monotonic() + timeout
    while not store.check(keys):
        if time.monotonic() > deadline:
            missing = [r for r, k in enumerate(keys) if not store.check([k])]
            named = ", ".join(f"{r} ({endpoints[r]})" if endpoints else str(r) for r in missing)
            raise CommError(f"timed out after {timeout:.0f} s waiting for rank(s) {named} to join "
                            f"(set FLEETX_TIMEOUT to wait longer)")
        time.sleep(_POLL_S)
