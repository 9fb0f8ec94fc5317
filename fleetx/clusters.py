"""Cluster launchers: who a process is when Slurm's ``srun`` or an MPI ``mpirun`` started it.

``srun`` and ``mpirun`` start every process of a job themselves and tell each one its rank in
variables of their own (``SLURM_PROCID``, ``OMPI_COMM_WORLD_RANK``, ``PMI_RANK``...). This module
turns them into a :class:`ClusterLaunch` (rank, world size, local rank, the rendezvous address) for
the role maker, and checks them: a rank outside the world or a malformed host list is an error
naming the variables and their values. It reads the environment only through :mod:`fleetx.env`.

Which launcher counts when several left variables (``docs/clusters.md``): an MPI launch
(``OMPI_*``, then ``PMI_*``) before Slurm's, because ``mpirun`` inside a Slurm allocation inherits
the allocation's ``SLURM_*`` (or sets them for its own daemons, one per node): then they describe
the allocation, not the ranks. When ``srun`` is itself the MPI launcher (``srun --mpi=pmi2``) both
agree anyway.

Example:
    >>> expand_hostlist("node[01-03,07],gpu5")
    ['node01', 'node02', 'node03', 'node07', 'gpu5']
    >>> detect({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_NODELIST": "localhost",
    ...         "MASTER_PORT": "29500"}).master
    ('localhost', 29500)
"""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import Mapping, Optional

from fleetx import env

__all__ = ["ClusterLaunch", "DEFAULT_MASTER_PORT", "detect", "expand_hostlist",
           "expand_tasks_per_node", "slurm_master_port"]

#: The rendezvous port when ``MASTER_PORT`` is unset and no Slurm job id is known (fleetrun's
#: default for jobs of several nodes).
DEFAULT_MASTER_PORT = 6070
# Under Slurm the default port follows the job id, so that two jobs sharing a node do not both
# try to serve their store on one port: 20000 + (id mod 10000) stays clear of the ephemeral
# range Linux hands out (32768 and up) and of the well-known ports.
_SLURM_PORT_BASE, _SLURM_PORT_SPAN = 20000, 10000


@dataclass(frozen=True)
class ClusterLaunch:
    """This process in a job started by a cluster launcher.

    Attributes:
        launcher: ``"Slurm"``, ``"Open MPI"`` or ``"MPICH"``.
        rank, world_size: this process in the job.
        local_rank: its rank on its node.
        local_world_size: processes on its node (None when the launcher does not say).
        master: ``(host, port)`` of the rendezvous store (rank 0 serves it); None only for a
            1-process job.
        names: the variables the rank, world size and local rank came from, for messages.
    """

    launcher: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: Optional[int]
    master: Optional[tuple]
    names: tuple

    def describe(self, what: str) -> str:
        """``"SLURM_PROCID=1"`` for ``what`` in ``rank``, ``world_size``, ``local_rank``."""
        index = ("rank", "world_size", "local_rank").index(what)
        return f"{self.names[index]}={getattr(self, what)}"


def expand_hostlist(text: str) -> list[str]:
    """Expand Slurm's compressed host list (``SLURM_NODELIST``) into host names, in order.

    Entries are separated by commas outside brackets; ``[...]`` holds numbers and ranges
    (``01-03``: zero-padded to the width of the first bound), and an entry may hold several
    bracket groups (``rack[1-2]-n[1-2]`` gives every combination, the last group varying fastest).

    Raises:
        fleetx.env.EnvError: an empty list, unbalanced brackets, or a bad range (the message
            quotes the list).

    Example:
        >>> expand_hostlist("a[1-2]b,c")
        ['a1b', 'a2b', 'c']
    """
    hosts: list[str] = []
    for entry in _split_top(text):
        parts = re.split(r"(\[[^\[\]]*\])", entry)
        if any(c in p for p in parts[::2] for c in "[]"):
            raise env.EnvError(f"host list {text!r}: unbalanced brackets in {entry!r}")
        choices = [[p] if i % 2 == 0 else _expand_brackets(p[1:-1], text)
                   for i, p in enumerate(parts)]
        hosts.extend("".join(c) for c in itertools.product(*choices))
    if not hosts:
        raise env.EnvError(f"host list {text!r} names no host")
    return hosts


