"""Run a function on N local processes that see a torchrun-style environment (gloo, loopback),
and the train-and-collect harness the distributed tests share.

The processes are forked from a fork server that imported torch and fleetx once
(``helpers.preloaded``) instead of each importing them afresh (spawn): a new process costs
milliseconds instead of about three CPU seconds. Each starts with the calling test's current
environment, ``sys.path``, stdout and stderr, as a spawned one would."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import as_if_spawned_from, free_port, preloaded  # noqa: E402  (tests/helpers.py)

START_METHOD = "forkserver"  # helpers.preloaded(): torch and fleetx imported once


def _entry(rank: int, fn: Callable, world: int, port: int, args: tuple,
           parent: Optional[tuple] = None) -> None:
    if parent is not None:
        as_if_spawned_from(*parent)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), FLEETX_TIMEOUT="60")
    import torch
    torch.set_num_threads(1)
    fn(rank, world, *args)
    # as fleetrun ends its processes: no interpreter teardown, where a gloo thread freeing a
    # work object can abort the process (docs/reliability.md)
    from fleetx.launch.script import exit_cleanly
    exit_cleanly(0)


def run(fn: Callable, world: int, *args: Any, deadline: Optional[float] = None) -> None:
    """Start ``fn(rank, world, *args)`` on ``world`` fresh processes and wait; raise if any fails.

    With ``deadline`` (seconds), processes still running then are killed and ``TimeoutError``
    is raised (a test of something that could hang must not hang the suite)."""
    procs = start(fn, world, *args)
    if deadline is None:
        while not procs.join():
            pass
        return
    end = time.monotonic() + deadline
    while not procs.join(timeout=max(0.0, min(1.0, end - time.monotonic()))):
        if time.monotonic() >= end:
            for process in procs.processes:
                if process.is_alive():
                    process.kill()
            raise TimeoutError(f"the {world} processes did not finish within {deadline:.0f} s")


def start(fn: Callable, world: int, *args: Any, port: Optional[int] = None) -> Any:
    """Start ``fn(rank, world, *args)`` on ``world`` processes forked from the fork server and
    return torch's ``ProcessContext`` at once (``join(timeout)`` it: True when all are done; it
    raises when one failed)."""
    preloaded()  # the preload is set before the server's first start
    return mp.start_processes(_entry, args=(fn, world, port or free_port(), args,
                                            (os.getpid(), dict(os.environ))),
                              nprocs=world, start_method=START_METHOD, join=False)


def run_and_load(fn: Callable, world: int, out: Path, deadline: Optional[float] = None) -> list:
    """``run(fn, world, out)``, where each rank saves its results to ``out/rank<r>.pt``; the
    ranks' results, in rank order."""
    import torch
    run(fn, world, str(out), deadline=deadline)
    return [torch.load(Path(out) / f"rank{r}.pt") for r in range(world)]


def train_on_slices(fleet: Any, strategy: Any, model: Any, batches: list, rank: int, batch: int,
                    prepare: Optional[Callable] = None) -> dict:
    """The data-parallel harness the communication tests share: wrap ``model``, build momentum
    SGD (lr 0.05, momentum 0.9) under ``strategy``, and minimise the MSE on this rank's slice of
    every ``(x, y)`` in ``batches`` (``prepare(x)`` first, when given).

    Returns:
        ``state`` (the model's state dict), ``plan`` (the applied strategies), ``traffic`` (the
        data-parallel traffic record, or None) and ``optimizer``.
    """
    import warnings

    import torch
    from torch import nn
    model = fleet.distributed_model(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = fleet.distributed_optimizer(
            torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), strategy=strategy)
    for x, y in batches:
        sl = slice(rank * batch, (rank + 1) * batch)
        if prepare is not None:
            x = prepare(x)
        opt.minimize(nn.functional.mse_loss(model(x[sl]), y[sl]))
    return {"state": model.state_dict(), "plan": fleet.applied_strategies(),
            "traffic": opt.state_dict().get("fleetx", {}).get("data_parallel"), "optimizer": opt}


def max_diff(a: dict, b: dict) -> float:
    """The largest absolute difference between two state dicts with the same keys."""
    return max((a[k] - v).abs().max().item() for k, v in b.items())
