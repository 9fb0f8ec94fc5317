"""The anomaly guard (``strategy.anomaly_guard``, a fleetx extension): a NaN, an inf or a loss
spike skips the update instead of ruining the run.

Before every optimizer step the guard judges what this step would apply:

* a loss that is NaN or inf, on any rank;
* gradients that hold NaN or inf, on any rank (``check_gradients``; under ``amp`` the loss
  scaler judges the gradients, see below);
* a *spike*: the job's loss (the mean over the ranks of each rank's loss, a gradient-merge
  update's micro-steps averaged) above ``spike_factor`` times the median of the last ``window``
  accepted losses, once ``min_history`` of them exist (a median at or below zero never makes a
  spike).

Every rank sends its own findings in one small all-gather and every rank judges the gathered
reports alike, so a NaN on one rank skips the step on all of them and their parameters stay
equal. A skipped step is counted (``optimizer.anomalies()``) and named in one warning line on
each rank (logger ``fleetx``), with the step, the rank and, for a loss, the batch: the index of
that loss among those this process gave the optimizer (0-based). After ``max_consecutive``
skipped steps in a row the guard rolls back: to the last in-memory snapshot (``rollback =
"memory"``: a CPU copy of the model, the optimizer and the strategies' state taken every
``snapshot_every`` accepted steps), to the last checkpoint of ``fleet.auto_checkpoint``
(``"disk"``), or not at all (``"none"``), and says so. Training then goes on with the next
batch: the batches since the snapshot are not replayed, and the guard's own counts are kept.

How the loss reaches it: ``optimizer.minimize(loss)`` and ``optimizer.backward(loss)`` show it
the loss (the context's ``loss_listeners``). With ``loss.backward(); optimizer.step()`` it never
sees the loss and judges the gradients only.

How it maps onto PyTorch: a step guard of the training context (the step is not taken, as for
amp's overflow), placed after gradient merge's boundary guard (so it judges whole updates) and
before amp's. With amp, the loss scaler keeps skipping steps whose *scaled gradients*
overflow: those are amp's (its scale shrinks; the guard does not count them), while a NaN or
inf *loss* or a spike is the guard's (amp never sees that step, so its scale does not move);
no step is counted twice.
"""
from __future__ import annotations

import copy
import logging
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from fleetx.parallel.api import is_dtensor
from fleetx.strategy.algorithms.adaptive_localsgd import AdaptiveLocalSGDStrategy
from fleetx.strategy.algorithms.amp import AmpStrategy
from fleetx.strategy.algorithms.data_parallel import DataParallelStrategy
from fleetx.strategy.algorithms.gradient_merge import GradientMergeStrategy
from fleetx.strategy.algorithms.localsgd import LocalSGDStrategy
from fleetx.strategy.api import (Mode, PlanInput, Strategy, StrategyError, TrainingContext,
                                 Verdict, register)
from fleetx.strategy.config import Config, option

__all__ = ["AnomalyGuardConfig", "AnomalyGuardStrategy", "RankReport", "Finding", "judge"]

log = logging.getLogger("fleetx")

ROLLBACKS = ("memory", "disk", "none")


@dataclass
class AnomalyGuardConfig(Config):
    """``strategy.anomaly_guard_configs``: what counts as an anomaly, and what follows.

    Example:
        >>> AnomalyGuardConfig(spike_factor=5.0).rollback
        'memory'
    """

    section = "anomaly_guard_configs"

    spike_factor: float = option(
        10.0, "A loss above this many times the median of the recent accepted losses is a "
        "spike: the step is skipped.", gt=1)
    window: int = option(50, "Accepted losses the running median is taken over.", ge=1)
    min_history: int = option(
        5, "Accepted losses needed before spikes are judged (NaN and inf always are).", ge=1)
    check_gradients: bool = option(
        True, "Also skip a step whose gradients hold NaN or inf (one norm of the gradients per "
        "step; under amp the loss scaler judges them).")
    max_consecutive: int = option(3, "Roll back after this many skipped steps in a row.", ge=1)
    rollback: str = option(
        "memory", "Where to roll back to: memory (the last CPU snapshot), disk (the last "
        "checkpoint of fleet.auto_checkpoint) or none (keep skipping).", choices=ROLLBACKS)
    snapshot_every: int = option(
        50, "With rollback 'memory': accepted steps between CPU snapshots of the model, the "
        "optimizer and the strategies' state.", ge=1)


