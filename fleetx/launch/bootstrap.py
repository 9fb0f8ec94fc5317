"""The first code every worker process runs: ``python -u -m fleetx.launch.bootstrap SETUP
script.py args...`` (collective), or ``... --ps SETUP script.py args...`` (parameter server).

In order, it

1. ties the process to the launcher: the kernel kills it when fleetrun dies, even by SIGKILL
   (``PR_SET_PDEATHSIG``), and a forked *guardian* kills the worker's process group once the
   worker is gone, so processes the script started die with it;
2. adds the ``PADDLE_*`` variables to the torchrun ones the elastic agent set (one
   ``NodeSetup`` per node, see ``api.py``, plus this process's ``RANK``/``LOCAL_RANK``): first
   every variable that does not depend on the other ranks (``OMP_NUM_THREADS``,
   ``CUDA_VISIBLE_DEVICES``...), then, in an elastic job, it exchanges endpoints through the
   agent's store (which imports torch) and adds ``PADDLE_TRAINER_ENDPOINTS``;
3. on the node's first process, prints the "Distributed Envs" table to the launcher's terminal
   and writes ``endpoints.log``;
4. points its stdout and stderr at ``workerlog.<RANK>``;
5. runs the script with :mod:`runpy`, so ``__name__ == "__main__"`` and ``sys.argv`` are what
   ``python script.py args`` would give, and ends the process without interpreter teardown
   (:mod:`fleetx.launch.script` says why), keeping the script's exit status.

A parameter-server process (``--ps``, from ``fleetx.launch.ps``) already has its variables from
the launcher; it takes steps 1, 4 and 5 with the log file and launcher pid of its ``SETUP``.

Nothing imports torch before ``OMP_NUM_THREADS`` and ``CUDA_VISIBLE_DEVICES`` are in place: torch
reads both once, when it is first imported.
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
from typing import Callable, Optional, Sequence

from fleetx import env
from fleetx.launch import banner, logs
from fleetx.launch.api import NodeSetup
from fleetx.launch.script import run_script
from fleetx.observe.api import csv_path, throughput_path

__all__ = ["process_env", "local_env", "endpoint_env", "static_endpoints", "own_endpoint",
           "configure", "main"]

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
# The guardian's wake-up call when the worker exits; it re-checks its parent on any wake-up, so
# a stray SIGUSR1 sent to the group changes nothing.
_GUARDIAN_SIGNAL = signal.SIGUSR1


def _endpoint(addr: str, port: int) -> str:
    return f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"  # IPv6 in brackets


def static_endpoints(setup: NodeSetup) -> list[str]:
    """``ip:port`` of every rank when the nodes are known: node by node, port by port."""
    return [_endpoint(addr, port) for addr in setup.node_addrs for port in setup.ports]


def own_endpoint(setup: NodeSetup, local_rank: int) -> str:
    """This process's ``ip:port``: the node's address and the process's port."""
    return _endpoint(setup.own_addr, setup.ports[local_rank])


def process_env(setup: NodeSetup, rank: int, local_rank: int, world_size: int,
                endpoints: Optional[Sequence[str]]) -> dict[str, str]:
    """The variables fleetrun adds for one process (the agent already set the torchrun ones):
    :func:`local_env` and :func:`endpoint_env` together.

    Args:
        setup: the node's facts.
        rank, local_rank, world_size: this process, from the elastic agent.
        endpoints: every rank's ``ip:port`` in rank order, or None when they are unknown (an
            elastic job whose agent store is not shared); then only the current one is set.

    Example:
        >>> s = NodeSetup("/tmp/log", "gloo", ("10.0.0.1",), "10.0.0.1", (6071, 6072))
        >>> process_env(s, 1, 1, 2, static_endpoints(s))["PADDLE_CURRENT_ENDPOINT"]
        '10.0.0.1:6072'
    """
    values = local_env(setup, rank, local_rank, world_size)
    values.update(endpoint_env(setup, rank, local_rank, endpoints))
    return values


