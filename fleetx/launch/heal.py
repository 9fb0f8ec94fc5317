"""``fleetrun --fault_tolerance heal``: a collective job on one node whose dead ranks are
restarted alone while the others train on.

fleetrun hosts the job's store (a ``TCPStore`` in this process, so it outlives any rank) and
starts, watches and restarts the processes itself instead of torch's elastic agent, which can
only restart the whole group. What it writes to the store is what it knows, for the ranks'
:mod:`fleetx.comm.heal`: a process that died (``heal/dead/<rank>``, a count, and
``heal/deaths``). It reads their heartbeats: a rank silent for ``FLEETX_HEAL_TIMEOUT`` seconds
is frozen (stopped, deadlocked holding the interpreter lock) and killed, then handled as dead.

* A rank that dies is restarted alone, up to ``--max_restarts`` times per rank; its log
  continues. A rank with no restart left is not restarted: the job goes on without it, and the
  end says so.
* Once a rank has finished its script, dead ranks are not restarted any more and a restarted
  rank still waiting to be admitted is stopped: there is no step left to join at.
* When the ranks' plan cannot heal (``fleetx heal: ... falls back to restart`` in their logs:
  sharding, tensor or pipeline parallel...), a failure restarts every rank, as
  ``--fault_tolerance restart`` does, counted against ``--max_restarts``, on a fresh store.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from typing import Optional

from fleetx import env
from fleetx.launch import hosts, logs, summary
from fleetx.launch.api import EXIT_FAILED, EXIT_OK

__all__ = ["run"]

_POLL_S = 0.1
_GRACE_S = 10


def _say(message: str) -> None:
    print(f"fleetrun: {message}", file=sys.stderr, flush=True)


class _HealJob:
    """The processes of a healing job, the store they meet at, and what fleetrun saw."""

    def __init__(self, p) -> None:
        self.plan = p
        self.world = p.nproc
        self.procs: dict[int, subprocess.Popen] = {}
        self.restarts = dict.fromkeys(range(self.world), 0)
        self.lost: set[int] = set()
        self.finished: set[int] = set()
        self.rejoined: set[int] = set()
        self.attempt = 0
        self.mode = "heal"
        self.watch = summary.ProcessWatch()
        self.timeout = env.get_float("FLEETX_HEAL_TIMEOUT")
        self.port = p.master_port
        self._open_store()

    def _open_store(self) -> None:
        import torch.distributed as dist

        from fleetx.launch.rendezvous import serve

        # listening on the job's address only (torch alone would listen on every interface);
        # the store owns the socket from here (a fresh store replaces it at a group restart)
        listener = serve(self.plan.master_addr, self.port, "choose a free one with --master",
                         what="healing job's store")
        self._server = dist.TCPStore(self.plan.master_addr, self.port, is_master=True,
                                     wait_for_workers=False,
                                     timeout=timedelta(seconds=env.timeout()),
                                     master_listen_fd=listener.detach(), use_libuv=True)
        self.store = dist.PrefixStore("heal", self._server)
        self.beats: dict[int, tuple[int, float]] = {}
        self.started_at: dict[int, int] = {}

    def spawn(self, slot: int) -> None:
        p = self.plan
        child = dict(env.environ)
        env.apply({"RANK": str(slot), "LOCAL_RANK": str(slot), "WORLD_SIZE": str(self.world),
                   "LOCAL_WORLD_SIZE": str(self.world), "GROUP_RANK": "0",
                   "MASTER_ADDR": p.master_addr,
                   "MASTER_PORT": str(self.port), "FLEETX_FAULT_TOLERANCE": "heal",
                   "TORCHELASTIC_RESTART_COUNT": str(self.restarts[slot] + self.attempt),
                   "FLEETX_HEAL_RESTARTS": str(self.restarts[slot])}, child)
        self.rejoined.discard(slot)
        self.procs[slot] = subprocess.Popen(
            [sys.executable, "-u", "-m", "fleetx.launch.bootstrap", p.setup.to_json(), p.script,
             *p.script_args], env=child, stdin=subprocess.DEVNULL, start_new_session=True)
        self.watch.started(("trainer", slot), self.procs[slot].pid)
        # Beats of an earlier process of this slot are in the count: judge this one only once
        # it beats itself (starting, it imports torch and may take longer than the timeout).
        self.beats.pop(slot, None)
        self.started_at[slot] = int(self.store.add(f"beat/{slot}", 0))

    def log_of(self, slot: int) -> str:
        return logs.worker_log(self.plan.setup.log_dir, slot)

    # -- what the ranks said ------------------------------------------------------------------
    def check_fallback(self) -> None:
        if self.mode == "heal" and self.store.check(["fallback"]):
            self.mode = "restart"
            _say(f"--fault_tolerance heal falls back to restart (a failure restarts every rank): "
                 f"{self.store.get('fallback').decode()}")

    def kill_frozen(self) -> None:
        now = time.monotonic()
        for slot, proc in self.procs.items():
            if proc.poll() is not None:
                continue
            count = int(self.store.add(f"beat/{slot}", 0))
            seen = self.beats.get(slot)
            if count == self.started_at.get(slot, 0):
                continue  # not beating yet: still starting
            if seen is None or seen[0] != count:
                self.beats[slot] = (count, now)
            elif now - seen[1] > self.timeout:
                _say(f"heal: rank {slot} (pid {proc.pid}) sent no heartbeat for "
                     f"{now - seen[1]:.0f} s (FLEETX_HEAL_TIMEOUT={self.timeout:g}): frozen; "
                     f"killing it")
                _kill(proc, signal.SIGKILL)
                proc.wait()

    def announce_rejoins(self) -> None:
        """One line when a restarted rank was admitted by the live ranks."""
        for slot in self.procs:
            if self.restarts[slot] and slot not in self.rejoined and \
                    not self.waiting_to_join(slot):
                self.rejoined.add(slot)
                _say(f"heal: rank {slot} (restart {self.restarts[slot]}, pid "
                     f"{self.procs[slot].pid}) rejoined the live ranks")

    def waiting_to_join(self, slot: int) -> bool:
        if self.restarts[slot] == 0:
            return False
        key = f"admitted/{slot}"
        return not (self.store.check([key]) and
                    int(self.store.get(key).decode()) == self.restarts[slot])

    # -- what happened to the processes ---------------------------------------------------------
    def died(self, slot: int, code: int) -> Optional[int]:
        """Handle a process that failed; an exit code when the job must end."""
        proc = self.procs.pop(slot)
        how = f"rank {slot} (pid {proc.pid}) {logs.describe_exit(code)} (log: {self.log_of(slot)})"
        if self.mode == "restart":
            return self.restart_group(how)
        self.store.add(f"dead/{slot}", 1)
        self.store.add("deaths", 1)
        live = len(self.procs)
        if self.finished:
            _say(f"heal: {how}; a rank has finished already: not restarted")
            return None
        if self.restarts[slot] >= self.plan.max_restarts:
            self.lost.add(slot)
            _say(f"heal: {how}; no restart left (--max_restarts {self.plan.max_restarts}): the "
                 f"job goes on with {live} rank(s) without rank {slot}")
            return None if live else EXIT_FAILED
        self.restarts[slot] += 1
        _say(f"heal: {how}; the other {live} rank(s) go on without it; restarting rank {slot} "
             f"alone (restart {self.restarts[slot]} of {self.plan.max_restarts}): it joins at a "
             f"step boundary; its log continues in {self.log_of(slot)}")
        self.spawn(slot)
        return None

    def restart_group(self, how: str) -> Optional[int]:
        if self.attempt >= self.plan.max_restarts:
            _say(f"{how}; no restart left (--max_restarts {self.plan.max_restarts})")
            return EXIT_FAILED
        self.attempt += 1
        _say(f"restart {self.attempt} of {self.plan.max_restarts}: {how}; restarting every rank "
             f"(the plan cannot heal)")
        self.stop()
        self.port = hosts.free_ports(1)[0]  # a fresh store: no key of the last attempt
        self._open_store()
        self.mode, self.finished = "heal", set()
        for slot in range(self.world):
            self.spawn(slot)
        return None

    def stop(self, slots=None) -> None:
        targets = [p for s, p in self.procs.items() if slots is None or s in slots]
        for sig, wait in ((signal.SIGTERM, _GRACE_S), (signal.SIGKILL, 0)):
            for proc in targets:
                if proc.poll() is None:
                    _kill(proc, sig)
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and any(p.poll() is None for p in targets):
                time.sleep(_POLL_S)
        for proc in targets:
            proc.wait()


def _kill(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _watch(job: _HealJob, stop_requested: list) -> int:
    while True:
        if stop_requested:
            job.stop()
            _say(f"received {stop_requested[0].name}, stopped all processes")
            return 128 + stop_requested[0]
        job.check_fallback()
        job.kill_frozen()
        job.announce_rejoins()
        attempt = job.attempt
        for slot, proc in list(job.procs.items()):
            if job.attempt != attempt:
                break  # the group was restarted: these processes were stopped on purpose
            code = proc.poll()
            job.watch.poll(("trainer", slot), proc.pid, code)
            if code == 0:
                job.procs.pop(slot)
                job.finished.add(slot)
            elif code is not None:
                ended = job.died(slot, code)
                if ended is not None:
                    job.stop()
                    return ended
        if job.finished:
            joining = [s for s in job.procs if job.waiting_to_join(s)]
            if joining:
                _say(f"heal: rank(s) {joining} still waiting to rejoin when rank(s) "
                     f"{sorted(job.finished)} finished: stopped (no step left to join at)")
                job.stop(joining)
                for slot in joining:
                    job.procs.pop(slot)
                    job.lost.add(slot)
        if not job.procs:
            if job.lost:
                _say(f"heal: the job finished with {len(job.finished)} of {job.world} rank(s); "
                     f"rank(s) {sorted(job.lost)} did not come back")
            return EXIT_OK
        time.sleep(_POLL_S)


def run(p) -> int:
    """Run a single-node collective plan under ``--fault_tolerance heal``; fleetrun's exit code.

    Raises:
        LaunchError: the log folder cannot be written or the store's port is taken.
    """
    logs.prepare_dir(p.setup.log_dir)
    for note in logs.archive_earlier(p.setup.log_dir):
        print(f"fleetrun: {note}", flush=True)
    job = _HealJob(p)
    shown = p.shown_here()
    followers = [logs.LogFollower(logs.worker_log(p.setup.log_dir, rank), sys.stdout.buffer,
                                  prefix=f"[rank {rank}] " if len(shown) > 1 else None).start()
                 for rank in shown]
    stop_requested: list = []
    previous = {sig: signal.signal(sig, lambda s, _: stop_requested.append(signal.Signals(s)))
                for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for slot in range(job.world):
            job.spawn(slot)
        code = _watch(job, stop_requested)
    finally:
        job.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for follower in followers:
            follower.stop()
        print(summary.format_table(job.watch.rows(p.setup.log_dir)), file=sys.stderr,
              flush=True)
    if code == EXIT_OK:
        print("Local processes completed.", flush=True)
    else:
        _say(f"ABORT!!! the healing job failed; see the logs in {p.setup.log_dir}")
    return code