def _split_top(text: str) -> list[str]:
    """Split at commas outside brackets."""
    entries, depth, start = [], 0, 0
    for i, c in enumerate(text):
        depth += {"[": 1, "]": -1}.get(c, 0)
        if depth < 0 or depth > 1:
            raise env.EnvError(f"host list {text!r}: unbalanced brackets")
        if c == "," and depth == 0:
            entries.append(text[start:i])
            start = i + 1
    if depth:
        raise env.EnvError(f"host list {text!r}: unbalanced brackets")
    entries.append(text[start:])
    return [e.strip() for e in entries if e.strip()]


def _expand_brackets(body: str, text: str) -> list[str]:
    out = []
    for item in body.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:-(\d+))?\s*", item)
        if not m:
            raise env.EnvError(f"host list {text!r}: [{body}] holds {item!r}, expected a number "
                               f"or a range such as 01-03")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise env.EnvError(f"host list {text!r}: range {item} runs backwards")
        out.extend(str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1))
    return out


def expand_tasks_per_node(text: str) -> list[int]:
    """Expand Slurm's tasks-per-node list (``SLURM_TASKS_PER_NODE``): ``"2(x3),1"`` is
    ``[2, 2, 2, 1]``, one count per node in node order.

    Raises:
        fleetx.env.EnvError: an entry that is neither ``N`` nor ``N(xK)``.
    """
    counts: list[int] = []
    for item in text.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if not m:
            raise env.EnvError(f"tasks per node {text!r}: {item!r} is neither N nor N(xK)")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts


def slurm_master_port(environ: Optional[Mapping[str, str]] = None) -> int:
    """``MASTER_PORT`` when set, else 20000 + (``SLURM_JOB_ID`` mod 10000), else 6070."""
    port = env.get_int("MASTER_PORT", env=environ)
    if port is not None:
        return _checked_port(port)
    job = env.get_int("SLURM_JOB_ID", env=environ)
    return DEFAULT_MASTER_PORT if job is None else _SLURM_PORT_BASE + job % _SLURM_PORT_SPAN


def _checked_port(port: int) -> int:
    if not 0 < port < 65536:
        raise env.EnvError(f"MASTER_PORT={port} is not a port (1-65535)")
    return port


def detect(environ: Optional[Mapping[str, str]] = None,
           with_master: bool = True) -> Optional[ClusterLaunch]:
    """The cluster launch this process belongs to: Open MPI's, MPICH's, then Slurm's variables
    (the first launcher whose rank and size are both set); None when there is none.

    Args:
        environ: the mapping to read (the process environment by default).
        with_master: find the rendezvous address too (False: ``master`` is None, and nothing
            about it is required; for checking a launch whose address comes from elsewhere).

    Raises:
        fleetx.env.EnvError: a malformed or inconsistent variable, or an MPI job of several
            processes without ``MASTER_ADDR``; the message names the variables.
    """
    if env.is_set("SLURM_HET_SIZE", env=environ):
        raise env.EnvError(
            f"SLURM_HET_SIZE={env.get('SLURM_HET_SIZE', env=environ)}: this is a heterogeneous "
            "Slurm job, whose components number their tasks apart; fleetx does not read them. "
            "Launch each component as a job of its own, or pass RANK, WORLD_SIZE, LOCAL_RANK, "
            "MASTER_ADDR and MASTER_PORT explicitly")
    for read in (_open_mpi, _srun_pmi, _mpich, _slurm):
        found = read(environ, with_master)
        if found is not None:
            return found
    return None


def _srun_pmi(e: Optional[Mapping[str, str]], with_master: bool) -> Optional[ClusterLaunch]:
    """``srun --mpi=pmi2`` (or ``MpiDefault=pmi2``) sets ``PMI_RANK`` / ``PMI_SIZE`` beside
    Slurm's own: when they describe the same tasks, srun is the launcher and Slurm's node list
    says where task 0 runs. (Hydra's mpirun inside an allocation numbers its ranks apart from
    the allocation's ``SLURM_PROCID``: MPICH's reader takes those.)"""
    names = ("PMI_RANK", "SLURM_PROCID"), ("PMI_SIZE", "SLURM_NTASKS")
    if not all(env.is_set(n, env=e) for pair in names for n in pair):
        return None
    if any(env.get(a, env=e) != env.get(b, env=e) for a, b in names):
        return None
    return _slurm(e, with_master)


