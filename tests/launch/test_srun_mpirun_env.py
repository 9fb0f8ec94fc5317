"""Real processes started as ``srun`` and ``mpirun`` start them: only their variables (no
RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT for Slurm), through ``python -m fleetx.run``; two ranks train over
gloo on loopback and must end with equal parameters, and each exits 0. Each test takes ~6 s on
a loaded 2-core machine (two torch imports); the variants are in the slow stage."""
from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import free_port  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "cluster_train.py"
# Variables of other launchers that the test process may carry: a task must see only srun's or
# mpirun's own.
FOREIGN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
           "GROUP_RANK", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_USE_AGENT_STORE",
           "PADDLE_DISTRI_BACKEND")


def _run_tasks(per_task: list[dict]) -> list[list[str]]:
    base = {k: v for k, v in os.environ.items()
            if k not in FOREIGN and not k.startswith(("PADDLE_", "SLURM_", "OMPI_", "PMI_"))}
    base.update(PADDLE_DISTRI_BACKEND="gloo", FLEETX_TIMEOUT="60", OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-m", "fleetx.run", str(SCRIPT)],
                              env={**base, **extra}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for extra in per_task]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, f"task exited {p.returncode}:\n{out}\n{err}"
        results.append(next(line.split()[1:] for line in out.splitlines()
                            if line.startswith("RESULT")))
    return results


def _check(results: list[list[str]], local_ranks: list[str]) -> None:
    assert [r[:3] for r in results] == [["0", "2", local_ranks[0]], ["1", "2", local_ranks[1]]]
    assert results[0][3:] == results[1][3:]  # the same parameters after the steps
    assert len(results[0][3:]) == 10


def _job_id_with_a_free_port() -> str:
    """A SLURM_JOB_ID whose rendezvous port (20000 + id mod 10000) is free now."""
    for port in random.sample(range(20000, 30000), 50):
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
        return str(70000 + port - 20000)  # 7xxxx: mod 10000 gives the port back
    pytest.fail("no free port in 20000-29999 after 50 tries")


@pytest.mark.parametrize("nodelist", [
    "localhost", pytest.param("localhost,node[02-03]", marks=pytest.mark.slow)])
def test_srun_two_tasks_on_one_node(nodelist):
    # srun's variables alone: the node list gives the address, the job id the port
    job = {"SLURM_NTASKS": "2", "SLURM_NODELIST": nodelist, "SLURM_JOB_NODELIST": nodelist,
           "SLURM_NODEID": "0", "SLURM_TASKS_PER_NODE": "2",
           "SLURM_JOB_ID": _job_id_with_a_free_port()}
    tasks = [dict(job, SLURM_PROCID=str(r), SLURM_LOCALID=str(r)) for r in range(2)]
    _check(_run_tasks(tasks), ["0", "1"])


def test_open_mpi_two_ranks():
    job = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    tasks = [dict(job, OMPI_COMM_WORLD_RANK=str(r), OMPI_COMM_WORLD_LOCAL_RANK=str(r))
             for r in range(2)]
    _check(_run_tasks(tasks), ["0", "1"])


@pytest.mark.slow
def test_mpich_two_ranks_on_two_nodes():
    job = {"PMI_SIZE": "2", "MPI_LOCALNRANKS": "1", "MPI_LOCALRANKID": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    _check(_run_tasks([dict(job, PMI_RANK=str(r)) for r in range(2)]), ["0", "0"])


# docs/clusters.md's recipes (marked <!-- cluster recipe -->) are checked with bash -n by
# tests/docs/test_code_blocks.py.