def endpoint_env(setup: NodeSetup, rank: int, local_rank: int,
                 endpoints: Optional[Sequence[str]]) -> dict[str, str]:
    """``PADDLE_CURRENT_ENDPOINT``, and ``PADDLE_TRAINER_ENDPOINTS`` when ``endpoints`` are
    known."""
    values = {"PADDLE_CURRENT_ENDPOINT": endpoints[rank] if endpoints
              else own_endpoint(setup, local_rank)}
    if endpoints:
        values["PADDLE_TRAINER_ENDPOINTS"] = ",".join(endpoints)
    return values


def local_env(setup: NodeSetup, rank: int, local_rank: int, world_size: int) -> dict[str, str]:
    """Every variable of :func:`process_env` that does not depend on the other ranks'
    endpoints; among them those torch reads at import (``OMP_NUM_THREADS``,
    ``CUDA_VISIBLE_DEVICES``)."""
    devices = setup.devices
    values = {
        "PADDLE_TRAINER_ID": str(rank),
        "PADDLE_TRAINERS_NUM": str(world_size),
        "PADDLE_RANK_IN_NODE": str(local_rank),
        "PADDLE_LOCAL_DEVICE_IDS": devices[local_rank] if devices else "",
        "PADDLE_WORLD_DEVICE_IDS": ",".join(devices[r % len(devices)]
                                            for r in range(world_size)) if devices else "",
        "PADDLE_DISTRI_BACKEND": setup.backend,
        "PADDLE_TRAINING_ROLE": "TRAINER",
        "FLEETX_LOG_DIR": setup.log_dir,
    }
    if devices:
        values["FLAGS_selected_gpus"] = devices[local_rank]
    if setup.visible_devices is not None:
        values["CUDA_VISIBLE_DEVICES"] = setup.visible_devices
    if setup.omp_threads:
        values["OMP_NUM_THREADS"] = str(setup.omp_threads)
    if setup.gloo_ifname:
        values["GLOO_SOCKET_IFNAME"] = setup.gloo_ifname
    if setup.nccl_ifname:
        values["NCCL_SOCKET_IFNAME"] = setup.nccl_ifname
    return values


# -- lifetime: die with the launcher, take the worker's children along -------------------------
def _prctl(option: int, arg: object) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, arg, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}) failed")


def _die_with_launcher(launcher_pid: int) -> None:
    if not sys.platform.startswith("linux") or not launcher_pid:
        return
    _prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
    # The launcher may have died before the line above: then nobody will send the signal.
    if os.getppid() != launcher_pid:
        os.kill(os.getpid(), signal.SIGKILL)


def _start_guardian() -> None:
    """Fork a guardian that SIGKILLs this process group as soon as this process has exited.

    Only when this process leads its own group (the agent starts every worker in a new session),
    so the group is exactly the worker and what it started. The guardian ignores the SIGTERM a
    graceful stop sends to the group: it must outlive the worker to kill children that ignore it.
    """
    if not sys.platform.startswith("linux") or os.getpgid(0) != os.getpid():
        return
    worker = os.getpid()
    if os.fork() != 0:
        return
    try:
        os.closerange(0, 1024)  # hold no pipe or log open on anyone's behalf
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
            signal.signal(sig, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_BLOCK, {_GUARDIAN_SIGNAL})
        _prctl(_PR_SET_NAME, b"fleetx-guard")
        _prctl(_PR_SET_PDEATHSIG, int(_GUARDIAN_SIGNAL))
        while os.getppid() == worker:
            signal.sigtimedwait({_GUARDIAN_SIGNAL}, 1.0)
        os.killpg(os.getpgid(0), signal.SIGKILL)
    finally:
        os._exit(0)


# -- what this process is --------------------------------------------------------------------
def _gather_endpoints(own: str, rank: int, world_size: int) -> Optional[list[str]]:
    """Every rank's endpoint, exchanged through the elastic agent's store (elastic jobs)."""
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    from datetime import timedelta

    from torch.distributed import TCPStore  # only elastic jobs pay for torch here

    store = TCPStore(env.get("MASTER_ADDR"), env.get_int("MASTER_PORT"), is_master=False,
                     timeout=timedelta(seconds=env.get_int("FLEETX_TIMEOUT")))
    prefix = f"fleetx/launch/{env.get_int('TORCHELASTIC_RESTART_COUNT')}/endpoint/"
    store.set(f"{prefix}{rank}", own)
    return [store.get(f"{prefix}{r}").decode() for r in range(world_size)]


