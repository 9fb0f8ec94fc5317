"""The workers one server expects: who registered, who stopped, who was lost, and whom a sync
round or a barrier must hear from.

The server's handler thread owns a :class:`Roster` (no locks: only that thread touches it). A
worker registers with HELLO (its rank, table layout and mode checked here), turns to inference
with INFER, stops with BYE; it is *lost* when its connection dies, when it never connected
within ``PSConfig.timeout``, or when the server finds it stuck (``fleetx.ps.rounds.stalled``).
The first loss is what the server raises when it ends.

Failover (``PSConfig.failover``, ``fleetrun --max_restarts``): a trainer whose connection dies
is *away*, not lost: fleetrun restarts a killed worker, and a worker whose link broke
reconnects. Sync rounds and barriers keep waiting for it; a HELLO of its rank (the restarted
process, or the same one reconnecting) makes it active again, on the new link. A worker away
longer than ``PSConfig.timeout`` is lost, and the waits fail naming it.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional

from fleetx.ps import requests
from fleetx.ps.api import PeerLostError, PSConfig, PSConfigError
from fleetx.ps.transport import Link

__all__ = ["Roster", "Worker"]

log = logging.getLogger("fleetx.ps")


class Worker:
    """One registered rank (a trainer, or a heter worker after the trainers)."""

    __slots__ = ("rank", "name", "link", "state", "last_request", "infer", "away",
                 "rejoins", "pid", "new_process")

    def __init__(self, rank: int, name: str, link: Optional[Link]) -> None:
        self.rank, self.name, self.link, self.state = rank, name, link, "active"
        self.last_request = time.monotonic()  # heartbeats do not count: they prove life only
        self.infer = False  # turned to inference: no writes, no sync rounds
        self.away: Optional[tuple[float, str]] = None  # failover: (since, why its link died)
        self.rejoins = 0  # HELLOs of this rank after its link died (failover)
        self.pid: Any = None  # the process, as its HELLO says
        self.new_process = False  # rejoined from another process (restarted by fleetrun)


class Roster:
    """The workers of one server.

    Args:
        config: the cluster.
        read_only: the server serves an inference-only job (its heter workers do not connect,
            and a worker that wants to train is refused).
        name: the server's name, for messages.
        on_change: called when a worker stopped, turned to inference or was lost (the server
            then tries its waiting rounds and barriers again).

    Example:
        >>> roster = Roster(config, False, "server 0", on_change=lambda: None)  # doctest: +SKIP
        >>> roster.expected()
        [0, 1]
    """

    def __init__(self, config: PSConfig, read_only: bool, name: str,
                 on_change: Callable[[], None]) -> None:
        self.config, self.read_only, self.name = config, read_only, name
        self.workers: dict[int, Worker] = {}
        self.lost: list[PeerLostError] = []
        self.started = time.monotonic()
        self._on_change = on_change

    def registering(self) -> range:
        """Ranks that must connect: the trainers, then the heter workers (an inference-only
        job runs the heter sections on the trainers: its heter workers do not connect)."""
        heter = 0 if self.read_only else self.config.num_heter_workers
        return range(self.config.num_workers + heter)

    def of(self, link: Link) -> Optional[Worker]:
        """The worker registered on ``link``'s rank (None before its HELLO)."""
        return self.workers.get(link.peer_info.get("rank"))

    def register(self, link: Link, meta: dict, fingerprint: Any, mode: str) -> Worker:
        """HELLO: check the worker's rank, table layout and mode; name its link.

        Raises:
            PSConfigError: a rank out of range or taken, another layout or mode, or a training
                worker of an inference-only job.
        """
        rank = meta.get("rank")
        ranks = self.registering()
        if type(rank) is not int or rank not in ranks:
            raise PSConfigError(f"HELLO: worker rank {rank!r} is not an integer in "
                                f"[0, {len(ranks)})")
        infer = requests.optional_bool("HELLO", meta, "infer")
        if self.read_only and not infer:
            raise PSConfigError(f"worker {rank} wants to train, but {self.name} serves an "
                                "inference-only job (read-only tables); start training jobs "
                                "with fleet.init_server() and fleet.run_server()")
        if meta.get("fingerprint") != fingerprint:
            raise PSConfigError(f"worker {rank} has another table layout than this server; "
                                "build the tables from the same model and optimizer everywhere")
        if meta.get("mode") != mode:
            raise PSConfigError(f"worker {rank} runs mode {meta.get('mode')!r}, this server "
                                f"runs {mode!r}")
        old = self.workers.get(rank)
        if old is not None and old.state != "away":
            raise PSConfigError(f"worker rank {rank} already {old.state} ({old.name})")
        who = "worker" if rank < self.config.num_workers else \
            f"heter worker {rank - self.config.num_workers}, rank"
        link.name = f"{who} {rank} (pid {meta.get('pid')} on {meta.get('host')})"
        link.peer_info["rank"] = rank
        worker = self.workers[rank] = Worker(rank, link.name, link)
        worker.infer, worker.pid = infer, meta.get("pid")
        if old is not None:  # away: the restarted process, or this one on a new link
            worker.rejoins, worker.new_process = old.rejoins + 1, old.pid != worker.pid
            log.warning("%s: %s rejoined after %.1f s away (%s); it was %s", self.name,
                        link.name, time.monotonic() - old.away[0], old.away[1], old.name)
        return worker

    def turned_to_inference(self, link: Link) -> None:
        self.workers[link.peer_info["rank"]].infer = True
        self._on_change()

    def stopped(self, link: Link) -> None:
        self.workers[link.peer_info["rank"]].state = "finished"
        self._on_change()

    def link_lost(self, link: Link, reason: str) -> bool:
        """``link`` died: its worker is lost (with failover, a trainer is away: True), unless
        it was never registered on it or said BYE."""
        w = self.of(link)
        if w is None or w.link is not link or w.state != "active":
            return False
        if self.config.failover and w.rank < self.config.num_workers:
            w.state, w.away = "away", (time.monotonic(), reason)
            log.warning("%s: %s is away (%s); failover: waiting up to %.0f s (FLEETX_TIMEOUT) "
                        "for it to rejoin", self.name, w.name, reason, self.config.timeout)
            return True
        self.mark_lost(w, reason)
        return False

    def check_away(self, now: float) -> None:
        """Failover: a worker away for longer than ``timeout`` is lost."""
        for w in self.workers.values():
            if w.state == "away" and now - w.away[0] > self.config.timeout:
                self.mark_lost(w, f"{w.away[1]}; failover: it did not rejoin within "
                                  f"{self.config.timeout:g} s (FLEETX_TIMEOUT)")

    def mark_lost(self, w: Worker, reason: str) -> None:
        w.state = "lost"
        err = PeerLostError(w.name, reason)
        self.lost.append(err)
        log.error("%s: %s", self.name, err)
        self._on_change()

    def registration_wait(self) -> float:
        """How long after its start the server waits for every worker: ``timeout`` and a quarter
        more, so that a worker held up by another server (unreachable, or refusing it) gives up
        first and names that server; the server's own "did not connect" comes after."""
        return self.config.timeout * 1.25

    def check_registration(self, now: float) -> None:
        """Ranks not connected :meth:`registration_wait` seconds after the start are lost."""
        wait = self.registration_wait()
        if now - self.started < wait or len(self.workers) == len(self.registering()):
            return
        for rank in self.registering():
            if rank not in self.workers:
                self.workers[rank] = Worker(rank, f"worker {rank}", None)
                self.mark_lost(self.workers[rank], "did not connect within "
                               f"{wait:g} s")

    def expected(self, rounds: bool = False) -> list[int]:
        """Trainer ranks a barrier (or, with ``rounds``, a sync round) must hear from: all
        but the stopped ones, and for rounds also those that turned to inference (an away
        worker is expected: it rejoins, or is lost after the timeout)."""
        out = []
        for r in range(self.config.num_workers):
            w = self.workers.get(r)
            if w is None or (w.state != "finished" and not (rounds and w.infer)):
                out.append(r)
        return out

    def finished(self) -> bool:
        """Every rank stopped or was lost."""
        workers = self.workers  # checked after every request: stops at the first rank still on
        return all(r in workers and workers[r].state in ("finished", "lost")
                   for r in self.registering())

    def active_requests(self) -> dict[int, float]:
        """``{rank: time of its last request}`` of the active workers (an away worker is not
        stuck: its own timeout runs, :meth:`check_away`; once it rejoins, this starts again)."""
        return {r: w.last_request for r, w in self.workers.items() if w.state == "active"}

    def states(self) -> dict[int, str]:
        return {w.rank: w.state for w in self.workers.values()}
