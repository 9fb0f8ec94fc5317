"""The decisions of a collective job, made up front and pure: :func:`plan` turns a
:class:`LaunchConfig` and what this node has (probed, or given by tests) into a
:class:`CollectivePlan`, which ``collective.py`` then runs.

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
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Collection, Optional

from fleetx import env
from fleetx.launch import hosts
from fleetx.launch.api import ConfigError, NodeSetup
from fleetx.launch.config import LaunchConfig

__all__ = ["CollectivePlan", "plan", "DEFAULT_MASTER_PORT"]

DEFAULT_MASTER_PORT = 6070
#: seconds the rendezvous waits for the other nodes unless told otherwise (``FLEETX_TIMEOUT``)
_TIMEOUT = float(env.default("FLEETX_TIMEOUT"))


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
        fault_tolerance: ``restart`` (the elastic agent restarts the group) or ``heal``
            (``heal.py``: the dead rank alone).
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
    timeout: float = _TIMEOUT
    shown: object = (0,)
    fault_tolerance: str = "restart"

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
    found, notes = hosts.socket_ifnames([own_addr], user_set, interface_of,
                                        where="(the interface of {address}, this node's address)")
    ifnames = found.get(own_addr, {})
    gloo, nccl = (ifnames.get(name) for name in hosts.SOCKET_IFNAME_VARS)
    return gloo, nccl, notes


def plan(config: LaunchConfig, *, cuda_count: Optional[int] = None,
         visible: Optional[list[str]] = None, user_omp: Optional[str] = None,
         user_ifnames: Collection[str] = (),
         is_local: Callable[[str], bool] = hosts.is_local_address,
         free_ports: Callable[[int], list[int]] = hosts.free_ports,
         interface_of: Callable[[str], Optional[str]] = hosts.interface_of,
         launcher_pid: int = 0, timeout: float = _TIMEOUT) -> CollectivePlan:
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
                          float(timeout), config.shown_ranks(), config.fault_tolerance)
