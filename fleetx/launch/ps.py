"""Parameter-server jobs: decide a :class:`PSPlan` (pure), then start, watch and stop the
processes of this node.

Decisions, in :func:`plan`:

* endpoints: ``--servers`` / ``--workers`` / ``--heter_workers`` list every server, worker and
  heter worker of the job (a worker given as a bare IP gets port ``6170 + number of servers +
  its index``, as in Paddle); ``--server_num`` / ``--worker_num`` / ``--heter_worker_num`` alone
  mean that many on this machine at free ports of 127.0.0.1 (with a list as well, the number
  must match it);
* this node starts the endpoints whose address is one of its own (multi-node: run the same
  command on every node);
* each process gets the reference environment (``TRAINING_ROLE``,
  ``PADDLE_PSERVERS_IP_PORT_LIST``, ``PADDLE_TRAINER_ENDPOINTS``, ``PADDLE_TRAINERS_NUM``,
  ``PADDLE_TRAINER_ID`` for workers, ``POD_IP``, ``PADDLE_PORT``; with heter workers
  ``PADDLE_ALL_HETER_TRAINER_IP_PORT_LIST`` and Paddle 2.0's ``PADDLE_HETER_TRAINER_IP_PORT_LIST``
  for every process and ``TRAINING_ROLE=HETER_TRAINER`` for them) and ``OMP_NUM_THREADS=1``
  when several share the node and the user did not set it;
* the job's shared secret: ``--ps_secret_file`` (``FLEETX_PS_SECRET_FILE``), or what the user's
  environment already holds, or, for a single-node job, a fresh random one that only the
  processes' environment carries (never the command line, the banner or a file). A job on
  several nodes without one is refused: each node would make its own;
* in a job on several nodes, ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``, unless the user set
  them: the interface that holds each process's address, as in a collective job (a script that
  opens a torch.distributed group among the workers then binds where the job's endpoints are).

Running, in :func:`run`: every process starts in ``bootstrap.py`` (it dies with fleetrun, even
on SIGKILL, and takes whatever it started along) and writes ``serverlog.N`` / ``workerlog.N`` /
``heterlog.N``; worker 0's log is copied to fleetrun's stdout. When every local worker has
finished, the servers and heter workers finish by themselves (they stop once every worker of
the job said goodbye); on a single node fleetrun stops any that linger. Any process that fails stops the job: fleetrun
names it (role and index), shows the end of its log and exits 1; with ``--max_restarts N``
(failover) a server or worker that fails is restarted instead, up to N times each, with the
same endpoint, environment and secret plus ``TORCHELASTIC_RESTART_COUNT``: a server loads its
latest snapshot (:mod:`fleetx.ps.snapshots`; ``FLEETX_PS_CHECKPOINT_DIR`` / ``_INTERVAL`` /
``FLEETX_PS_JOB_ID``), a worker runs the script from the top and rejoins the servers, which
kept its rank for it (:mod:`fleetx.ps.roster`).
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Collection, Optional

from fleetx import env
from fleetx.launch import banner, hosts, logs, script, summary
from fleetx.launch.api import EXIT_FAILED, EXIT_OK, ConfigError, LaunchError
from fleetx.launch.config import LaunchConfig

__all__ = ["PSProcess", "PSPlan", "plan", "run", "launch", "dry_run", "WORKER_BASE_PORT"]

#: Paddle's port for workers given as bare IPs: 6170 + number of servers + worker index.
WORKER_BASE_PORT = 6170
#: how each role is named in messages (``heter`` is also the prefix of its log, heterlog.N)
_ROLE_NAMES = {"server": "server", "worker": "worker", "heter": "heter worker"}
_TAIL_LINES = 20
_GRACE_SECONDS = 10  # between SIGTERM and SIGKILL when fleetrun stops processes
_LINGER_SECONDS = 5  # a single-node server still running this long after the last worker
_POLL_SECONDS = 0.1
#: the servers' snapshots under failover (--max_restarts), inside the log folder by default
SNAPSHOT_DIR = "ps_snapshots"
DEFAULT_CHECKPOINT_INTERVAL = 30.0


@dataclass(frozen=True)
class PSProcess:
    """One process this node starts.

    Attributes:
        role: ``"server"``, ``"worker"`` or ``"heter"`` (a heter worker).
        index: its index among the processes of its role.
        endpoint: ``ip:port`` (servers listen on it; worker 0's hosts ``fleet.util``'s store).
        env: the contract variables it gets.
    """

    role: str
    index: int
    endpoint: str
    env: dict = field(default_factory=dict, compare=False)

    @property
    def label(self) -> str:
        """``server 0``, ``worker 1``, ``heter worker 0``."""
        return f"{_ROLE_NAMES[self.role]} {self.index}"

    @property
    def name(self) -> str:
        return f"{self.label} ({self.endpoint})"

    def log_path(self, log_dir: str) -> str:
        return os.path.join(log_dir, f"{self.role}log.{self.index}")


@dataclass(frozen=True)
class PSPlan:
    """Everything :func:`run` needs; ``describe()`` says it in words."""

    servers: tuple[str, ...]
    workers: tuple[str, ...]
    local: tuple[PSProcess, ...]
    log_dir: str
    script: str
    script_args: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    launcher_pid: int = 0
    secret: Optional[str] = field(default=None, repr=False, compare=False)  # generated here
    module: bool = False  # the script is a module name (fleetrun -m)
    shown: object = (0,)  # workers whose output fleetrun shows ("all" or indices)
    heters: tuple[str, ...] = ()  # every heter worker's endpoint
    max_restarts: int = 0  # failover: restarts of each server before the job fails

    def shown_here(self) -> list["PSProcess"]:
        """This node's workers whose output fleetrun copies to its stdout."""
        return [proc for proc in self.local if proc.role == "worker"
                and (self.shown == "all" or proc.index in self.shown)]

    @property
    def single_node(self) -> bool:
        """True when this node starts every process of the job."""
        return len(self.local) == len(self.servers) + len(self.workers) + len(self.heters)

    def describe(self) -> str:
        mine = ", ".join(p.label for p in self.local)
        heters = (f", {len(self.heters)} heter worker(s) {','.join(self.heters)}"
                  if self.heters else "")
        lines = [f"Run parameter-server mode: {len(self.servers)} server(s) "
                 f"{','.join(self.servers)}, {len(self.workers)} worker(s){heters}; this node "
                 f"starts {mine}. launch train in CPU mode"]
        if self.heters:
            lines.append(f"Please check servers, workers and heter_worker logs in "
                         f"{self.log_dir}/workerlog.*, {self.log_dir}/serverlog.* and "
                         f"{self.log_dir}/heterlog.*")
        else:
            lines.append(f"Please check servers and workers logs in {self.log_dir}/workerlog.* "
                         f"and {self.log_dir}/serverlog.*")
        return "\n".join(lines + [f"fleetrun: {note}" for note in self.notes])

    def processes(self) -> str:
        """One line per process this node starts: its name and its log (``--dry-run``)."""
        return "\n".join(f"  {p.name}: {p.log_path(self.log_dir)}" for p in self.local)


