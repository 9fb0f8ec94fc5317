"""The decisions of a parameter-server job, made up front and pure: :func:`plan` turns a
:class:`LaunchConfig` and what this node has (probed, or given by tests) into a
:class:`PSPlan`: the processes this node starts, each with its role, endpoint, environment and
log file, which ``ps.py`` then runs.

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
  opens a torch.distributed group among the workers then binds where the job's endpoints are);
* failover (``--max_restarts N``): every process gets the servers' snapshot folder and interval
  and the job's id (``FLEETX_PS_CHECKPOINT_DIR`` / ``_INTERVAL``, ``FLEETX_PS_JOB_ID``).
"""
from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field
from typing import Callable, Collection, Optional

from fleetx import env
from fleetx.launch import hosts
from fleetx.launch.api import ConfigError
from fleetx.launch.config import LaunchConfig

__all__ = ["PSProcess", "PSPlan", "plan", "WORKER_BASE_PORT", "SNAPSHOT_DIR",
           "DEFAULT_CHECKPOINT_INTERVAL"]

#: Paddle's port for workers given as bare IPs: 6170 + number of servers + worker index.
WORKER_BASE_PORT = 6170
#: how each role is named in messages (``heter`` is also the prefix of its log, heterlog.N)
_ROLE_NAMES = {"server": "server", "worker": "worker", "heter": "heter worker"}
#: the servers' snapshots under failover (--max_restarts), inside the log folder by default
SNAPSHOT_DIR = "ps_snapshots"
DEFAULT_CHECKPOINT_INTERVAL = env.default("FLEETX_PS_CHECKPOINT_INTERVAL")


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
    def role_name(self) -> str:
        """How the role is named in messages: ``server``, ``worker``, ``heter worker``."""
        return _ROLE_NAMES[self.role]

    @property
    def label(self) -> str:
        """``server 0``, ``worker 1``, ``heter worker 0``."""
        return f"{self.role_name} {self.index}"

    @property
    def name(self) -> str:
        return f"{self.label} ({self.endpoint})"

    def log_path(self, log_dir: str) -> str:
        return os.path.join(log_dir, f"{self.role}log.{self.index}")


@dataclass(frozen=True)
class PSPlan:
    """Everything ``ps.run`` needs, decided up front; ``describe()`` says it in words."""

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


def _job_endpoints(config: LaunchConfig, free: Callable[[int], list[int]]
                   ) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """(servers, workers, heter workers) of the whole job; no endpoint may appear twice."""
    servers = _endpoints(config.servers, config.server_num, "server", 0, free)
    workers = _endpoints(config.workers, config.worker_num, "worker",
                         WORKER_BASE_PORT + len(servers), free)
    heters = _endpoints(config.heter_workers, config.heter_worker_num, "heter_worker", 0,
                        free) if config.heter_workers or config.heter_worker_num else ()
    every = servers + workers + heters
    repeated = sorted({e for e in every if every.count(e) > 1})
    if repeated:
        raise ConfigError("--servers", f"{', '.join(repeated)} listed more than once among "
                                       f"servers, workers and heter workers")
    return servers, workers, heters


def _local_endpoints(servers: tuple, workers: tuple, heters: tuple,
                     is_local: Callable[[str], bool]) -> list[tuple[str, int, str]]:
    """``[(role, index, endpoint)]`` of the processes whose address is one of this host's."""
    mine = [(role, i, ep) for role, eps in (("server", servers), ("worker", workers),
                                            ("heter", heters))
            for i, ep in enumerate(eps) if is_local(ep.rpartition(":")[0].strip("[]"))]
    if not mine:
        raise ConfigError("--servers", f"none of the servers ({','.join(servers)}) or workers "
                                       f"({','.join(workers + heters)}) is an address of this "
                                       f"host")
    return mine


def plan(config: LaunchConfig, *, is_local: Callable[[str], bool] = hosts.is_local_address,
         free_ports: Callable[[int], list[int]] = hosts.free_ports,
         user_omp: Optional[str] = None, launcher_pid: int = 0, user_secret: bool = False,
         make_secret: Callable[[], str] = lambda: secrets.token_hex(32),
         user_ifnames: Collection[str] = (),
         interface_of: Callable[[str], Optional[str]] = hosts.interface_of,
         make_job_id: Callable[[], str] = lambda: secrets.token_hex(8)) -> PSPlan:
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
        make_job_id: makes the job's id under failover, which tells its snapshots from another
            job's (not a secret, and not derived from the secret).

    Raises:
        ConfigError: the flags cannot describe a job, none of it runs on this node, or a job
            on several nodes has no shared secret.
    """
    _refuse_collective_flags(config)
    servers, workers, heters = _job_endpoints(config, free_ports)
    every = servers + workers + heters
    mine = _local_endpoints(servers, workers, heters, is_local)
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
    shared = {**shared, **_failover_env(config, log_dir, make_job_id())}
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

