"""``fleet.save_checkpoint`` / ``fleet.load_checkpoint``: training checkpoints of the job.

A mixin of :class:`~fleetx.fleet.fleet.Fleet`. It hands :mod:`fleetx.checkpoint.training` what
the fleet holds (the user's module, the inner optimizer, every applied strategy's state, the
rank and world size); the format, the re-sharding rules and the verification live there.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

from fleetx.checkpoint.training import TrainingState, load, save
from fleetx.fleet.api import FleetError

__all__ = ["CheckpointCalls"]


class CheckpointCalls:
    """Training checkpoints (mixed into ``Fleet``)."""

    def save_checkpoint(self, path: str, extra: Optional[Mapping] = None) -> None:
        """Save the model, the optimizer and every applied strategy's state into folder
        ``path`` (every rank calls; a collective).

        Parameters, optimizer moments and step counts are saved through
        ``torch.distributed.checkpoint`` (each rank writes its share); strategy state (loss
        scale, Local SGD counters, DGC buffers, gradients still being merged) per rank. The
        save is committed with a manifest of SHA-256 hashes: saving again to the same folder
        replaces the checkpoint atomically, and a crash during a save leaves the previous one.

        Args:
            path: the checkpoint folder (created if needed).
            extra: a JSON-able dict returned by :meth:`load_checkpoint` (``{"step": 500}``).

        Raises:
            FleetError: called before ``fleet.distributed_model``.
            TypeError: ``extra`` is not a JSON-able dict.
            fleetx.checkpoint.CheckpointError: a file cannot be written or committed, or
                sharding stage 2 or 3 holds gradients of an unfinished gradient merge
                (save where ``minimize`` returned True).

        Example:
            >>> fleet.save_checkpoint("ckpt", extra={"step": step})   # every rank
        """
        save(path, self._training_state("save_checkpoint"), extra)

    def load_checkpoint(self, path: str) -> dict:
        """Load what :meth:`save_checkpoint` saved into the model and optimizer given to
        ``distributed_model`` / ``distributed_optimizer`` (every rank calls; a collective).

        Loads at any world size and under another strategy (sharding on or off, another
        stage): parameters, optimizer moments, step counts and the loss scale exactly. Per-rank
        state: at the same world size each rank loads its own; at another, every rank takes
        rank 0's counters and per-rank tensors (DGC residuals and momentum, gradients being
        merged) start afresh (see :mod:`fleetx.checkpoint.training`).

        Returns:
            The ``extra`` dict given to :meth:`save_checkpoint` (``{}`` if none).

        Raises:
            FleetError: called before ``fleet.distributed_model``.
            fleetx.checkpoint.CheckpointError: no checkpoint in ``path``, or a damaged or
                missing file ("checksum mismatch" naming it; nothing is loaded).

        Example:
            >>> step = fleet.load_checkpoint("ckpt")["step"]
        """
        return load(path, self._training_state("load_checkpoint"))

    def _training_state(self, what: str) -> TrainingState:
        rm = self._rm(what)
        if not self._models:
            raise FleetError(f"fleet.{what}() saves and loads the model given to "
                             f"fleet.distributed_model(...): call that first")
        optimizer = self._dist_optimizer
        ctx: Any = optimizer._ctx if optimizer is not None else self._context()
        return TrainingState(module=self._models[-1].module,
                             optimizer=optimizer.inner if optimizer is not None else None,
                             strategy_state=ctx.state, rank=rm._worker_index(),
                             world_size=rm._worker_num(), strategies=tuple(self.applied_strategies()))