# -- planning ----------------------------------------------------------------------------------
def _refuse_collective_flags(config: LaunchConfig) -> None:
    given = {"--nproc_per_node": config.nproc_per_node, "--gpus": config.gpus,
             "--nnodes": config.nnodes, "--master": config.master,
             "--ips": config.ips if config.ips != ("127.0.0.1",) else None}
    for flag, value in given.items():
        if value is not None:
            raise ConfigError(flag, "is a collective flag; a parameter-server job takes "
                                    "--server_num / --worker_num or --servers / --workers")
    for flag, value in (("--checkpoint_dir", config.checkpoint_dir),
                        ("--checkpoint_interval", config.checkpoint_interval)):
        if value is not None and not config.max_restarts:
            raise ConfigError(flag, "sets the servers' snapshots, which exist for failover: "
                                    "give --max_restarts N as well")


def _failover_env(config: LaunchConfig, log_dir: str, job_id: str) -> dict:
    """What every process of a job with ``--max_restarts`` gets: the snapshots' folder and
    interval, and the job's id (a restarted server loads only this job's snapshots)."""
    if not config.max_restarts:
        return {}
    folder = config.checkpoint_dir or os.path.join(log_dir, SNAPSHOT_DIR)
    interval = config.checkpoint_interval or DEFAULT_CHECKPOINT_INTERVAL
    return {"FLEETX_PS_CHECKPOINT_DIR": os.path.abspath(folder),
            "FLEETX_PS_CHECKPOINT_INTERVAL": f"{interval:g}", "FLEETX_PS_JOB_ID": job_id}