@dataclass(frozen=True)
class RankReport:
    """What one rank found before a step.

    Attributes:
        loss: the mean of its losses since the last step (None: it saw no loss, or a
            non-finite one).
        bad_loss_batch: the batch index of its first NaN/inf loss, or None.
        bad_gradients: its gradients hold NaN or inf.
    """

    loss: Optional[float]
    bad_loss_batch: Optional[int] = None
    bad_gradients: bool = False

    def encode(self) -> list[float]:
        return [float("nan") if self.loss is None else self.loss,
                -1.0 if self.bad_loss_batch is None else float(self.bad_loss_batch),
                1.0 if self.bad_gradients else 0.0]

    @classmethod
    def decode(cls, row: Sequence[float]) -> "RankReport":
        loss, batch, grads = (float(v) for v in row)
        return cls(None if loss != loss else loss, None if batch < 0 else int(batch), grads > 0)


@dataclass(frozen=True)
class Finding:
    """Why a step is skipped: ``what`` in words, the ``rank`` and ``batch`` where known."""

    what: str
    rank: Optional[int] = None
    batch: Optional[int] = None


def judge(reports: Sequence[RankReport], history: Sequence[float], cfg: AnomalyGuardConfig
          ) -> tuple[Optional[Finding], Optional[float]]:
    """Pure: the verdict on one step from every rank's report (rank order), and the job's loss.

    The arithmetic is float64 (Python floats): the median, the threshold and the comparison.

    Returns:
        (None, job loss) to take the step (the loss is None when no rank saw one), or
        (the finding, job loss) to skip it.

    Example:
        >>> cfg = AnomalyGuardConfig(spike_factor=10.0, min_history=2)
        >>> judge([RankReport(1.0), RankReport(30.0)], [1.0, 1.5], cfg)[0].what
        'the loss 15.5 is 12.4x the median 1.25 of the last 2 accepted losses'
    """
    for rank, report in enumerate(reports):
        if report.bad_loss_batch is not None:
            return Finding("the loss is NaN or inf", rank, report.bad_loss_batch), None
    for rank, report in enumerate(reports):
        if report.bad_gradients:
            return Finding("the gradients hold NaN or inf", rank), None
    losses = [r.loss for r in reports]
    if any(v is None for v in losses):
        return None, None
    loss = statistics.fmean(losses)
    if len(history) >= cfg.min_history:
        median = statistics.median(history)
        if median > 0 and loss > cfg.spike_factor * median:
            rank = max(range(len(losses)), key=lambda r: losses[r])
            return Finding(f"the loss {loss:.6g} is {loss / median:.3g}x the median "
                           f"{median:.6g} of the last {len(history)} accepted losses", rank), loss
    return None, loss


@dataclass
class GuardState:
    """The guard's counters and recent losses (saved with the optimizer)."""

    window: int
    skipped: int = 0          # steps skipped, all told
    rollbacks: int = 0
    consecutive: int = 0      # skipped in a row, since the last accepted step or rollback
    steps: int = 0            # optimizer steps judged (0-based index of the next one)
    accepted: int = 0
    batches: int = 0          # losses seen (0-based index of the next one)
    history: deque = field(default_factory=deque)

    def __post_init__(self) -> None:
        self.history = deque(self.history, maxlen=self.window)

    def stats(self) -> dict:
        """``optimizer.anomalies()``: ``skipped``, ``rollbacks``, ``consecutive``."""
        return {"skipped": self.skipped, "rollbacks": self.rollbacks,
                "consecutive": self.consecutive}

    def state_dict(self) -> dict:
        return {"skipped": self.skipped, "rollbacks": self.rollbacks,
                "consecutive": self.consecutive, "steps": self.steps, "accepted": self.accepted,
                "batches": self.batches, "history": list(self.history)}

    def load_state_dict(self, state: dict) -> None:
        for key in ("skipped", "rollbacks", "consecutive", "steps", "accepted", "batches"):
            setattr(self, key, int(state[key]))
        self.history = deque((float(v) for v in state["history"]), maxlen=self.window)


