"""Parameter-server jobs: decide a :class:`PSPlan` (pure), then start, watch and stop the
processes of this node.

Decisions, in :func:`plan` (``ps_plan.py``, re-exported here): the job's endpoints, which of
them this node starts, each process's environment and log file, the shared secret, the socket
interfaces and failover's snapshots, each with a note when fleetrun chose for the user.

Running, in :func:`run`: every process starts in ``bootstrap.py`` (it dies with fleetrun, even
on SIGKILL, and takes whatever it started along) and writes ``serverlog.N`` / ``workerlog.N`` /
``heterlog.N``; worker 0's log is copied to fleetrun's stdout. When every local worker has
finished, the servers and heter workers finish by themselves (they stop once every worker of
the job said goodbye); on a single node fleetrun stops any that linger. Any process that fails
stops the job: fleetrun names it (role and index), shows the end of its log and exits 1; with
``--max_restarts N`` (failover) a server or worker that fails is restarted instead, up to N
times each, with the same endpoint, environment and secret plus ``TORCHELASTIC_RESTART_COUNT``:
a server loads its latest snapshot (:mod:`fleetx.ps.snapshots`; ``FLEETX_PS_CHECKPOINT_DIR`` /
``_INTERVAL`` / ``FLEETX_PS_JOB_ID``), a worker runs the script from the top and rejoins the
servers, which kept its rank for it (:mod:`fleetx.ps.roster`).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Optional

from fleetx import env
from fleetx.launch import banner, hosts, logs, script, summary
from fleetx.launch.api import EXIT_FAILED, EXIT_OK, ConfigError, LaunchError
from fleetx.launch.config import LaunchConfig
# The decisions live in ps_plan.py; plan, PSPlan and PSProcess are re-exported from here.
from fleetx.launch.ps_plan import WORKER_BASE_PORT, PSPlan, PSProcess, plan

__all__ = ["PSProcess", "PSPlan", "plan", "run", "launch", "dry_run", "WORKER_BASE_PORT"]

_TAIL_LINES = 20
_GRACE_SECONDS = 10  # between SIGTERM and SIGKILL when fleetrun stops processes
_LINGER_SECONDS = 5  # a single-node server still running this long after the last worker
_POLL_SECONDS = 0.1


class _Job:
    """The running processes of this node: start, poll, stop."""

    def __init__(self, p: PSPlan) -> None:
        self.plan = p
        self.procs: dict[PSProcess, subprocess.Popen] = {}
        self.restarts: dict[PSProcess, int] = {}
        self.watch = summary.ProcessWatch()

    def start(self) -> None:
        for proc in self.plan.local:  # from the main thread: PDEATHSIG follows the thread
            self._spawn(proc, 0)

    def _spawn(self, proc: PSProcess, restart: int) -> None:
        child = dict(env.environ)
        env.apply(proc.env, child)
        if self.plan.secret:  # in the environment only: not in the banner, not in argv
            env.apply({"FLEETX_PS_SECRET": self.plan.secret}, child)  # the same on a restart
        if restart:
            env.apply({"TORCHELASTIC_RESTART_COUNT": str(restart)}, child)
        setup = json.dumps({"log": proc.log_path(self.plan.log_dir),
                            "launcher_pid": self.plan.launcher_pid,
                            "module": self.plan.module, "fresh": not restart})
        self.procs[proc] = subprocess.Popen(
            [sys.executable, "-u", "-m", "fleetx.launch.bootstrap", "--ps", setup,
             self.plan.script, *self.plan.script_args],
            env=child, stdin=subprocess.DEVNULL, start_new_session=True)
        self.restarts[proc] = restart
        self.watch.started((proc.role, proc.index), self.procs[proc].pid)
        print(f"launch {proc.role} proc_id:{self.procs[proc].pid} idx:{proc.index}"
              + (f" (restart {restart} of {self.plan.max_restarts})" if restart else ""),
              flush=True)

    def restartable(self, proc: PSProcess) -> bool:
        """Failover restarts servers and workers (heter workers: not yet)."""
        return proc.role in ("server", "worker") and \
            self.restarts[proc] < self.plan.max_restarts

    def restart(self, proc: PSProcess, code: Optional[int]) -> None:
        """Announce the failure of ``proc`` and start it again (its log continues)."""
        self.procs[proc].wait()
        restart = self.restarts[proc] + 1
        then = ("it loads its latest snapshot and the workers reconnect" if proc.role ==
                "server" else "it runs the script from the top and rejoins the servers, which "
                "kept their tables")
        print(f"fleetrun: {proc.name} {logs.describe_exit(code)}; restarting it (restart "
              f"{restart} of {self.plan.max_restarts}): {then}; its log continues in "
              f"{proc.log_path(self.plan.log_dir)}", file=sys.stderr, flush=True)
        self._spawn(proc, restart)

    def codes(self) -> dict[PSProcess, Optional[int]]:
        codes = {proc: p.poll() for proc, p in self.procs.items()}
        for proc, code in codes.items():  # wall time and peak RSS for the summary
            self.watch.poll((proc.role, proc.index), self.procs[proc].pid, code)
        return codes

    def stop(self, which=None) -> None:
        """SIGTERM the process groups, then SIGKILL what is left after the grace period."""
        targets = [p for proc, p in self.procs.items() if which is None or proc in which]
        for sig, wait in ((signal.SIGTERM, _GRACE_SECONDS), (signal.SIGKILL, 0)):
            for p in targets:
                if p.poll() is None or sig == signal.SIGKILL:
                    try:
                        os.killpg(p.pid, sig)
                    except (ProcessLookupError, PermissionError):
                        pass
            deadline = time.monotonic() + wait
            while wait and time.monotonic() < deadline and any(p.poll() is None
                                                               for p in targets):
                time.sleep(_POLL_SECONDS)
        for p in targets:
            p.wait()


def _report_failure(p: PSPlan, failed: list, codes: dict) -> None:
    heters = f", {len(p.heters)} heter worker(s)" if p.heters else ""
    total = f"{len(p.servers)} server(s){heters} and {len(p.workers)} worker(s)"
    names = ", ".join(proc.label for proc in failed)
    lines = [f"ABORT!!! Out of all {total}, {names} failed. Please check its log."]
    for proc in failed:
        code = codes[proc]
        how = logs.describe_exit(code)
        path = proc.log_path(p.log_dir)
        if proc in p.shown_here():  # copied to stdout as it grew: not twice
            lines += logs.shown_above(f"{proc.name} {how}", path)
            continue
        lines.append(f"{proc.name} {how}; last {_TAIL_LINES} lines of {path}:")
        lines += [f"    {line}" for line in logs.last_lines(path, _TAIL_LINES)] or ["    (empty)"]
    others = [q.label for q in p.local if q not in failed]
    if others:
        lines.append(f"stopped the other process(es): {', '.join(others)}")
    print("\n".join(lines), file=sys.stderr, flush=True)


def _watch(job: _Job, stop_requested: list) -> int:
    p = job.plan
    workers_done_at: Optional[float] = None
    while True:
        if stop_requested:
            job.stop()
            sig = stop_requested[0]
            print(f"fleetrun: received {sig.name}, stopped all processes", file=sys.stderr,
                  flush=True)
            return 128 + sig
        codes = job.codes()
        failed = [proc for proc, code in codes.items() if code not in (None, 0)]
        if failed and all(job.restartable(proc) for proc in failed):
            for proc in failed:
                job.restart(proc, codes[proc])
            continue
        if failed:
            job.stop([proc for proc, code in codes.items() if code is None])
            _report_failure(p, failed, codes)
            return EXIT_FAILED
        running = [proc for proc, code in codes.items() if code is None]
        if not any(proc.role == "worker" for proc in running):
            if workers_done_at is None:
                workers_done_at = time.monotonic()
                if any(proc.role == "worker" for proc in p.local):
                    print("all workers exit, going to finish parameter server.", flush=True)
            if not running:
                return EXIT_OK
            lingering = time.monotonic() - workers_done_at > _LINGER_SECONDS
            if p.single_node and lingering:
                job.stop(running)
                return EXIT_OK
        time.sleep(_POLL_SECONDS)


def _check_server_ports(p: PSPlan) -> None:
    """Refuse the job before anything starts when a local server or heter worker could not
    listen on its port."""
    for proc in p.local:
        if proc.role == "worker":
            continue
        host, _, port = proc.endpoint.rpartition(":")
        why = hosts.port_in_use(host.strip("[]"), int(port))
        if why:
            flag = "--servers" if proc.role == "server" else "--heter_workers"
            raise LaunchError(f"{proc.name} cannot listen on port {port} of {host}: {why}; "
                              f"free it or give that {proc.role_name} another port in "
                              f"{flag}")


def run(p: PSPlan) -> int:
    """Start this node's processes and watch them; the exit code fleetrun should return.

    Raises:
        LaunchError: the log folder cannot be written, or a server's port is in use (checked
            before any process starts).
    """
    logs.prepare_dir(p.log_dir)
    _check_server_ports(p)
    if p.single_node:  # on several nodes another node's processes may already write here
        for note in logs.archive_earlier(p.log_dir):
            print(f"fleetrun: {note}", flush=True)
    first = {proc.role: proc for proc in reversed(p.local)}
    for proc in (first.get("server"), first.get("worker"), first.get("heter")):
        if proc is not None:
            print(banner.envs_table(proc.env), flush=True)
    shown = p.shown_here()
    followers = [logs.LogFollower(proc.log_path(p.log_dir), sys.stdout.buffer,
                                  prefix=f"[worker {proc.index}] " if len(shown) > 1 else None
                                  ).start() for proc in shown]
    stop_requested: list = []
    previous = {sig: signal.signal(sig, lambda s, _: stop_requested.append(signal.Signals(s)))
                for sig in (signal.SIGTERM, signal.SIGINT)}
    job = _Job(p)
    try:
        job.start()
        code = _watch(job, stop_requested)
    finally:
        job.stop()
        job.codes()  # the exit status of those stopped just now
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for follower in followers:
            follower.stop()
        print(summary.format_table(job.watch.rows(p.log_dir)), file=sys.stderr, flush=True)
    if code == EXIT_OK:
        if any(proc.role == "heter" for proc in p.local):
            print("all heter_worker are killed", file=sys.stderr, flush=True)
        if any(proc.role == "server" for proc in p.local):
            # stderr, where Paddle's launcher tests look for it
            print("all parameter server are killed", file=sys.stderr, flush=True)
        print("Local processes completed.", flush=True)
    return code


def dry_run(config: LaunchConfig) -> int:
    """Run the script once as worker 0 of the requested job, without peers (``--dry-run``).

    The fleet prints the plan at ``distributed_optimizer`` and exits 0 before communicating;
    the script's exit code is fleetrun's.
    """
    problem = script.entrypoint_problem(config.training_script, config.module)
    if problem:
        raise ConfigError("training_script", problem)
    p = plan(config, is_local=lambda addr: True, user_omp=env.get("OMP_NUM_THREADS"))
    worker0 = next(proc for proc in p.local if proc.role == "worker" and proc.index == 0)
    child = dict(env.environ)
    env.apply(dict(worker0.env, FLEETX_DRY_RUN="1"), child)
    heters = f" and {len(p.heters)} heter worker(s)" if p.heters else ""
    print(f"fleetrun --dry-run: the job's processes and their logs:\n{p.processes()}",
          flush=True)
    print(f"fleetrun --dry-run: running {config.training_script} as worker 0 of "
          f"{len(p.workers)} worker(s) with {len(p.servers)} server(s){heters}, without peers",
          flush=True)
    module = ["-m"] if p.module else []
    return subprocess.call([sys.executable, "-u", *module, p.script, *p.script_args], env=child)


def launch(config: LaunchConfig) -> int:
    """Plan and run this node's part of a parameter-server job; returns fleetrun's exit code.

    Raises:
        ConfigError: the script does not exist, or the flags cannot be served on this node.
    """
    problem = script.entrypoint_problem(config.training_script, config.module)
    if problem:
        raise ConfigError("training_script", problem)
    if config.ps_secret_file and not os.access(config.ps_secret_file, os.R_OK):
        raise ConfigError("--ps_secret_file", f"{config.ps_secret_file}: no such file or not "
                                              "readable")
    p = plan(config, user_omp=env.get("OMP_NUM_THREADS"), launcher_pid=os.getpid(),
             user_secret=env.is_set("FLEETX_PS_SECRET") or env.is_set("FLEETX_PS_SECRET_FILE"),
             user_ifnames=[name for name in hosts.SOCKET_IFNAME_VARS if env.is_set(name)])
    print(p.describe(), flush=True)
    return run(p)