def _endpoints(listed: Optional[tuple], count: Optional[int], what: str, bare_port: int,
               free: Callable[[int], list[int]]) -> tuple[str, ...]:
    flag_list, flag_num = f"--{what}s", f"--{what}_num"
    if listed:
        if count is not None and count != len(listed):
            raise ConfigError(flag_num, f"is {count} but {flag_list} lists {len(listed)} "
                                        f"endpoint(s)")
        out = []
        for i, item in enumerate(listed):
            if ":" not in item:
                if what != "worker":
                    raise ConfigError(flag_list, f"{item} has no port (expected ip:port)")
                item = f"{item}:{bare_port + i}"
            out.append(item)
        return tuple(out)
    if count is None:
        raise ConfigError(flag_num, f"a parameter-server job needs {flag_num} or {flag_list}")
    return tuple(f"127.0.0.1:{p}" for p in free(count))


_TRAINING_ROLES = {"server": "PSERVER", "worker": "TRAINER", "heter": "HETER_TRAINER"}


def _process_env(role: str, index: int, endpoint: str, servers: tuple, workers: tuple,
                 log_dir: str, omp: Optional[int], heters: tuple = ()) -> dict:
    ip, _, port = endpoint.rpartition(":")
    values = {"TRAINING_ROLE": _TRAINING_ROLES[role],
              "PADDLE_PSERVERS_IP_PORT_LIST": ",".join(servers),
              "PADDLE_TRAINER_ENDPOINTS": ",".join(workers),
              "PADDLE_TRAINERS_NUM": str(len(workers)),
              "POD_IP": ip, "PADDLE_PORT": port, "FLEETX_LOG_DIR": log_dir}
    if heters:  # both names: Paddle 2.2's and 2.0's
        values["PADDLE_ALL_HETER_TRAINER_IP_PORT_LIST"] = ",".join(heters)
        values["PADDLE_HETER_TRAINER_IP_PORT_LIST"] = ",".join(heters)
    if role == "worker":
        values["PADDLE_TRAINER_ID"] = str(index)
    if omp:
        values["OMP_NUM_THREADS"] = str(omp)
    return values


def _secret(config: LaunchConfig, single_node: bool, user_secret: bool,
            make_secret: Callable[[], str]) -> tuple[dict, Optional[str]]:
    """(variables every process gets, a secret generated for this job or None)."""
    if config.ps_secret_file:
        if user_secret:
            raise ConfigError("--ps_secret_file", "FLEETX_PS_SECRET or FLEETX_PS_SECRET_FILE is "
                                                  "set as well; give the secret one way")
        return {"FLEETX_PS_SECRET_FILE": os.path.abspath(config.ps_secret_file)}, None
    if user_secret:
        return {}, None  # the processes inherit it
    if not single_node:
        raise ConfigError("--ps_secret_file", "a job on several nodes needs the same secret on "
                                              "every node: give every node's fleetrun the same "
                                              "--ps_secret_file FILE (or set FLEETX_PS_SECRET)")
    return {}, make_secret()


