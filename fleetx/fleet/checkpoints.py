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

import atexit
import functools
import os
import weakref
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional

from fleetx import env
from fleetx.checkpoint import rotation
from fleetx.checkpoint.background import SaveHandle, finished, start
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


def _rotation(path: str, target: str, keep_last: Optional[int]) -> Optional[Callable[[], None]]:
    """What rank 0 runs once ``target`` is committed: keep_last's pointer and pruning."""
    if keep_last is None:
        return None
    return functools.partial(rotation.rotate, os.fspath(path), target, keep_last)


class CheckpointCalls:
    """Training checkpoints (mixed into ``Fleet``)."""

    _steps_taken = 0                 # optimizer steps taken, restored ones included
    _saved_at = NO_CHECKPOINT        # _steps_taken at the last committed save, or the load
    _asked_at = NO_CHECKPOINT        # _steps_taken at the last save called (or the load)
    _start_step = 0                  # _steps_taken after auto_checkpoint's restore
    _auto: Optional[tuple] = None    # (path, every_steps, async_save, keep_last)
    _progress: Optional[ProgressRecord] = None
    _pending: Optional[SaveHandle] = None   # the last asynchronous save, until waited for
    _staging: Any = None             # DCP's stager: its CPU buffers are reused by each save
    _exit_hook = False
    _stragglers: Any = None          # the StragglerWatch of the current optimizer

    def save_checkpoint(self, path: str, extra: Optional[Mapping] = None,
                        async_save: bool = False,
                        keep_last: Optional[int] = None) -> SaveHandle:
        """Save the model, the optimizer and every applied strategy's state into folder
        ``path`` (every rank calls; a collective).

        Parameters, optimizer moments and step counts are saved through
        ``torch.distributed.checkpoint`` (each rank writes its share); strategy state (loss
        scale, Local SGD counters, DGC buffers, gradients still being merged) and the position
        of each loader of :meth:`distributed_loader` per rank. The
        save is committed with a manifest of SHA-256 hashes: saving again to the same folder
        replaces the checkpoint atomically, and a crash during a save leaves the previous one.

        With ``async_save=True`` the call copies this rank's share of the state into CPU
        memory and returns; the files are written, hashed and committed on a background
        thread while training goes on (its collectives use a gloo group of their own, never
        the training group). The copy is kept for the next save to reuse: an asynchronous
        save holds one more copy of the rank's share of the state in memory. A second save
        (either kind), :meth:`load_checkpoint` and the exit of the process wait for a pending
        one; the error of a save nobody waited for is raised by the next of those.

        With ``keep_last=k`` each save goes to its own folder ``path/step-<n>/`` (n: the
        optimizer steps taken), ``path/latest`` names the newest, and all but the newest k
        are removed after each commit; :meth:`load_checkpoint` (path) loads the newest.

        Args:
            path: the checkpoint folder (created if needed).
            extra: a JSON-able dict returned by :meth:`load_checkpoint` (``{"step": 500}``).
            async_save: write on a background thread (default: before returning).
            keep_last: keep the newest this many checkpoints in ``step-<n>/`` sub-folders
                (default None: one checkpoint in ``path``, replaced by each save).

        Returns:
            The save's handle: ``done()`` says whether it is finished, ``wait()`` waits and
            returns the committed manifest or raises the save's error. A synchronous save's
            handle is finished already.

        Raises:
            FleetError: called before ``fleet.distributed_model``.
            fleetx.comm.CommError: another rank did not call it (it went on into a collective of
                its own, called another fleetx collective, or exited): named within a second or
                two, not after the collective timeout.
            TypeError: ``extra`` is not a JSON-able dict, or ``async_save`` is not a bool.
            ValueError: ``keep_last`` is not None or a whole number of at least 1.
            fleetx.checkpoint.CheckpointError: a file cannot be written or committed (raised
                by ``wait()`` for an asynchronous save), the previous asynchronous save failed,
                ``path`` holds the other layout (with or without ``keep_last``), or sharding
                stage 2 or 3 holds gradients of an unfinished gradient merge (save where
                ``minimize`` returned True).

        Example:
            >>> fleet.save_checkpoint("ckpt", extra={"step": step})   # every rank
            >>> handle = fleet.save_checkpoint("ckpt", async_save=True, keep_last=3)
            >>> handle.wait()                                         # optional
        """
        keep_last = rotation.check_keep_last(keep_last)
        if not isinstance(async_save, bool):
            raise TypeError(f"save_checkpoint(async_save=...) expects True or False, got "
                            f"{async_save!r}")
        ts = self._training_state("save_checkpoint")
        self._wait_for_save()
        rotation.check_layout(path, keep_last)
        self._enter("fleet.save_checkpoint")
        ts.steps = steps = self._asked_at = self._steps_taken
        target = os.fspath(path) if keep_last is None else rotation.folder(path, steps)
        training = _training()
        if not async_save:
            staged = training.stage(target, ts, extra)
            staged.on_commit = _rotation(path, target, keep_last)
            manifest = training.write(staged)
            self._saved(steps)
            return finished(target, manifest)
        staged = training.stage(target, ts, extra, stager=self._stager(),
                                group=self._save_group())
        staged.on_commit = _rotation(path, target, keep_last)
        self._pending = start(target, lambda: training.write(staged),
                              then=lambda _: self._saved(steps))
        self._wait_at_exit()
        return self._pending

    def load_checkpoint(self, path: str) -> dict:
        """Load what :meth:`save_checkpoint` saved into the model and optimizer given to
        ``distributed_model`` / ``distributed_optimizer`` (every rank calls; a collective).

        Loads at any world size and under another strategy (sharding on or off, another
        stage): parameters, optimizer moments, step counts and the loss scale exactly. Per-rank
        state: at the same world size each rank loads its own; at another, every rank takes
        rank 0's counters and per-rank tensors (DGC residuals and momentum, gradients being
        merged) start afresh (see :mod:`fleetx.checkpoint.training`). Each loader of
        :meth:`distributed_loader` continues where it stood; at another world size the rest of
        its epoch is split among the new ranks. A folder of checkpoints kept by ``keep_last``
        loads its newest committed one. A pending asynchronous save is waited for first.

        Returns:
            The ``extra`` dict given to :meth:`save_checkpoint` (``{}`` if none).

        Raises:
            FleetError: called before ``fleet.distributed_model``.
            fleetx.comm.CommError: another rank did not call it (as for :meth:`save_checkpoint`).
            fleetx.checkpoint.CheckpointError: no checkpoint in ``path``, or a damaged or
                missing file ("checksum mismatch" naming it; nothing is loaded), or data loader
                positions that do not fit the loaders built (another number of them, another
                dataset length, shuffle or seed; ranks that stood at different positions, at
                another world size), or the pending asynchronous save failed.

        Example:
            >>> step = fleet.load_checkpoint("ckpt")["step"]
        """
        ts = self._training_state("load_checkpoint")
        self._wait_for_save()
        self._enter("fleet.load_checkpoint")
        extra = _training().load(rotation.resolve(path), ts)
        self._steps_taken = self._saved_at = self._asked_at = ts.steps
        self._loaded_loaders(ts.saved_loaders)
        self._record()
        return extra

    def auto_checkpoint(self, path: str, every_steps: int, async_save: bool = False,
                        keep_last: Optional[int] = None) -> int:
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
        uninterrupted one. The position of every loader built with :meth:`distributed_loader`
        before this call is saved and restored too; not saved: an LR scheduler's state
        (derive it from the step).

        Args:
            path: the checkpoint folder (created at the first save).
            every_steps: optimizer steps between saves, at least 1.
            async_save: each save writes on a background thread (see :meth:`save_checkpoint`);
                the next one, a load and the exit wait for it.
            keep_last: keep the newest this many checkpoints (see :meth:`save_checkpoint`).

        Returns:
            The optimizer steps already taken (0 on a fresh start); also :meth:`start_step`.

        Raises:
            ValueError: ``every_steps`` is not a whole number of at least 1, or ``keep_last``
                is not None or one.
            TypeError: ``async_save`` is not a bool.
            FleetError: called before ``fleet.distributed_optimizer``, or twice.
            fleetx.checkpoint.CheckpointError: the checkpoint in ``path`` is damaged (named).

        Example:
            >>> for step in range(fleet.auto_checkpoint("ckpt", every_steps=100), total_steps):
            ...     opt.minimize(loss_of(batch(step)))
        """
        if isinstance(every_steps, bool) or not isinstance(every_steps, int) or every_steps < 1:
            raise ValueError(f"auto_checkpoint(every_steps=...) expects a whole number of "
                             f"optimizer steps of at least 1, got {every_steps!r}")
        keep_last = rotation.check_keep_last(keep_last)
        if not isinstance(async_save, bool):
            raise TypeError(f"auto_checkpoint(async_save=...) expects True or False, got "
                            f"{async_save!r}")
        optimizer = self._dist_optimizer
        if optimizer is None:
            raise FleetError("fleet.auto_checkpoint() saves the optimizer given to "
                             "fleet.distributed_optimizer(...): call that first")
        if self._auto is not None:
            raise FleetError(f"fleet.auto_checkpoint() was already called (path "
                             f"{self._auto[0]!r}); call it once per job")
        # A process healed into a running job received the live state: a checkpoint is older.
        if rotation.has_checkpoint(path) and not getattr(self, "_healed_in", False):
            self.load_checkpoint(path)
        self._auto = (os.fspath(path), every_steps, async_save, keep_last)
        self._start_step = self._steps_taken
        optimizer.after_zero_grad.append(self._auto_save)
        optimizer._ctx.restore_checkpoint = self._restore_auto  # the anomaly guard's rollback
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
        self._steps_taken, self._start_step, self._auto = 0, 0, None
        self._saved_at = self._asked_at = NO_CHECKPOINT
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
        self._watch_stragglers(optimizer, log_dir if collective else None)
        self._record()

    def _watch_stragglers(self, optimizer: Any, log_dir: Optional[str]) -> None:
        """Time ``optimizer``'s steps: name stragglers, keep the step times for fleetrun
        (:mod:`fleetx.fleet.stragglers`)."""
        from fleetx.fleet.stragglers import StragglerWatch
        from fleetx.observe.steptimes import StepTimes

        if self._stragglers is not None:
            self._stragglers.close()
        rm = self._rm("distributed_optimizer")
        collective = bool(getattr(rm, "is_collective", False))
        record = None
        if log_dir:
            try:
                record = StepTimes(log_dir, rm._worker_index())
            except OSError:  # only fleetrun's table would miss it
                record = None
        window = env.get_int("FLEETX_STRAGGLER_WINDOW")
        if window < 0:
            raise env.EnvError(f"FLEETX_STRAGGLER_WINDOW={window} must be 0 (off) or a number of "
                               f"optimizer steps")
        if env.get("FLEETX_FAULT_TOLERANCE") == "heal":
            # its group spans the ranks of the start, which a heal replaces; the step times
            # are still kept for fleetrun's table
            window = 0
        self._stragglers = StragglerWatch(
            optimizer, rm._worker_index(), rm._worker_num() if collective else 1, window, record,
            env.timeout(), steps=lambda: self._steps_taken)

    def _step_taken(self, *_: Any) -> None:
        self._steps_taken += 1
        self._record()

    def _auto_save(self) -> None:
        if self._auto is None:  # an optimizer from before the current one
            return
        path, every, async_save, keep_last = self._auto
        if self._steps_taken % every == 0 and self._steps_taken != self._asked_at:
            self.save_checkpoint(path, async_save=async_save, keep_last=keep_last)

    def _saved(self, steps: int) -> None:
        """A save taken at ``steps`` is committed (on the save's thread when asynchronous)."""
        self._saved_at = steps
        self._record()

    def _wait_for_save(self) -> None:
        """Wait for the pending asynchronous save; raise its error, unless its handle's
        ``wait()`` raised it already."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.settle()

    def _wait_at_exit(self) -> None:
        """At the exit of the process, wait for a pending save (once registered per fleet,
        after the fleet's own shutdown, which therefore runs later: handlers run last first).
        A failure is printed by the exit as any exit handler's error."""
        if self._exit_hook:
            return
        self._exit_hook = True
        ref = weakref.ref(self)

        def wait() -> None:
            live = ref()
            if live is not None:
                live._wait_for_save()
        atexit.register(wait)

    def _stager(self) -> Any:
        """DCP's stager, made once: each save copies into the CPU buffers of the last."""
        if self._staging is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
            self._staging = DefaultStager(StagingOptions(
                use_pinned_memory=False, use_shared_memory=False, use_async_staging=False,
                use_non_blocking_copy=False))
        return self._staging

    def _save_group(self) -> Any:
        """The gloo group of checkpoint traffic (None alone): a background write must not
        run collectives on the group the training loop uses."""
        comm = self._communicator()
        return comm.side_group("checkpoint") if comm is not None else None

    def _restore_auto(self) -> Optional[int]:
        """Load the last checkpoint of ``auto_checkpoint``'s folder; its step, or None when
        none was saved yet (every rank calls)."""
        if self._auto is None or not rotation.has_checkpoint(self._auto[0]):
            return None
        self.load_checkpoint(self._auto[0])
        return self._steps_taken

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
            strategies=tuple(self.applied_strategies()),
            loaders=self._loaders)