@register
class AnomalyGuardStrategy(Strategy):
    """Skip the updates of NaN/inf losses or gradients and loss spikes; roll back after a run."""

    name = "anomaly_guard"
    config = AnomalyGuardConfig
    # It judges whole updates (after gradient merge's boundary guard), and a loss it refuses
    # must not reach amp's scaler (before amp's guard).
    runs_after = (DataParallelStrategy, GradientMergeStrategy, LocalSGDStrategy,
                  AdaptiveLocalSGDStrategy)
    runs_before = (AmpStrategy,)
    heal_fallback = ("its verdict is an all-gather over every rank at each step, outside the "
                     "healing all-reduce")

    def can_apply(self, plan_input: PlanInput) -> Verdict:
        if plan_input.world.mode is not Mode.COLLECTIVE:
            return Verdict.fail("runs in collective mode only (parameter servers apply the "
                                "pushes; see FLEETX_PS_NONFINITE)")
        cfg = self.strategy.typed_config(self.name)
        back = {"memory": f"the CPU snapshot kept every {cfg.snapshot_every} accepted steps",
                "disk": "the last checkpoint of fleet.auto_checkpoint",
                "none": "nowhere (steps keep being skipped)"}[cfg.rollback]
        return Verdict.ok(f"skips NaN/inf and losses above {cfg.spike_factor:g}x the median of "
                          f"{cfg.window}; after {cfg.max_consecutive} in a row rolls back to "
                          f"{back}")

    def apply(self, ctx: TrainingContext) -> None:
        cfg = self.strategy.typed_config(self.name)
        guard = _Guard(ctx, cfg)
        ctx.state[self.name] = guard.state
        ctx.loss_listeners.append(guard.on_loss)
        ctx.step_guards.append(guard.guard)
        ctx.after_step.append(guard.after_step)
        ctx.optimizer_methods["anomalies"] = guard.state.stats


