"""FLEETX_DEBUG_COLLECTIVES=1 on 2 processes: calls that differ between the ranks (another shape,
a skipped call) and a rank that does not come become a CommError naming the rank and the call,
on the ranks that wait, instead of a hang or a gloo abort."""
from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spawn import run  # noqa: E402

_TIMEOUT = 5


def _attempt(results: dict, name: str, call) -> None:
    from fleetx.comm.api import CommError
    started = time.monotonic()
    try:
        call()
        results[name] = None
    except CommError as exc:
        results[name] = str(exc)
    except RuntimeError as exc:  # raised inside DDP's comm hook, it reaches backward as this
        results[name] = f"RuntimeError: {exc}"
    results[f"{name}_s"] = time.monotonic() - started


def _diverge(rank: int, world: int, out: str) -> None:
    import os
    os.environ.update(FLEETX_DEBUG_COLLECTIVES="1", FLEETX_TIMEOUT=str(_TIMEOUT))
    from fleetx import fleet
    from fleetx.role_maker import UserDefinedRoleMaker
    endpoints = [f"127.0.0.1:{os.environ['MASTER_PORT']}", "127.0.0.1:1"]
    fleet.init(UserDefinedRoleMaker(is_collective=True, current_id=rank,
                                    worker_endpoints=endpoints))
    r: dict = {}
    # 1. one rank's all-reduce has another shape
    _attempt(r, "shape", lambda: fleet.util.all_reduce(np.zeros(1 + rank)))
    # 2. the ranks are still in step afterwards: the same call gives the sum
    r["after"] = fleet.util.all_reduce(np.array([rank + 1.0])).tolist()
    # 3. rank 1 comes after the timeout (and then leaves): rank 0 names it
    if rank == 1:
        time.sleep(_TIMEOUT + 2)
    else:
        _attempt(r, "late", lambda: fleet.util.all_reduce(np.array([1.0])))
    torch.save(r, f"{out}/rank{rank}.pt")


def _skip(rank: int, world: int, out: str) -> None:
    import os
    os.environ.update(FLEETX_DEBUG_COLLECTIVES="1", FLEETX_TIMEOUT=str(_TIMEOUT))
    from fleetx import fleet
    from fleetx.role_maker import UserDefinedRoleMaker
    endpoints = [f"127.0.0.1:{os.environ['MASTER_PORT']}", "127.0.0.1:1"]
    fleet.init(UserDefinedRoleMaker(is_collective=True, current_id=rank,
                                    worker_endpoints=endpoints))
    torch.manual_seed(0)
    model = fleet.distributed_model(torch.nn.Linear(4, 1))
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    r: dict = {}

    def step(report: bool) -> None:
        model(torch.randn(8, 4)).sum().backward()
        opt.step()
        opt.clear_grad()
        if report:
            fleet.util.all_reduce(np.array([1.0]))

    step(True)
    r["seq"] = torch.distributed.group.WORLD._get_sequence_number_for_group()  # calls so far
    # rank 1 skips the all-reduce after this step; its next call is the next gradient all-reduce
    _attempt(r, "skip", lambda: (step(rank == 0), step(True)))
    torch.save(r, f"{out}/rank{rank}.pt")


def test_other_shape_and_late_rank_are_named(tmp_path):
    run(_diverge, 2, str(tmp_path))
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    expected = ("ranks diverged at call #1 on group 0 (ranks [0, 1]): rank 0 calls "
                "all_reduce(sum) (float64 [1]); rank 1 calls all_reduce(sum) (float64 [2])")
    assert r0["shape"] == r1["shape"] == expected
    assert r0["shape_s"] < _TIMEOUT and r1["shape_s"] < _TIMEOUT   # at once, not at the timeout
    assert r0["after"] == r1["after"] == [3.0]
    # the shape check failed before any call: the sum was call #1, so this one is #2
    assert r0["late"].startswith(f"rank 1 did not arrive at all_reduce(sum) (float64 [1]), "
                                 f"call #2 on group 0 (ranks [0, 1]), within {_TIMEOUT} s; it is "
                                 f"alive (reported ")
    assert r0["late"].endswith("its latest call: all_reduce #1 (float64 [1]) on group 0, entered "
                               f"{_TIMEOUT} s ago")
    assert _TIMEOUT - 1 < r0["late_s"] < 6 * _TIMEOUT


def test_skipped_all_reduce_is_named_not_a_hang(tmp_path):
    run(_skip, 2, str(tmp_path))
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    # the call number is torch's (DDP adds calls of its own in step 2: the exact count is
    # torch's business), and both ranks name the same one
    number = re.search(r"call #(\d+) ", r0["skip"])
    assert number and int(number.group(1)) > r0["seq"] == r1["seq"]
    expected = (f"ranks diverged at call #{number.group(1)} on group 0 (ranks [0, 1]): rank 0 "
                f"calls all_reduce(sum) (float64 [1]); rank 1 calls all_reduce (float32 [5])")
    assert r0["skip"] == expected
    assert expected in r1["skip"]        # rank 1 met it inside backward (DDP's comm hook)
    assert r0["skip_s"] < _TIMEOUT and r1["skip_s"] < _TIMEOUT