def configure(setup: NodeSetup, rank: int, local_rank: int, world_size: int,
              gather: Callable[[str, int, int], Optional[list[str]]] = _gather_endpoints
              ) -> Optional[list[str]]:
    """Set this process's variables; returns every rank's endpoint (None when unknown).

    The variables torch reads at import are set before ``gather`` runs: exchanging endpoints
    in an elastic job imports torch.
    """
    env.apply(local_env(setup, rank, local_rank, world_size))
    endpoints = (static_endpoints(setup) if setup.node_addrs
                 else gather(own_endpoint(setup, local_rank), rank, world_size))
    env.apply(endpoint_env(setup, rank, local_rank, endpoints))
    return endpoints


def _redirect_output(path: str, fresh: bool) -> None:
    """Point fd 1 and 2 at ``path``; a fresh log is a new file, so the launcher's follower can
    tell it from the previous job's."""
    if fresh and os.path.exists(path):
        os.unlink(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _forget_earlier_reports(log_dir: str, index: int) -> None:
    """A fresh process removes the throughput and scalars an earlier job's process of its rank
    left (only node 0 moves an earlier job's files aside, before any process starts):
    fleetrun's summary and --plot then show only what this job reported."""
    for path in (throughput_path(log_dir, index), csv_path(log_dir, index)):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _main_ps(argv: Sequence[str]) -> None:
    """A parameter-server process: ``SETUP`` is ``{"log": path, "launcher_pid": pid}``, and
    ``"module": true`` when the script is a module name (``fleetrun -m``)."""
    setup = json.loads(argv[0])
    _die_with_launcher(int(setup["launcher_pid"]))
    _start_guardian()
    fresh = bool(setup.get("fresh", True))
    _redirect_output(setup["log"], fresh=fresh)  # a restart appends
    if fresh and env.get("TRAINING_ROLE") == "TRAINER" and env.is_set("PADDLE_TRAINER_ID"):
        _forget_earlier_reports(os.path.dirname(setup["log"]), env.get_int("PADDLE_TRAINER_ID"))
    run_script(argv[1], argv[2:], module=bool(setup.get("module")))


def main(argv: Optional[Sequence[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--ps"] and len(argv) >= 3:
        return _main_ps(argv[1:])
    if len(argv) < 2:
        sys.exit("usage: python -m fleetx.launch.bootstrap [--ps] SETUP_JSON script.py [args...]")
    setup, script, args = NodeSetup.from_json(argv[0]), argv[1], argv[2:]
    _die_with_launcher(setup.launcher_pid)
    _start_guardian()
    rank, local_rank = env.get_int("RANK"), env.get_int("LOCAL_RANK")
    world_size = env.get_int("WORLD_SIZE")
    if rank is None or local_rank is None or world_size is None:
        raise env.EnvError("RANK, LOCAL_RANK and WORLD_SIZE must be set (fleetrun sets them)")
    endpoints = configure(setup, rank, local_rank, world_size)
    restarted = env.get_int("TORCHELASTIC_RESTART_COUNT") > 0
    if local_rank == 0:
        print(banner.envs_table(env.snapshot()), flush=True)
        print(f"details about PADDLE_TRAINER_ENDPOINTS can be found in "
              f"{logs.endpoints_log(setup.log_dir)}, and detail running logs maybe found in "
              f"{logs.worker_log(setup.log_dir, rank)}", flush=True)
        known = endpoints or [own_endpoint(setup, local_rank)]
        logs.write_endpoints(setup.log_dir, list(known))
    _redirect_output(logs.worker_log(setup.log_dir, rank), fresh=not restarted)
    if not restarted:
        _forget_earlier_reports(setup.log_dir, rank)
    run_script(script, args, module=setup.module)


if __name__ == "__main__":
    main()