class _Guard:
    """The loss listener, the step guard and the rollback of one training context."""

    def __init__(self, ctx: TrainingContext, cfg: AnomalyGuardConfig) -> None:
        self.ctx, self.cfg = ctx, cfg
        # read once: the step path then pays no config lookups
        self.rollback, self.max_consecutive = cfg.rollback, cfg.max_consecutive
        self.snapshot_every, self.check_gradients = cfg.snapshot_every, cfg.check_gradients
        self.state = GuardState(cfg.window)
        self.pending: list[tuple[int, torch.Tensor]] = []  # (batch, loss) since the last step
        self.snapshot: Optional[tuple[int, dict]] = None    # (accepted steps, CPU copy)
        self.rollback_due = False
        self.accepted_now = False

    def on_loss(self, loss: Any) -> None:
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            self.pending.append((self.state.batches, loss.detach().reshape(())))
        self.state.batches += 1

    def guard(self) -> bool:
        if self.rollback == "disk" and self.ctx.restore_checkpoint is None:
            raise StrategyError(
                "anomaly_guard_configs['rollback'] = 'disk' rolls back to the checkpoint of "
                "fleet.auto_checkpoint(path, every_steps): call it before training, or choose "
                "rollback 'memory' or 'none'")
        if self.rollback == "memory" and self.snapshot is None:
            self.snapshot = (self.state.accepted, self._copy())
        reports = self._gather(self._report())
        finding, loss = judge(reports, self.state.history, self.cfg)
        step = self.state.steps
        self.state.steps += 1
        self.accepted_now = finding is None
        if finding is None:
            self.state.consecutive = 0
            self.state.accepted += 1
            if loss is not None:
                self.state.history.append(loss)
            return True
        self._skip(step, finding)
        return False

    def _report(self) -> RankReport:
        pending, self.pending = self.pending, []
        loss, bad_batch = None, None
        if pending:
            values = torch.stack([v for _, v in pending]).double()
            finite = torch.isfinite(values)
            if bool(finite.all()):
                loss = float(values.mean())
            else:
                bad_batch = pending[int((~finite).nonzero()[0])][0]
        # Under amp the gradients still carry the loss scale here: an overflow is the scaler's
        # to judge (it skips the step and shrinks the scale).
        check = self.check_gradients and "amp" not in self.ctx.state
        return RankReport(loss, bad_batch, check and not self._gradients_finite())

    def _gradients_finite(self) -> bool:
        grads = [p.grad for g in self.ctx.optimizer.param_groups for p in g["params"]
                 if p.grad is not None]
        if not grads:
            return True
        grads = [g.to_local() if is_dtensor(g) else g for g in grads]
        norms = torch.stack([torch.linalg.vector_norm(g.detach(), dtype=torch.float32)
                             for g in grads])
        return bool(torch.isfinite(norms).all())

    def _gather(self, report: RankReport) -> list[RankReport]:
        world = self.ctx.world.world_size
        if world == 1 or not dist.is_initialized():
            return [report]
        device = _device(self.ctx.optimizer)
        mine = torch.tensor(report.encode(), dtype=torch.float64, device=device)
        rows = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(rows, mine)
        return [RankReport.decode(row.tolist()) for row in rows]

    def _skip(self, step: int, finding: Finding) -> None:
        s = self.state
        s.skipped += 1
        s.consecutive += 1
        where = [f"rank {finding.rank}"] if finding.rank is not None else []
        if finding.batch is not None:
            where.append(f"batch {finding.batch}")
        then = ""
        if s.consecutive >= self.max_consecutive and self.rollback != "none":
            self.rollback_due = True
            then = "; rolling back"
        log.warning("fleetx: anomaly guard skipped step %d (%s): %s; %d step(s) skipped so far, "
                    "%d in a row (rollback after %d)%s", step, ", ".join(where), finding.what,
                    s.skipped, s.consecutive, self.max_consecutive, then)

    def after_step(self) -> None:
        # After gradient merge's phase advanced (it runs first): a snapshot or a rollback here
        # sits on an update boundary.
        if self.rollback_due:
            self.rollback_due = False
            self._roll_back()
        elif (self.accepted_now and self.rollback == "memory"
              and self.state.accepted % self.snapshot_every == 0):
            self.snapshot = (self.state.accepted, self._copy())
        self.accepted_now = False

    def _roll_back(self) -> None:
        s = self.state
        run = s.consecutive
        if self.rollback == "memory":
            at, copied = self.snapshot
            self._restore(_cpu_copy(copied))  # a fresh copy: the optimizer keeps what it loads
            to = f"the in-memory snapshot taken after {at} accepted step(s)"
        else:
            kept = s.state_dict()  # the checkpoint holds older counts of the guard: keep these
            loaded = self.ctx.restore_checkpoint()
            s.load_state_dict(kept)
            to = (f"the checkpoint of step {loaded}" if loaded is not None else
                  "nothing: fleet.auto_checkpoint has saved no checkpoint yet")
        s.rollbacks += 1
        s.consecutive = 0
        log.warning("fleetx: anomaly guard: %d step(s) skipped in a row; rolled back to %s "
                    "(rollback %d); training goes on with the next batch", run, to, s.rollbacks)

    def _copy(self) -> dict:
        ctx = self.ctx
        return _cpu_copy({
            "model": ctx.model.state_dict() if ctx.model is not None else None,
            "optimizer": ctx.optimizer.state_dict(),
            "strategies": {k: v.state_dict() for k, v in ctx.state.items()
                           if v is not self.state and hasattr(v, "state_dict")}})

    def _restore(self, snap: dict) -> None:
        ctx = self.ctx
        if snap["model"] is not None:
            ctx.model.load_state_dict(snap["model"])
        ctx.optimizer.load_state_dict(snap["optimizer"])
        for key, value in snap["strategies"].items():
            ctx.state[key].load_state_dict(value)


def _device(optimizer: Any) -> torch.device:
    for group in optimizer.param_groups:
        for p in group["params"]:
            return p.device
    return torch.device("cpu")


def _cpu_copy(value: Any) -> Any:
    """A deep copy of ``value`` whose tensors are fresh CPU tensors."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return type(value)((k, _cpu_copy(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return type(value)(_cpu_copy(v) for v in value)
    return copy.deepcopy(value)