def _launch(launcher: str, names: tuple, local_size_name: Optional[str], master_of,
            e: Optional[Mapping[str, str]], with_master: bool) -> Optional[ClusterLaunch]:
    """Read and check one launcher's rank / size / local rank / local size variables."""
    rank_name, world_name, local_name = names
    if not (env.is_set(rank_name, env=e) and env.is_set(world_name, env=e)):
        return None
    rank, world = env.get_int(rank_name, env=e), env.get_int(world_name, env=e)
    local = env.get_int(local_name, env=e)
    local_size = env.get_int(local_size_name, env=e) if local_size_name else None
    if world < 1:
        raise env.EnvError(f"{world_name}={world} must be >= 1")
    if not 0 <= rank < world:
        raise env.EnvError(f"{rank_name}={rank} is outside [0, {world}) given by "
                           f"{world_name}={world}")
    if local < 0 or (local_size is not None and local >= local_size):
        raise env.EnvError(f"{local_name}={local} is outside [0, {local_size}) given by "
                           f"{local_size_name}={local_size}")
    master = master_of(e) if world > 1 and with_master else None
    return ClusterLaunch(launcher, rank, world, local, local_size, master, names)


def _mpi_master(launcher: str, flag: str, sep: str):
    def master(e: Optional[Mapping[str, str]]) -> tuple:
        addr = env.get("MASTER_ADDR", env=e)
        if addr is None:
            raise env.EnvError(
                f"{launcher} started this process in a job of several, but MASTER_ADDR is not "
                f"set: MPI does not say where rank 0 runs. Pass the address of rank 0's host, "
                f"e.g. `mpirun {flag}MASTER_ADDR{sep}$(hostname) ...` (MASTER_PORT too, default "
                f"{DEFAULT_MASTER_PORT})")
        port = env.get_int("MASTER_PORT", env=e)  # MPI names no port: fleetx's own when unset
        return addr, _checked_port(DEFAULT_MASTER_PORT if port is None else port)
    return master


def _open_mpi(e: Optional[Mapping[str, str]], with_master: bool) -> Optional[ClusterLaunch]:
    return _launch("Open MPI", ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                                "OMPI_COMM_WORLD_LOCAL_RANK"), "OMPI_COMM_WORLD_LOCAL_SIZE",
                   _mpi_master("Open MPI's mpirun", "-x ", "="), e, with_master)


def _mpich(e: Optional[Mapping[str, str]], with_master: bool) -> Optional[ClusterLaunch]:
    # MPICH's and Intel MPI's Hydra launcher (mpiexec / mpirun).
    return _launch("MPICH", ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"), "MPI_LOCALNRANKS",
                   _mpi_master("MPICH's mpirun", "-genv ", " "), e, with_master)


def _slurm(e: Optional[Mapping[str, str]], with_master: bool) -> Optional[ClusterLaunch]:
    found = _launch("Slurm", ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
                    None, _slurm_master, e, with_master)
    if found is None:
        return None
    local_size = _slurm_local_size(e)
    if local_size is not None and found.local_rank >= local_size:
        raise env.EnvError(f"SLURM_LOCALID={found.local_rank} is outside [0, {local_size}) "
                           f"given by the tasks per node of this node")
    return ClusterLaunch("Slurm", found.rank, found.world_size, found.local_rank, local_size,
                         found.master, found.names)


def _slurm_master(e: Optional[Mapping[str, str]]) -> tuple:
    addr = env.get("MASTER_ADDR", env=e)
    if addr is None:
        # Task 0 runs on the first node of the step (block or cyclic distribution alike).
        for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
            if env.is_set(name, env=e):
                addr = expand_hostlist(env.get(name, env=e))[0]
                break
        else:
            raise env.EnvError("Slurm started this process in a job of several, but neither "
                               "SLURM_NODELIST (SLURM_STEP_NODELIST, SLURM_JOB_NODELIST) nor "
                               "MASTER_ADDR says where task 0 runs")
    return addr, slurm_master_port(e)


def _slurm_local_size(e: Optional[Mapping[str, str]]) -> Optional[int]:
    """Tasks on this node: this node's entry (``SLURM_NODEID``) of the step's tasks per node;
    else ``SLURM_NTASKS_PER_NODE`` (--ntasks-per-node, which a step inherits from its job);
    else this node's entry of the job's."""
    names = ["SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"]
    if not env.is_set(names[0], env=e):
        fixed = env.get_int("SLURM_NTASKS_PER_NODE", env=e)
        if fixed is not None:
            return fixed
    for name in names:
        if env.is_set(name, env=e):
            counts = expand_tasks_per_node(env.get(name, env=e))
            node = env.get_int("SLURM_NODEID", env=e)
            if not 0 <= node < len(counts):
                raise env.EnvError(f"SLURM_NODEID={node} is outside the {len(counts)} nodes of "
                                   f"{name}={env.get(name, env=e)}")
            return counts[node]
    return None
