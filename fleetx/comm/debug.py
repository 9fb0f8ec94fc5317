"""``FLEETX_DEBUG_COLLECTIVES=1``: before each collective, every rank of the group checks that
all of them are making the same call.

torch has this as ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (a ``ProcessGroupWrapper`` that passes a
monitored barrier and all-gathers a fingerprint of each call on a helper gloo group). It works
with gloo on CPU and names the ranks, but in torch 2.13 ``DistributedDataParallel`` over a
wrapped gloo group dies of SIGSEGV while it is built (its logger casts the wrapper to
``ProcessGroupGloo``), so a data-parallel CPU job cannot use it. fleetx's :class:`Checker`
does the same through the rendezvous store instead, at the collectives fleetx makes: DDP's
gradient all-reduce (through the comm-hook pipeline, :mod:`fleetx.comm.hooks`), ``fleet.util``
and ``fleet.barrier_worker``. A script's own ``torch.distributed`` calls are not checked.

Call ``n`` on a group: each rank writes ``check/<group>/<n>/<rank>`` = its fingerprint
(operation, tensor shapes and dtypes), waits until every member has written call ``n`` (at most
the collective timeout) and compares. A rank that made another call, or the same one with other
shapes or dtypes, makes every rank raise a :class:`~fleetx.comm.api.CommError` naming it and
both calls; one that does not come is named after the timeout with what its progress report
says it is doing. Cost: a few store round trips per collective, so it is for finding a bug, not
for training.
"""
from __future__ import annotations

import json
import os
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch

from fleetx import env
from fleetx.comm import progress
from fleetx.comm.api import Blame, CommError, set_checker

__all__ = ["requested", "Checker"]

_KEY = "check/{group}/{seq}/{rank}"


def requested() -> bool:
    """Whether ``FLEETX_DEBUG_COLLECTIVES`` asks for the checks.

    Raises:
        fleetx.env.EnvError: the value is not 0 or 1.
    """
    value = env.get("FLEETX_DEBUG_COLLECTIVES")
    if value not in ("0", "1"):
        raise env.EnvError(f"FLEETX_DEBUG_COLLECTIVES={value!r} must be 0 or 1")
    return value == "1"


def _fingerprint(op: str, tensors: Sequence[torch.Tensor]) -> dict:
    return {"op": op, "tensors": [[str(t.dtype).replace("torch.", ""), list(t.shape)]
                                  for t in tensors]}


def _describe(fingerprint: dict) -> str:
    tensors = ", ".join(f"{dtype} {shape}" for dtype, shape in fingerprint["tensors"])
    return f"{fingerprint['op']} ({tensors})" if tensors else fingerprint["op"]


class Checker:
    """Compares every rank's collective calls through the store (see the module docstring).

    Args:
        store: the job's rendezvous store.
        rank: this rank.
        timeout: seconds to wait for the other ranks' fingerprints.
        report: called with the :class:`Blame` before the error is raised (the communicator's
            watch: a note for the traceback and the report for fleetrun).
        interval: the progress reports' interval, to tell a silent peer from a busy one.

    Example (what the communicator does when the variable is set)::

        checker = Checker(store, rank, timeout, watch.report, interval=1.0)
        checker.start()
        checker.check("all_reduce", group, [tensor])    # before dist.all_reduce(tensor, group)
    """

    def __init__(self, store: Any, rank: int, timeout: float,
                 report: Callable[[Blame], None], interval: float) -> None:
        self.store, self.rank, self.timeout = store, rank, timeout
        self.report, self.interval = report, interval
        self._calls: dict[str, int] = {}
        self._lock = threading.Lock()  # DDP's hook may run on another thread

    def start(self) -> None:
        """Check the calls made through :func:`fleetx.comm.api.check_call` from now on."""
        set_checker(self)

    def stop(self) -> None:
        set_checker(None)

    def check(self, op: str, group: Any, tensors: Sequence[torch.Tensor]) -> None:
        """Raise unless every rank of ``group`` is about to make the same call.

        Raises:
            CommError: a rank made another call or used other shapes or dtypes (every rank
                raises), or a rank did not come within the timeout (it is named).
        """
        name = progress.group_name(group)
        found = progress.groups().get(name)
        if name is None or found is None or len(found[1]) < 2:
            return
        pg, members = found
        # Keys are numbered by this checker, which counts failed checks too, so a call after a
        # failed one never meets the failed call's keys; messages use torch's number for the
        # call, the one progress reports and the flight recorder show.
        with self._lock:
            seq = self._calls[name] = self._calls.get(name, 0) + 1
        call = f"call #{int(pg._get_sequence_number_for_group()) + 1} on group {name} " \
               f"(ranks {members})"
        mine = _fingerprint(op, tensors)
        self.store.set(_KEY.format(group=name, seq=seq, rank=self.rank), json.dumps(mine))
        keys = [_KEY.format(group=name, seq=seq, rank=r) for r in members]
        self._wait(keys, members, call, mine)
        prints = {r: json.loads(v) for r, v in zip(members, self.store.multi_get(keys))}
        different = [r for r in members if prints[r] != prints[members[0]]]
        if different:
            calls = "; ".join(f"rank {r} calls {_describe(prints[r])}"
                              for r in (members[0], different[0]))
            self._fail([different[0]], f"ranks diverged at {call}: {calls}")
        if seq > 2:  # every peer is past check seq - 1, so nobody reads seq - 2 again
            self.store.delete_key(_KEY.format(group=name, seq=seq - 2, rank=self.rank))

    def _wait(self, keys: list, members: list, call: str, mine: dict) -> None:
        try:
            self.store.wait(keys, timedelta(seconds=self.timeout))
            return
        except RuntimeError:  # a timeout: say who is missing
            pass
        missing = [r for r, k in zip(members, keys) if not self.store.check([k])]
        if not missing:  # everyone came after all: the store failed, not a peer
            raise CommError(f"checking {call}: the rendezvous store failed")
        now, states = time.time(), []
        for r in missing:
            record = progress.read_record(self.store, r)
            state = f"; {record.state(self.interval, now)}" if record else ""
            states.append(f"rank {r} did not arrive at {_describe(mine)}, {call}, within "
                          f"{self.timeout:.0f} s{state}")
        self._fail(missing, "; ".join(states))

    def _fail(self, ranks: list, message: str) -> None:
        blame = Blame(self.rank, os.getpid(), tuple(ranks), message)
        self.report(blame)
        error = CommError(message)
        error._fleetx_blame = blame
        raise error


