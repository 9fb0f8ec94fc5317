"""The launcher's contract: run modes, errors and exit codes, and the per-node facts a controller
hands to every process it starts.

``cli.py`` turns the command line into a :class:`~fleetx.launch.config.LaunchConfig`;
``fleetx.launch.launch`` picks a controller by :class:`RunMode`; the collective controller
(``collective.py``) runs the torch elastic agent, whose workers start in ``bootstrap.py`` with a
:class:`NodeSetup`.

A controller is a module with ``launch(config: LaunchConfig) -> int``: it returns fleetrun's exit
code, or raises :class:`ConfigError` (exit 2) / :class:`LaunchError` (its ``exit_code``). The
parameter-server controller, ``fleetx.launch.ps``, follows the same protocol.
"""
from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass, fields
from typing import Optional

__all__ = [
    "RunMode", "EXIT_OK", "EXIT_FAILED", "EXIT_USAGE", "LaunchError", "ConfigError", "NodeSetup",
]

#: fleetrun's exit codes. A signal that stopped the job gives 128 + its number (130, 143).
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2


class RunMode(str, enum.Enum):
    """What kind of job fleetrun starts."""

    COLLECTIVE = "collective"
    PS = "ps"


class LaunchError(RuntimeError):
    """The job could not be started or did not finish; fleetrun prints the message.

    Attributes:
        exit_code: what fleetrun exits with.
    """

    exit_code = EXIT_FAILED


class ConfigError(LaunchError, ValueError):
    """A flag has a bad value, or flags contradict each other (fleetrun exits 2).

    Args:
        flag: the flag at fault, e.g. ``"--backend"``.
        message: what is wrong, with the valid choices where there is a fixed set.

    Example:
        >>> str(ConfigError("--backend", "invalid choice 'mpi' (choose from auto, gloo, nccl)"))
        "argument --backend: invalid choice 'mpi' (choose from auto, gloo, nccl)"
    """

    exit_code = EXIT_USAGE

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(f"argument {flag}: {message}")
        self.flag = flag
        self.message = message


@dataclass(frozen=True)
class NodeSetup:
    """What every process of one node needs besides the torchrun variables the agent sets.

    The collective controller builds one per node; each worker's bootstrap turns it and its own
    ``RANK`` / ``LOCAL_RANK`` / ``WORLD_SIZE`` into the ``PADDLE_*`` variables. It travels on the
    bootstrap's command line as JSON.

    Attributes:
        log_dir: absolute folder of ``workerlog.N`` and ``endpoints.log``.
        backend: ``gloo`` or ``nccl`` (never ``auto``: the controller decided).
        node_addrs: address of every node in node-rank order; empty for an elastic job, whose
            endpoints are gathered through the agent's store when the processes start.
        own_addr: this node's address (used for its endpoints in an elastic job).
        ports: one endpoint port per local process.
        devices: the device index of each local process (empty: CPU job).
        visible_devices: ``CUDA_VISIBLE_DEVICES`` for the processes, or None to leave it.
        omp_threads: ``OMP_NUM_THREADS`` for the processes, or None to leave it.
        gloo_ifname, nccl_ifname: ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` for the
            processes (the interface of ``own_addr`` in a multi-node job), or None to leave it.
        launcher_pid: pid of the fleetrun process; a process whose parent is no longer this pid
            exits at once (the launcher died while it started).
        module: the script is a module name, run as ``python -m`` runs it (``fleetrun -m``).
    """

    log_dir: str
    backend: str
    node_addrs: tuple[str, ...]
    own_addr: str
    ports: tuple[int, ...]
    devices: tuple[str, ...] = ()
    visible_devices: Optional[str] = None
    omp_threads: Optional[int] = None
    gloo_ifname: Optional[str] = None
    nccl_ifname: Optional[str] = None
    launcher_pid: int = 0
    module: bool = False

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "NodeSetup":
        raw = json.loads(text)
        tuples = {f.name for f in fields(cls) if str(f.type).startswith("tuple")}
        return cls(**{k: tuple(v) if k in tuples else v for k, v in raw.items()})