def plan(config: LaunchConfig, *, is_local: Callable[[str], bool] = hosts.is_local_address,
         free_ports: Callable[[int], list[int]] = hosts.free_ports,
         user_omp: Optional[str] = None, launcher_pid: int = 0, user_secret: bool = False,
         make_secret: Callable[[], str] = lambda: secrets.token_hex(32),
         user_ifnames: Collection[str] = (),
         interface_of: Callable[[str], Optional[str]] = hosts.interface_of) -> PSPlan:
    """Decide which processes this node starts for ``config``, and their environment.

    Args:
        config: the launch configuration (parameter-server mode).
        is_local: tells whether an address belongs to this host.
        free_ports: returns that many free ports (``--server_num`` / ``--worker_num`` alone).
        user_omp: the user's ``OMP_NUM_THREADS``, or None when unset.
        launcher_pid: the pid the processes must have as parent (0: do not check).
        user_secret: the user's environment already sets ``FLEETX_PS_SECRET`` or
            ``FLEETX_PS_SECRET_FILE``.
        make_secret: makes a single-node job's secret when none is given (256 random bits).
        user_ifnames: which of ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` the user set
            (a job on several nodes sets the others to the interface of each process's address).
        interface_of: the network interface that holds an address, or None.

    Raises:
        ConfigError: the flags cannot describe a job, none of it runs on this node, or a job
            on several nodes has no shared secret.
    """
    _refuse_collective_flags(config)
    servers = _endpoints(config.servers, config.server_num, "server", 0, free_ports)
    workers = _endpoints(config.workers, config.worker_num, "worker",
                         WORKER_BASE_PORT + len(servers), free_ports)
    heters = _endpoints(config.heter_workers, config.heter_worker_num, "heter_worker", 0,
                        free_ports) if config.heter_workers or config.heter_worker_num else ()
    every = servers + workers + heters
    repeated = sorted({e for e in every if every.count(e) > 1})
    if repeated:
        raise ConfigError("--servers", f"{', '.join(repeated)} listed more than once among "
                                       f"servers, workers and heter workers")
    mine = [(role, i, ep) for role, eps in (("server", servers), ("worker", workers),
                                            ("heter", heters))
            for i, ep in enumerate(eps) if is_local(ep.rpartition(":")[0].strip("[]"))]
    if not mine:
        raise ConfigError("--servers", f"none of the servers ({','.join(servers)}) or workers "
                                       f"({','.join(workers + heters)}) is an address of this "
                                       f"host")
    notes, omp = [], None
    if len(mine) > 1 and user_omp is None:
        omp = 1
        notes.append(f"setting OMP_NUM_THREADS=1 for each process ({len(mine)} processes share "
                     f"this node); set OMP_NUM_THREADS yourself to change it")
    log_dir = os.path.abspath(config.log_dir)
    shared, secret = _secret(config, len(mine) == len(every), user_secret, make_secret)
    addr = {ep: ep.rpartition(":")[0].strip("[]") for _, _, ep in mine}
    ifnames, ifname_notes = ({}, []) if len(mine) == len(every) else hosts.socket_ifnames(
        list(addr.values()), user_ifnames, interface_of)  # as a collective job's, several nodes
    # the job's id only tells its snapshots from another job's: not a secret, not the secret's
    shared = {**shared, **_failover_env(config, log_dir, secrets.token_hex(8))}
    if config.max_restarts:
        notes.append(f"failover: each server snapshots its shard every "
                     f"{float(shared['FLEETX_PS_CHECKPOINT_INTERVAL']):g} s into "
                     f"{shared['FLEETX_PS_CHECKPOINT_DIR']}; a server that fails is restarted "
                     f"from its latest snapshot, a worker that fails rejoins, each up to "
                     f"{config.max_restarts} time(s)")
    local = tuple(PSProcess(role, i, ep, {**_process_env(role, i, ep, servers, workers, log_dir,
                                                         omp, heters), **shared,
                                          **ifnames.get(addr[ep], {})})
                  for role, i, ep in mine)
    return PSPlan(servers, workers, local, log_dir, config.training_script,
                  tuple(config.training_script_args), tuple(notes + ifname_notes), launcher_pid,
                  secret, config.module, config.shown_ranks(), heters, config.max_restarts)


# -- running -----------------------------------------------------------------------------------
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
                              f"free it or give that {_ROLE_NAMES[proc.role]} another port in "
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
