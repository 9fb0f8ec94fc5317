"""fleetx.metrics on 2 processes whose inputs disagree: every worker raises the same MetricError
(naming the metric, the input and the worker) instead of gloo aborting or summing garbage, and
the job can go on computing metrics afterwards."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spawn import run  # noqa: E402


def _cases(rank: int):
    """(name, call) pairs; each call disagrees between the two workers in one way."""
    from fleetx import metrics
    return [
        ("buckets", lambda: metrics.AUC(num_buckets=32 if rank == 0 else 16).global_auc()),
        ("dtype", lambda: metrics.sum(np.array([1, 2], dtype=np.int64 if rank == 0 else
                                               np.float64))),
        ("shape", lambda: metrics.acc(np.array([3] * (rank + 1)), np.array([4]))),
        ("nan", lambda: metrics.mae(np.array([np.nan if rank == 1 else 1.0]), np.array([2]))),
        ("inf", lambda: metrics.auc(np.array([[0.0, np.inf if rank == 0 else 1.0]]),
                                    np.array([[1.0, 0.0]]))),
        ("call", lambda: (metrics.auc(np.array([[0, 1]]), np.array([[1, 0]])) if rank == 0
                          else metrics.acc(np.array([1]), np.array([2])))),
        ("scope", lambda: metrics.acc("correct", np.array([2]),
                                      scope={"correct": np.array([1])} if rank == 0 else {})),
    ]


def _disagree(rank: int, world: int, out: str) -> None:
    import os
    from fleetx import fleet, metrics
    from fleetx.metrics import MetricError
    from fleetx.role_maker import UserDefinedRoleMaker
    endpoints = [f"127.0.0.1:{os.environ['MASTER_PORT']}", "127.0.0.1:1"]
    fleet.init(UserDefinedRoleMaker(is_collective=True, current_id=rank,
                                    worker_endpoints=endpoints))
    errors = {}
    for name, call in _cases(rank):
        try:
            call()
            errors[name] = None
        except MetricError as exc:
            errors[name] = str(exc)
    # Both workers are still in step: a correct call after all that gives the global value.
    errors["after"] = metrics.sum(np.array([rank + 1])).tolist()
    torch.save(errors, f"{out}/rank{rank}.pt")


def test_disagreeing_inputs_raise_the_same_metric_error_on_every_worker(tmp_path):
    run(_disagree, 2, str(tmp_path))
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert r0["after"] == r1["after"] == [3]
    for name in ("buckets", "dtype", "shape", "nan", "inf", "call"):
        assert r0[name] is not None and r0[name] == r1[name], name
    assert r0["buckets"] == ("auc: stat_pos differs across workers: worker 0 has shape [1, 32] "
                             "(32 buckets) int64, worker 1 has shape [1, 16] (16 buckets) int64; "
                             "every worker must pass the same shape and dtype")
    assert r0["dtype"] == ("sum: input differs across workers: worker 0 has shape [2] int64, "
                           "worker 1 has shape [2] float64; every worker must pass the same "
                           "shape and dtype")
    assert r0["shape"].startswith("acc: correct differs across workers: worker 0 has shape [1] ")
    assert r0["nan"] == "mae: abserr is not finite on worker 1 (it holds NaN)"
    assert r0["inf"] == "auc: stat_pos is not finite on worker 0 (it holds inf)"
    assert r0["call"] == ("fleet.metrics: workers are not making the same call: worker 0 "
                          "called auc, worker 1 called acc")
    # The worker whose scope lacks the name gets its own error; the other is told who failed.
    assert r1["scope"] == "acc names 'correct', but it is not in scope"
    assert r0["scope"] == "acc: worker 1 rejected its correct input (its own error says why)"
