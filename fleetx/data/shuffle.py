"""Local and global shuffles of the samples in memory.

A global shuffle sends every sample to a worker drawn uniformly at random (each worker draws
for its own samples, from its own seeded generator), exchanges them in one all-to-all of packed
blocks (raw numpy buffers through ``fleet.util.all_to_all``, never pickle), then shuffles what
it received. Each worker's share is then a uniform random sample of all workers' data, whatever
files each worker read; shares differ in size by the binomial spread, as in the reference.

The fleet is an argument (``fleet.worker_num()``, ``fleet.worker_index()``, ``fleet.util``):
this package never imports ``fleetx.fleet``. A worker that does not join is named by the
barrier before the exchange, after ``FLEETX_TIMEOUT`` seconds.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from fleetx.data.api import DataError, FleetLike, ShuffleError
from fleetx.data.block import SampleBlock

__all__ = ["local_shuffle", "global_shuffle", "rng_for"]


def rng_for(seed: Optional[int], rank: int = 0) -> np.random.Generator:
    """A generator for worker ``rank`` from ``seed`` (None: fresh entropy)."""
    if seed is None:
        return np.random.default_rng()
    return np.random.default_rng(np.random.SeedSequence([int(seed), int(rank)]))


def local_shuffle(block: SampleBlock, rng: np.random.Generator) -> SampleBlock:
    """``block``'s samples in a uniformly random order."""
    return block.take(rng.permutation(block.size))


def global_shuffle(block: SampleBlock, fleet: Optional[FleetLike],
                   seed: Optional[int] = None) -> SampleBlock:
    """Exchange samples among the workers of ``fleet`` (see the module docstring); with no
    fleet, or one worker, a local shuffle. Worker ``r`` draws from ``rng_for(seed, r)``.

    Raises:
        ShuffleError: ``fleet`` lacks what is needed, or another worker's samples have other
            slots (it is named).
        CommError: a worker did not take part in time (it is named).
    """
    if fleet is None:
        return local_shuffle(block, rng_for(seed))
    for need in ("worker_num", "worker_index", "util"):
        if not hasattr(fleet, need):
            raise ShuffleError(f"global_shuffle(fleet=...) needs the fleet (fleetx.fleet or a "
                               f"Fleet): {type(fleet).__name__} has no {need!r}")
    workers, rank = int(fleet.worker_num()), int(fleet.worker_index())
    rng = rng_for(seed, rank)
    if workers <= 1:
        return local_shuffle(block, rng)
    destination = rng.integers(0, workers, block.size)
    order = np.argsort(destination, kind="stable")
    bounds = np.concatenate([[0], np.cumsum(np.bincount(destination, minlength=workers))])
    outgoing = [block.take(order[bounds[w]:bounds[w + 1]]).pack() for w in range(workers)]
    fleet.util.barrier()  # names a worker that never comes, before any data moves
    received = fleet.util.all_to_all(outgoing)
    blocks = []
    for worker, buffer in enumerate(received):
        try:
            blocks.append(SampleBlock.unpack(block.slots, buffer, f"worker {worker}"))
        except DataError as exc:
            raise ShuffleError(f"global_shuffle on worker {rank}: {exc}") from None
    return local_shuffle(SampleBlock.concat(block.slots, blocks), rng)
