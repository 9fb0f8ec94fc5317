"""Named random streams, so that model-parallel ranks draw alike or apart on purpose.

Under tensor parallelism most random draws must agree across the model-parallel group (the
initialisation of a replicated bias, dropout on a replicated activation) while some must differ
(dropout on this rank's slice of a split activation). Paddle keeps the global generator equal
across the group and registers a second stream, ``"model_parallel_rng"``, seeded per rank;
code that needs rank-local randomness runs inside ``get_rng_state_tracker().rng_state()``.

``fleet.init`` seeds both when ``mp_degree > 1``, from
``tensor_parallel_configs['tensor_init_seed']`` (:func:`model_parallel_random_seed`); ``-1``
draws one seed on rank 0 and sends it to every rank (:func:`agreed_seed`), so the global stream
still agrees across the group. The streams cover the CPU generator and, where CUDA is
available, the current device's generator.

Example:
    >>> tracker = get_rng_state_tracker()
    >>> tracker.add("my_stream", 1234)
    >>> with tracker.rng_state("my_stream"):
    ...     mask = torch.rand(4) > 0.5   # drawn from "my_stream", which advances
"""
from __future__ import annotations

import contextlib
import random as _random
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from fleetx.parallel.api import MODEL_PARALLEL_RNG

__all__ = ["RNGStatesTracker", "get_rng_state_tracker", "model_parallel_random_seed",
           "agreed_seed"]


def _capture() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _restore(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class RNGStatesTracker:
    """Named generator states; :meth:`rng_state` swaps one in for the duration of a block.

    Example:
        >>> t = RNGStatesTracker()
        >>> t.add("a", 1)
        >>> with t.rng_state("a"):
        ...     x = torch.rand(2)
    """

    def __init__(self) -> None:
        self._states: dict[str, dict] = {}
        self._seeds: set[int] = set()

    def reset(self) -> None:
        """Forget every stream."""
        self._states, self._seeds = {}, set()

    def add(self, name: str, seed: int) -> None:
        """Register stream ``name`` seeded with ``seed`` (the global generator is untouched).

        Raises:
            ValueError: ``name`` or ``seed`` is taken already (two streams of one seed would
                draw the same numbers), or ``seed`` is not a non-negative int.
        """
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be an int >= 0, got {seed!r}")
        if name in self._states:
            raise ValueError(f"rng stream {name!r} already exists: pick another name, or "
                             f"reset() the tracker first")
        if seed in self._seeds:
            raise ValueError(f"seed {seed} is already used by another rng stream: streams of "
                             f"one seed draw the same numbers")
        with torch.random.fork_rng(devices=[]):
            saved = _capture()
            torch.manual_seed(seed)
            self._states[name] = _capture()
            _restore(saved)  # fork_rng restores the CPU; this also restores the device
        self._seeds.add(seed)

    def get_states_tracker(self) -> dict:
        """A copy of every stream's state, by name (to save, or to restore with
        :meth:`set_states_tracker`)."""
        return {name: {k: v.clone() for k, v in s.items()} for name, s in self._states.items()}

    def set_states_tracker(self, states: dict) -> None:
        """Replace the streams with ``states`` (from :meth:`get_states_tracker`)."""
        self._states = {name: {k: v.clone() for k, v in s.items()}
                        for name, s in states.items()}

    @contextlib.contextmanager
    def rng_state(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Draw from stream ``name`` inside the block; the global generator resumes after it
        where it was, and the stream keeps what the block consumed.

        Raises:
            ValueError: no stream of that name (the known names are listed).
        """
        if name not in self._states:
            known = ", ".join(sorted(self._states)) or "none"
            raise ValueError(f"unknown rng stream {name!r} (known: {known}); "
                             f"register it with add(name, seed)")
        outside = _capture()
        _restore(self._states[name])
        try:
            yield
        finally:
            self._states[name] = _capture()
            _restore(outside)


_TRACKER = RNGStatesTracker()


def get_rng_state_tracker() -> RNGStatesTracker:
    """The process's tracker (the one :func:`model_parallel_random_seed` fills)."""
    return _TRACKER


def model_parallel_random_seed(seed: int, mp_rank: int) -> tuple[int, int]:
    """Seed the global generator with ``seed`` (equal on every rank) and register
    ``"model_parallel_rng"`` with a seed that differs per model-parallel rank.

    Args:
        seed: the job's seed (>= 0), the same on every rank.
        mp_rank: this rank's index in its model-parallel group.

    Returns:
        ``(global_seed, local_seed)``.

    Raises:
        ValueError: ``seed`` or ``mp_rank`` is negative.
    """
    if seed < 0 or mp_rank < 0:
        raise ValueError(f"seed and mp_rank must be >= 0, got seed={seed}, mp_rank={mp_rank}")
    # The local seeds of a group are consecutive, away from the global seed: one stream per
    # model-parallel rank, none equal to the stream every rank shares.
    local = (seed * 65_537 + 1 + mp_rank) % 2**63
    torch.manual_seed(seed)
    _TRACKER.reset()
    _TRACKER.add(MODEL_PARALLEL_RNG, local)
    return seed, local


def agreed_seed(seed: int, group: Optional[Any] = None) -> int:
    """``seed``, or for ``-1`` a random seed drawn on rank 0 and sent to every rank of
    ``group`` (the world by default; without ``torch.distributed``, drawn here)."""
    if seed != -1:
        return seed
    drawn = [_random.SystemRandom().randrange(2**31)]
    if dist.is_available() and dist.is_initialized():
        dist.broadcast_object_list(drawn, src=0, group=group)
    return int(drawn[0])
