"""Collective jobs: decide a :class:`CollectivePlan` (pure), then run it on the torch elastic
agent, which starts, watches and stops the processes.

Decisions, in :func:`plan`:

* devices: ``--gpus`` (one process each; ``CUDA_VISIBLE_DEVICES`` is set to them, so each
  process's device index is its local rank), else every visible GPU when there are enough for
  the processes, else CPU; ``--backend auto`` becomes nccl with devices, gloo without;
* nodes: ``--nnodes N`` (default: the number of ``--ips``) is a static rendezvous where this
  node's rank is its position in ``--ips``; ``--nnodes MIN:MAX`` is an elastic c10d rendezvous
  where the agents number the nodes themselves;
* the store: ``--master`` or the first of ``--ips`` on a free port (one node) or port 6070;
* endpoints: every rank gets an ``ip:port``; ports are free ports on one node, the master port
  + 1 + local rank on several nodes (every node must agree without talking), free ports in an
  elastic job (gathered through the store at start);
* ``OMP_NUM_THREADS=1`` when several processes share the node and the user did not set it;
* in a multi-node job, ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``, unless the user set them:
  the interface that holds this node's address (gloo and NCCL otherwise bind to the address the
  host name resolves to, which is often a loopback one such as Debian's 127.0.1.1).

Running, in :func:`run`: the nodes meet in fleetrun's own rendezvous (``rendezvous.py``: the
store listens on the rendezvous address only, the wait is reported every few seconds and ends
at ``FLEETX_TIMEOUT`` naming the missing nodes); the agent (``agent.py``) starts the workers in
``bootstrap.py`` and announces each restart; rank 0's log is copied to fleetrun's stdout while
the job runs; when a process fails the agent stops the others and fleetrun reports the rank,
its exit code and the end of its log.
"""
from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass
from typing import Callable, Collection, NoReturn, Optional

from fleetx import env
from fleetx.launch import bootstrap, hosts, logs, script
from fleetx.launch.api import EXIT_FAILED, EXIT_OK, ConfigError, LaunchError, NodeSetup
from fleetx.launch.config import LaunchConfig

__all__ = ["CollectivePlan", "plan", "run", "launch", "DEFAULT_MASTER_PORT"]

