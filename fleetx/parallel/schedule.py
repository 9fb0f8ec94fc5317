"""Pipeline schedules as data: the order in which one stage runs forwards and backwards.

A schedule is a pure function of (mode, number of stages, stage id, number of micro-batches)
returning a list of ``("F", i)`` / ``("B", i)`` steps; :mod:`fleetx.parallel.runner` executes
it with point-to-point transfers. Keeping it data makes it printable and testable without
processes.

* ``"FThenB"`` (GPipe): every forward, then every backward. All ``m`` micro-batches' activations
  are alive at once on every stage.
* ``"1F1B"`` (PipeDream-flush, Paddle's default): stage ``s`` of ``p`` first runs
  ``min(p - s - 1, m)`` warm-up forwards, then alternates one forward and one backward, then
  drains the remaining backwards. At most ``min(p - s, m)`` micro-batches are alive on stage
  ``s``, so at most ``p``, whatever ``m`` is.

Both have the same bubble: with equal stage times the idle fraction of each stage is
``(p - 1) / (m + p - 1)``.
"""
from __future__ import annotations

__all__ = ["SCHEDULES", "normalize_mode", "steps", "max_in_flight", "bubble_fraction"]

# Paddle 2.2's names; "F-then-B" is the spelling earlier fleetx configs accepted.
SCHEDULES = ("1F1B", "FThenB")
_ALIASES = {"F-then-B": "FThenB"}

Step = tuple[str, int]


def normalize_mode(mode: str) -> str:
    """The canonical schedule name.

    Raises:
        ValueError: an unknown schedule, naming the valid ones.
    """
    mode = _ALIASES.get(mode, mode)
    if mode not in SCHEDULES:
        raise ValueError(f"unknown schedule_mode {mode!r}: use one of {SCHEDULES} "
                         f"(or the alias 'F-then-B')")
    return mode


def steps(mode: str, num_stages: int, stage: int, num_micro: int) -> list[Step]:
    """The steps stage ``stage`` runs, in order.

    Args:
        mode: ``"1F1B"`` or ``"FThenB"`` (``"F-then-B"`` accepted).
        num_stages: ``p``.
        stage: this stage, ``0 <= stage < p``.
        num_micro: ``m``, the micro-batches of one mini-batch.

    Raises:
        ValueError: an unknown mode, or a stage outside ``[0, p)``.

    Example:
        >>> steps("1F1B", 2, 0, 3)
        [('F', 0), ('F', 1), ('B', 0), ('F', 2), ('B', 1), ('B', 2)]
    """
    mode = normalize_mode(mode)
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} is not in [0, {num_stages})")
    forwards = [("F", i) for i in range(num_micro)]
    backwards = [("B", i) for i in range(num_micro)]
    if mode == "FThenB":
        return forwards + backwards
    warmup = min(num_stages - stage - 1, num_micro)
    out = forwards[:warmup]
    for i in range(warmup, num_micro):  # steady state: one forward, then the oldest backward
        out += [forwards[i], backwards[i - warmup]]
    return out + backwards[num_micro - warmup:]


def max_in_flight(order: list[Step]) -> int:
    """The largest number of micro-batches whose forward ran and backward did not yet."""
    alive = peak = 0
    for kind, _ in order:
        alive += 1 if kind == "F" else -1
        peak = max(peak, alive)
    return peak


def bubble_fraction(num_stages: int, num_micro: int) -> float:
    """The theoretical idle fraction of a stage, ``(p - 1) / (m + p - 1)``."""
    return (num_stages - 1) / (num_micro + num_stages - 1)
