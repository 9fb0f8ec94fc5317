"""``fleet.observe``: an :class:`~fleetx.observe.Observer` for this process, wired to the fleet.

It takes the rank from the fleet (the bar shows on worker 0 only), the scalars the strategies
in force registered (``TrainingContext.scalars``: amp's loss scale, DGC's sparsity, the PS
worker's request latency), fleetrun's ``FLEETX_TTY`` (rank 0's log is shown live on a terminal:
draw the bar although stderr is a file) and ``FLEETX_LOG_DIR`` (leave the throughput there for
fleetrun's end-of-job summary).
"""
from __future__ import annotations

from typing import Any, Optional

from fleetx import env
from fleetx.observe import Observer
from fleetx.observe.api import throughput_path

__all__ = ["observe"]


def _strategy_scalars(fleet: Any) -> dict:
    ctx = getattr(fleet, "_ctx", None)  # built at distributed_optimizer; read when logging
    if ctx is None:
        return {}
    return {name: read() for name, read in ctx.scalars.items()}


def observe(fleet: Any, *, total: Optional[int] = None, batch_size: Optional[int] = None,
            every: int = 10, progress: bool = True, scalars_dir: Optional[str] = None,
            tensorboard: bool = True, force_progress: Optional[bool] = None) -> Observer:
    """An :class:`~fleetx.observe.Observer` for this process of ``fleet``'s job.

    Args:
        fleet: an initialised :class:`~fleetx.fleet.Fleet`.
        total, batch_size, every, progress, scalars_dir, tensorboard: as for
            :class:`~fleetx.observe.Observer`.
        force_progress: draw the bar whatever stderr is; None (default): when stderr is a
            terminal, or fleetrun shows this rank's log live on one (``FLEETX_TTY=1``).

    Raises:
        MissingExtraError: the bar or TensorBoard is asked for and its package is missing.

    Example:
        >>> with fleet.observe(total=steps, batch_size=64, scalars_dir="runs/exp1") as obs:
        ...     for x, y in loader:
        ...         loss = loss_fn(model(x), y)
        ...         opt.minimize(loss)
        ...         obs.step(loss)
    """
    rank = fleet.worker_index()
    if force_progress is None:
        force_progress = env.get("FLEETX_TTY") == "1"
    log_dir = env.get("FLEETX_LOG_DIR")
    if scalars_dir is None and log_dir:  # under fleetrun: the CSV beside the logs, for --plot
        scalars_dir, tensorboard = log_dir, False
    return Observer(rank=rank, total=total, batch_size=batch_size, every=every,
                    progress=progress, force_progress=force_progress, scalars_dir=scalars_dir,
                    tensorboard=tensorboard, extras=lambda: _strategy_scalars(fleet),
                    throughput_file=throughput_path(log_dir, rank) if log_dir else None)