DEFAULT_MASTER_PORT = 6070
_RUN_ID = "fleetx"
_TAIL_LINES = 20
# When fleetrun is stopped by a signal: seconds the workers get between that signal and SIGKILL.
# (After a worker failure the agent stops the others with its own 30 s grace.)
_GRACE_SECONDS = 10
_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
#: What a dry run leaves unset: there is no store, and no peer would come to it.
DRY_RUN_UNSET = ("MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class CollectivePlan:
    """Everything :func:`run` needs, decided up front; ``describe()`` says it in words.

    Attributes:
        nproc: processes on this node.
        min_nodes, max_nodes: the node range (equal unless elastic).
        node_rank: this node's rank, or None when the elastic rendezvous assigns it.
        master_addr, master_port: the rendezvous store.
        max_restarts: worker-group restarts before giving up.
        setup: what every process of this node receives.
        script, script_args: the training script and its arguments.
        notes: one-line remarks for the user (defaults fleetrun chose).
        timeout: seconds the node-level rendezvous waits for the other nodes
            (``FLEETX_TIMEOUT``).
        shown: the global ranks whose output fleetrun copies to its stdout, or ``"all"``.
    """

    nproc: int
    min_nodes: int
    max_nodes: int
    node_rank: Optional[int]
    master_addr: str
    master_port: int
    max_restarts: int
    setup: NodeSetup
    script: str
    script_args: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    timeout: float = 300.0
    shown: object = (0,)

    @property
    def elastic(self) -> bool:
        return self.min_nodes < self.max_nodes

    def shown_here(self) -> list[int]:
        """The shown ranks this node may run: its own in a static job; in an elastic one, whose
        ranks are assigned at the rendezvous, any of the job's."""
        if self.elastic:
            ranks = range(self.nproc * self.max_nodes)
        else:
            ranks = range(self.node_rank * self.nproc, (self.node_rank + 1) * self.nproc)
        return [r for r in ranks if self.shown == "all" or r in self.shown]

    def describe(self) -> str:
        where = (f"elastic, {self.min_nodes}..{self.max_nodes} nodes" if self.elastic
                 else f"node {self.node_rank} of {self.max_nodes}")
        device = f"GPU mode, devices {self.setup.visible_devices or ','.join(self.setup.devices)}" \
            if self.setup.devices else "CPU mode"
        lines = [f"Run collective mode: {where}, {self.nproc} process(es) per node, backend "
                 f"{self.setup.backend}, rendezvous at {self.master_addr}:{self.master_port}. "
                 f"launch train in {device}"]
        return "\n".join(lines + [f"fleetrun: {note}" for note in self.notes])


def _cuda_count() -> int:
    import torch  # the launcher needs torch anyway; planning needs it only here
    return torch.cuda.device_count()


def _devices(config: LaunchConfig, cuda_count: int, visible: Optional[list[str]]
             ) -> tuple[int, tuple[str, ...], Optional[str], list[str]]:
    """(processes, device index per process, CUDA_VISIBLE_DEVICES or None, notes)."""
    if config.gpus:
        if visible is not None:
            missing = [g for g in config.gpus if g not in visible]
            if missing:
                raise ConfigError("--gpus", f"{','.join(missing)} not in CUDA_VISIBLE_DEVICES="
                                            f"{','.join(visible)}")
        elif cuda_count == 0:
            raise ConfigError("--gpus", "no CUDA device is visible on this node")
        else:
            _check_gpu_ids(config.gpus, cuda_count)
        count = len(config.gpus)
        return count, tuple(str(i) for i in range(count)), ",".join(config.gpus), []
    nproc = config.nproc_per_node or cuda_count or 1
    if 0 < cuda_count < nproc:
        return nproc, (), None, [f"{nproc} processes but {cuda_count} visible GPU(s): the "
                                 f"processes run on CPU"]
    return nproc, tuple(str(i) for i in range(nproc)) if cuda_count else (), None, []


def _check_gpu_ids(gpus: tuple[str, ...], cuda_count: int) -> None:
    """Numeric ids must name a device of this node; other ids (``GPU-<uuid>``, ``MIG-...``) are
    left to CUDA, as ``CUDA_VISIBLE_DEVICES`` would be."""
    bad = []
    for gpu in gpus:
        try:
            if not 0 <= int(gpu) < cuda_count:
                bad.append(gpu)
        except ValueError:  # not a number
            continue
    if bad:
        raise ConfigError("--gpus", f"{','.join(bad)}: no such GPU; this node has {cuda_count} "
                                    f"CUDA device(s), ids 0..{cuda_count - 1}")


def _backend(config: LaunchConfig, devices: tuple[str, ...], nproc: int, cuda_count: int) -> str:
    if config.backend == "auto":
        return "nccl" if devices else "gloo"
    if config.backend == "nccl" and not devices:
        raise ConfigError("--backend", f"nccl needs one GPU per process; this node has "
                                       f"{cuda_count} visible GPU(s) for {nproc} process(es)")
    return config.backend


def _master(config: LaunchConfig, single_node: bool, free: list[int]) -> tuple[str, int]:
    if config.master:
        addr, _, port = config.master.rpartition(":")
        return addr.strip("[]"), int(port)
    return config.ips[0], free[0] if single_node else DEFAULT_MASTER_PORT


def _own_address(config: LaunchConfig, master_addr: str, is_local: Callable[[str], bool]) -> str:
    """This node's address in an elastic job: --host, else the local one of --ips, else the
    address that routes to the master."""
    if config.host:
        return config.host
    mine = [ip for ip in config.ips if ip != "127.0.0.1" and is_local(ip)]
    return mine[0] if len(mine) == 1 else hosts.route_address(master_addr)


def _socket_ifnames(own_addr: str, user_set: Collection[str],
                    interface_of: Callable[[str], Optional[str]]
                    ) -> tuple[Optional[str], Optional[str], list[str]]:
    """(GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME, notes) for the processes of a multi-node job:
    the interface that holds this node's address, for each variable the user did not set."""
    wanted = [name for name in _IFNAME_VARS if name not in user_set]
    ifname = interface_of(own_addr) if wanted else None
    if not ifname:
        return None, None, []
    note = (f"setting {' and '.join(f'{name}={ifname}' for name in wanted)} for each process "
            f"(the interface of {own_addr}, this node's address); set "
            f"{'it' if len(wanted) == 1 else 'them'} yourself to change it")
    gloo, nccl = (ifname if name in wanted else None for name in _IFNAME_VARS)
    return gloo, nccl, [note]


def plan(config: LaunchConfig, *, cuda_count: Optional[int] = None,
         visible: Optional[list[str]] = None, user_omp: Optional[str] = None,
         user_ifnames: Collection[str] = (),
         is_local: Callable[[str], bool] = hosts.is_local_address,
         free_ports: Callable[[int], list[int]] = hosts.free_ports,
         interface_of: Callable[[str], Optional[str]] = hosts.interface_of,
         launcher_pid: int = 0, timeout: float = 300.0) -> CollectivePlan:
    """Decide how this node runs ``config``; the probes are parameters so tests can fake them.

    Args:
        config: the launch configuration.
        cuda_count: visible CUDA devices (probed with torch when None).
        visible: ``CUDA_VISIBLE_DEVICES`` as a list, or None when unset.
        user_omp: the user's ``OMP_NUM_THREADS``, or None when unset.
        user_ifnames: which of ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` the user set.
        is_local: tells whether an address belongs to this host.
        free_ports: returns that many free ports.
        interface_of: the network interface that holds an address, or None.
        launcher_pid: the pid the processes must have as parent (0: do not check).
        timeout: seconds the rendezvous waits for the other nodes (``FLEETX_TIMEOUT``).

    Raises:
        ConfigError: the flags cannot be served on this node (the message names the flag).
    """
    cuda_count = _cuda_count() if cuda_count is None else cuda_count
    nproc, devices, visible_devices, notes = _devices(config, cuda_count, visible)
    backend = _backend(config, devices, nproc, cuda_count)
    low, high = config.node_range()
    single_node = high == 1
    # One free port for the store (used when --master is not given), one per process.
    free = free_ports(nproc + 1) if single_node or config.is_elastic else []
    master_addr, master_port = _master(config, single_node, free)
    if config.is_elastic:
        node_rank, node_addrs = None, ()
        own_addr, ports = _own_address(config, master_addr, is_local), tuple(free[1:])
    else:
        node_rank, node_addrs = hosts.node_rank(config.ips, config.host, is_local), config.ips
        own_addr = node_addrs[node_rank]
        # Every node must compute the same ports without talking to the others.
        ports = tuple(free[1:]) if single_node else tuple(
            master_port + 1 + i for i in range(nproc))
    omp = 1 if nproc > 1 and user_omp is None else None
    if omp:
        notes.append(f"setting OMP_NUM_THREADS=1 for each process ({nproc} processes share this "
                     f"node); set OMP_NUM_THREADS yourself to change it")
    gloo_ifname, nccl_ifname, ifname_notes = (None, None, []) if single_node else \
        _socket_ifnames(own_addr, user_ifnames, interface_of)
    setup = NodeSetup(log_dir=os.path.abspath(config.log_dir), backend=backend,
                      node_addrs=tuple(node_addrs), own_addr=own_addr, ports=ports,
                      devices=devices, visible_devices=visible_devices, omp_threads=omp,
                      gloo_ifname=gloo_ifname, nccl_ifname=nccl_ifname,
                      launcher_pid=launcher_pid, module=config.module)
    return CollectivePlan(nproc, low, high, node_rank, master_addr, master_port,
                          config.max_restarts, setup, config.training_script,
                          tuple(config.training_script_args), tuple(notes + ifname_notes),
                          float(timeout), config.shown_ranks())


# -- running ------------------------------------------------------------------------------------
def _rendezvous(p: CollectivePlan):
    """The node-level rendezvous handler; node 0 of a static job (or the node at --master of an
    elastic one) binds the store's socket here, before anything starts."""
    from fleetx.launch import rendezvous

    if p.elastic:
        return rendezvous.elastic_handler(p.master_addr, p.master_port, p.min_nodes,
                                          p.max_nodes, p.setup.own_addr, p.timeout, _RUN_ID)
    return rendezvous.StaticRendezvous(p.node_rank, p.setup.node_addrs, p.master_addr,
                                       p.master_port, p.timeout, _RUN_ID)


def _tail(p: CollectivePlan, rank: int, header: str) -> list[str]:
    path = logs.worker_log(p.setup.log_dir, rank)
    if rank in p.shown_here():  # copied to stdout as it grew: not twice
        return logs.shown_above(header, path)
    lines = [f"{header}; last {_TAIL_LINES} lines of {path}:"]
    return lines + ([f"    {line}" for line in logs.last_lines(path, _TAIL_LINES)]
                    or ["    (empty)"])


def _blames(p: CollectivePlan, failures: dict, failed: list) -> tuple[list, list[str]]:
    """(ranks at fault, what the failed ranks said about them), from the reports a rank whose
    collective failed leaves in the log folder (see fleetx.comm.api)."""
    from fleetx.comm.api import read_fault  # a small module: no torch

    culprits, reporters = [], {}
    for rank in failed:
        blame = read_fault(p.setup.log_dir, rank, failures[rank].pid)
        if blame is not None:
            culprits += [r for r in blame.ranks if r not in culprits]
            reporters.setdefault(blame.message, []).append(rank)
    said = [f"{message} (reported by rank{'s' if len(ranks) > 1 else ''} "
            f"{', '.join(map(str, ranks))})" for message, ranks in reporters.items()]
    return sorted(culprits), said


def _report_failure(p: CollectivePlan, failures: dict) -> None:
    """Name the failed ranks with exit code and log tail. Ranks that only died of the SIGTERM
    the agent sent to stop the job are listed as stopped, not as failures; but when a failed
    rank reported that its collective failed because of another rank (one that never arrived),
    that rank is named first, as the one at fault."""
    stopped = {r for r, f in failures.items() if f.exitcode == -signal.SIGTERM}
    failed = sorted(set(failures) - stopped) or sorted(failures)
    culprits, said = _blames(p, failures, failed)
    total = "" if p.elastic else f" {p.nproc * p.max_nodes}"
    if culprits:
        lines = [f"ABORT!!! Out of all{total} trainers, the trainer process with rank="
                 f"{culprits} was at fault: {'; '.join(said)}. Please check its log."]
    else:
        lines = [f"ABORT!!! Out of all{total} trainers, the trainer process with rank={failed} "
                 f"was aborted. Please check its log."]
    for rank in failed:
        failure = failures[rank]
        code = failure.exitcode
        how = logs.describe_exit(code)
        lines += _tail(p, rank, f"rank {rank} (local rank {failure.local_rank}, pid "
                                f"{failure.pid}) {how}")
    for rank in (r for r in culprits if r not in failed):
        where = (f" (local rank {failures[rank].local_rank}, pid {failures[rank].pid})"
                 if rank in failures else "")
        lines += _tail(p, rank, f"rank {rank}{where} was at fault and was stopped")
    others = sorted(stopped - set(failed) - set(culprits))
    if others:
        lines.append(f"stopped the other process(es): rank={others}")
    print("\n".join(lines), file=sys.stderr, flush=True)


def run(p: CollectivePlan) -> int:
    """Run the plan on the torch elastic agent; the exit code fleetrun should return.

    Raises:
        LaunchError: the log folder cannot be written, the store cannot be served, or the other
            nodes did not come within ``p.timeout`` (the message names them).
    """
    from torch.distributed.elastic.multiprocessing import SignalException

    from fleetx.launch import agent

    logs.prepare_dir(p.setup.log_dir)
    if p.max_nodes == 1 or p.node_rank == 0:
        # Before the rendezvous: no process of the job, on any node, has started yet.
        for note in logs.archive_earlier(p.setup.log_dir):
            print(f"fleetrun: {note}", flush=True)
    handler = _rendezvous(p)
    followers = []
    args = ("-u", "-m", "fleetx.launch.bootstrap", p.setup.to_json(), p.script, *p.script_args)
    result, stopped_by = None, None
    try:
        shown = p.shown_here()
        for rank in shown:
            followers.append(logs.LogFollower(
                logs.worker_log(p.setup.log_dir, rank), sys.stdout.buffer,
                prefix=f"[rank {rank}] " if len(shown) > 1 else None).start())
        result = agent.run_agent(
            handler, p.nproc, sys.executable, args, max_restarts=p.max_restarts,
            local_addr=p.setup.own_addr, log_dir=p.setup.log_dir,
            log_of=lambda rank: logs.worker_log(p.setup.log_dir, rank),
            grace_seconds=_GRACE_SECONDS)
    except SignalException as exc:
        stopped_by = signal.Signals(exc.sigval)
    finally:
        for follower in followers:
            follower.stop()
    if result is not None and result.is_failed():
        _report_failure(p, result.failures)
        return EXIT_FAILED
    if stopped_by:
        print(f"fleetrun: received {stopped_by.name}, stopped all processes", file=sys.stderr,
              flush=True)
        return 128 + stopped_by
    print("Local processes completed.", flush=True)
    return EXIT_OK


def dry_run_env(p: CollectivePlan) -> dict[str, str]:
    """The variables of rank 0 of the planned world, plus the dry-run switch.

    No store is served in a dry run, so ``MASTER_ADDR`` and ``MASTER_PORT`` are not among them
    (:data:`DRY_RUN_UNSET`): a script that calls ``torch.distributed.init_process_group`` itself
    fails there at once, instead of waiting as rank 0 for peers that never start.
    """
    world = p.nproc * p.min_nodes
    endpoints = bootstrap.static_endpoints(p.setup) if p.setup.node_addrs else None
    values = bootstrap.process_env(p.setup, 0, 0, world, endpoints)
    values.update(RANK="0", WORLD_SIZE=str(world), LOCAL_RANK="0",
                  LOCAL_WORLD_SIZE=str(p.nproc), GROUP_RANK="0", FLEETX_DRY_RUN="1")
    return values


def _plan_here(config: LaunchConfig, **probes) -> CollectivePlan:
    """:func:`plan` with what the environment says (the user's variables); ``probes`` go on."""
    problem = script.entrypoint_problem(config.training_script, config.module)
    if problem:
        raise ConfigError("training_script", problem)
    visible = env.get_list("CUDA_VISIBLE_DEVICES") if env.is_set("CUDA_VISIBLE_DEVICES") else None
    return plan(config, visible=visible, user_omp=env.get("OMP_NUM_THREADS"),
                user_ifnames=[name for name in _IFNAME_VARS if env.is_set(name)],
                timeout=_timeout(), **probes)


def _timeout() -> float:
    """``FLEETX_TIMEOUT`` (300 s when unset).

    Raises:
        LaunchError: it is not a whole number of seconds above 0.
    """
    from fleetx.comm.groups import default_timeout

    try:
        return default_timeout()
    except env.EnvError as exc:
        raise LaunchError(str(exc)) from None


def dry_run(config: LaunchConfig) -> NoReturn:
    """Run the script once as rank 0 of the requested world with no peers (``--dry-run``).

    The fleet prints the plan at ``distributed_optimizer`` and exits 0 before communicating. The
    script replaces fleetrun in its process (``execve``), so its exit code is fleetrun's and
    nothing is left behind when fleetrun is killed.

    Raises:
        ConfigError: the script does not exist, or the flags cannot be served on this node.
    """
    # Plan as the first node, wherever the dry run happens (a laptop is not in --ips).
    p = _plan_here(config, is_local=lambda addr: addr == config.ips[0])
    child = dict(env.environ)
    for name in DRY_RUN_UNSET:  # the user's own would lead torch to a store nobody serves
        child.pop(name, None)
    env.apply(dry_run_env(p), child)
    print(f"fleetrun --dry-run: running {config.training_script} as rank 0 of "
          f"{p.nproc * p.min_nodes} process(es), without peers; {' and '.join(DRY_RUN_UNSET)} "
          f"are unset, so a script that calls torch.distributed.init_process_group itself stops "
          f"there with an error", flush=True)
    sys.stderr.flush()  # anything still buffered would vanish with this process image
    module = ["-m"] if config.module else []
    os.execve(sys.executable, [sys.executable, "-u", *module, p.script, *p.script_args], child)


def launch(config: LaunchConfig) -> int:
    """Plan and run a collective job for ``config``; returns fleetrun's exit code.

    Raises:
        ConfigError: the script does not exist, or the flags cannot be served on this node.
    """
    p = _plan_here(config, launcher_pid=os.getpid())
    print(p.describe(), flush=True)
    return run(p)
