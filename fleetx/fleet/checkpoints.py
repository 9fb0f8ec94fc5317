"""``fleet.save_checkpoint`` / ``fleet.load_checkpoint`` / ``fleet.auto_checkpoint``:
training checkpoints of the job, and the count of optimizer steps they resume.

A mixin of :class:`~fleetx.fleet.fleet.Fleet`. It hands :mod:`fleetx.checkpoint.training` what
the fleet holds (the user's module, the inner optimizer, every applied strategy's state, the
rank and world size); the format, the re-sharding rules and the verification live there.

It also counts the optimizer steps taken (the updates, not gradient-merge micro-steps or AMP
steps skipped): a checkpoint records the count and a load restores it, so a restarted job knows
where it stands; under fleetrun the count goes to the rank's progress record
(:mod:`fleetx.checkpoint.progress`), from which fleetrun tells what a restart loses.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Mapping, Optional

from fleetx import env
from fleetx.checkpoint.manifest import has_checkpoint
from fleetx.checkpoint.progress import NO_CHECKPOINT, ProgressRecord
from fleetx.fleet.api import FleetError

if TYPE_CHECKING:
    from fleetx.checkpoint.training import TrainingState

__all__ = ["CheckpointCalls"]


def _training() -> Any:
    """:mod:`fleetx.checkpoint.training`, imported at the first save or load: it imports
    ``torch.distributed.checkpoint``, which a process that never checkpoints should not pay
    for at ``import fleetx``."""
    from fleetx.checkpoint import training

    return training


class CheckpointCalls:
    """Training checkpoints (mixed into ``Fleet``)."""

    _steps_taken = 0                 # optimizer steps taken, restored ones included
    _saved_at = NO_CHECKPOINT        # _steps_taken at the last save or load
    _start_step = 0                  # _steps_taken after auto_checkpoint's restore
    _auto: Optional[tuple] = None    # (path, every_steps) of auto_checkpoint
    _progress: Optional[ProgressRecord] = None

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
            fleetx.comm.CommError: another rank did not call it (it went on into a collective of
                its own, called another fleetx collective, or exited): named within a second or
                two, not after the collective timeout.
            TypeError: ``extra`` is not a JSON-able dict.
            fleetx.checkpoint.CheckpointError: a file cannot be written or committed, or
                sharding stage 2 or 3 holds gradients of an unfinished gradient merge
                (save where ``minimize`` returned True).

        Example:
            >>> fleet.save_checkpoint("ckpt", extra={"step": step})   # every rank
        """
        ts = self._training_state("save_checkpoint")
        self._enter("fleet.save_checkpoint")
        ts.steps = self._steps_taken
        _training().save(path, ts, extra)
        self._saved_at = self._steps_taken
        self._record()

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
            fleetx.comm.CommError: another rank did not call it (as for :meth:`save_checkpoint`).
            fleetx.checkpoint.CheckpointError: no checkpoint in ``path``, or a damaged or
                missing file ("checksum mismatch" naming it; nothing is loaded).

        Example:
            >>> step = fleet.load_checkpoint("ckpt")["step"]
        """
        ts = self._training_state("load_checkpoint")
        self._enter("fleet.load_checkpoint")
        extra = _training().load(path, ts)
        self._steps_taken = self._saved_at = ts.steps
        self._record()
        return extra

    def auto_checkpoint(self, path: str, every_steps: int) -> int:
        """Checkpoint automatically into folder ``path`` every ``every_steps`` optimizer steps,
        and resume from it: returns the step to start from (every rank calls, once, after
        ``fleet.distributed_optimizer``).

        When ``path`` holds a checkpoint (a restarted job), the model, the optimizer and every
        applied strategy's state are loaded now, before the first step, and the returned value
        is the number of optimizer steps that checkpoint had taken; otherwise 0. From then on,
        each time the count of optimizer steps (updates, not gradient-merge micro-steps or AMP
        steps skipped) reaches a multiple of ``every_steps``, the fleet saves with
        :meth:`save_checkpoint` when the optimizer next clears the gradients (in ``minimize``
        right after the step), so the checkpoint holds no gradient. Write the loop over steps
        from the returned value, with batches chosen by step, and the resumed run equals an
        uninterrupted one. Not saved: the data loader's position and an LR scheduler's state
        (derive them from the step).

        Args:
            path: the checkpoint folder (created at the first save).
            every_steps: optimizer steps between saves, at least 1.

        Returns:
            The optimizer steps already taken (0 on a fresh start); also :meth:`start_step`.

        Raises:
            ValueError: ``every_steps`` is not a whole number of at least 1.
            FleetError: called before ``fleet.distributed_optimizer``, or twice.
            fleetx.checkpoint.CheckpointError: the checkpoint in ``path`` is damaged (named).

        Example:
            >>> for step in range(fleet.auto_checkpoint("ckpt", every_steps=100), total_steps):
            ...     opt.minimize(loss_of(batch(step)))
        """
        if isinstance(every_steps, bool) or not isinstance(every_steps, int) or every_steps < 1:
            raise ValueError(f"auto_checkpoint(every_steps=...) expects a whole number of "
                             f"optimizer steps of at least 1, got {every_steps!r}")
        optimizer = self._dist_optimizer
        if optimizer is None:
            raise FleetError("fleet.auto_checkpoint() saves the optimizer given to "
                             "fleet.distributed_optimizer(...): call that first")
        if self._auto is not None:
            raise FleetError(f"fleet.auto_checkpoint() was already called (path "
                             f"{self._auto[0]!r}); call it once per job")
        # A process healed into a running job received the live state: a checkpoint is older.
        if has_checkpoint(path) and not getattr(self, "_healed_in", False):
            self.load_checkpoint(path)
        self._auto, self._start_step = (os.fspath(path), every_steps), self._steps_taken
        optimizer.after_zero_grad.append(self._auto_save)
        return self._start_step

    def start_step(self) -> int:
        """The optimizer steps the job had taken when :meth:`auto_checkpoint` restored it (0 on
        a fresh start, or without ``auto_checkpoint``).

        Example:
            >>> first = fleet.start_step()
        """
        return self._start_step

    def _track_steps(self, optimizer: Any) -> None:
        """Count ``optimizer``'s steps (called by ``distributed_optimizer``); under fleetrun,
        keep this rank's progress record. A new optimizer starts a new count."""
        self._steps_taken, self._saved_at, self._start_step, self._auto = 0, NO_CHECKPOINT, 0, None
        optimizer.register_step_post_hook(self._step_taken)
        log_dir = env.get("FLEETX_LOG_DIR")
        # only a collective job's restart reads it (a parameter-server job restarts servers)
        collective = bool(getattr(self._rm("distributed_optimizer"), "is_collective", False))
        if log_dir and collective and self._progress is None:
            try:
                self._progress = ProgressRecord(log_dir, self._rm("distributed_optimizer")
                                                ._worker_index())
            except OSError:  # only fleetrun's report of a restart would miss it
                self._progress = None
        self._record()

    def _step_taken(self, *_: Any) -> None:
        self._steps_taken += 1
        self._record()

    def _auto_save(self) -> None:
        if self._auto is None:  # an optimizer from before the current one
            return
        path, every = self._auto
        if self._steps_taken % every == 0 and self._steps_taken != self._saved_at:
            self.save_checkpoint(path)

    def _enter(self, what: str) -> None:
        """Wait at the entry of the collective call ``what`` until every rank comes; a rank
        that went elsewhere (a save guarded by ``if rank == 0:``) is named at once."""
        comm = getattr(self, "_comm", None)
        if comm is not None:
            comm.enter(what)

    def _record(self) -> None:
        if self._progress is not None:
            self._progress.update(self._steps_taken, self._saved_at)

    def _training_state(self, what: str) -> "TrainingState":
        rm = self._rm(what)
        if not self._models:
            raise FleetError(f"fleet.{what}() saves and loads the model given to "
                             f"fleet.distributed_model(...): call that first")
        optimizer = self._dist_optimizer
        ctx: Any = optimizer._ctx if optimizer is not None else self._context()
        return _training().TrainingState(
            module=self._models[-1].module,
            optimizer=optimizer.inner if optimizer is not None else None,
            strategy_state=ctx.state, rank=rm._worker_index(), world_size=rm._worker_num(),
            strategies=tuple(self.applied_strategies()))
