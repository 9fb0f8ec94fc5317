"""Automatic strategy choice (``strategy.auto``): measure a few candidate plans, keep the fastest
that fits in memory.

With ``strategy.auto = True`` the plan holds only this strategy until the first training forward
of the wrapped model. There, on the user's own batch, every candidate plan runs a few real steps
(forward, a surrogate loss, backward, optimizer step) on deep copies of the model and optimizer,
through the same planner and the same ``apply`` as a plan the user writes. Each candidate is
timed (seconds per step) and its memory per rank counted: parameter, gradient and optimizer bytes
held by this process (local shards only) plus the bytes saved for backward during the forward.

The rule: **the fastest measured plan whose measured per-rank memory fits the budget**. The
budget is ``FLEETX_AUTO_MEMORY_MB`` when set, else the free memory of this process's device now
(CUDA ``mem_get_info``; on CPU ``MemAvailable`` of ``/proc/meminfo`` divided among the node's
processes) plus what the real model and optimizer already hold. When no plan fits, the one with
the least memory is taken, with a warning. Every rank runs every candidate (they communicate);
the memory figures are the largest over ranks, the budget the smallest, the timings rank 0's; rank
0's choice is broadcast, so all ranks run the same plan. ``fleet.explain()`` then prints every
candidate with its figures and why the winner won.

What is searched: the switches the user did not set (``strategy.is_set``) among ``amp``,
``recompute`` (of the children of the model's largest ``nn.Sequential`` / ``nn.ModuleList``) and
``sharding`` (stages 1, 2 and 3, with more than one process, once sharding has an effect); data
parallel applies whenever there is more than one process. A switch the user set keeps its value
in every candidate. ``gradient_merge`` is never switched on by auto: each of the user's batches
is one micro-step, so merging would change what one update averages (k times the batch) and how
many updates the job makes; set it yourself, and auto keeps it.
"""
from __future__ import annotations

import copy
import itertools
import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from fleetx.strategy.api import (Mode, ModelInfo, PlanInput, Strategy, StrategyError,
                                 TrainingContext, Verdict, register)
from fleetx.strategy.measured import measure

__all__ = ["AutoStrategy", "Candidate", "Measurement", "SearchReport", "candidates", "choose",
           "repeated_blocks", "memory_budget", "held_bytes", "BUDGET_VARIABLE"]

BUDGET_VARIABLE = "FLEETX_AUTO_MEMORY_MB"
_MIB = 1024 * 1024
# The switches auto may turn on, in the order a candidate's name lists them.
_SEARCHED = ("amp", "recompute", "sharding")
# A few steps on a shared machine time a plan to within several per cent, not better: plans
# within this fraction of the fastest (or within the two plans' step-to-step spread, when that
# is wider) count as equally fast, and the one that switches on the fewest strategies wins among
# them (a plain plan is not traded for noise).
NOISE = 0.10


@dataclass(frozen=True)
class Candidate:
    """One plan auto measures: a name and the strategy it runs (``auto`` off)."""

    name: str
    strategy: Any  # DistributedStrategy
    size: int = 0  # strategies auto switched on


@dataclass(frozen=True)
class Measurement:
    """What a few real steps of one candidate cost on this rank.

    Attributes:
        seconds: median seconds per training step (forward, backward, optimizer step).
        state_bytes: parameter + gradient + optimizer bytes held by this process.
        saved_bytes: bytes saved for backward during one forward.
        error: why the candidate could not run (out of memory), else ``""``.
        spread: slowest minus fastest of the timed steps (how noisy ``seconds`` is).
    """

    seconds: float
    state_bytes: int
    saved_bytes: int
    error: str = ""
    spread: float = 0.0

    @property
    def peak_bytes(self) -> int:
        return self.state_bytes + self.saved_bytes


def repeated_blocks(model: ModelInfo) -> tuple[str, ...]:
    """The children of the model's largest ``nn.Sequential`` / ``nn.ModuleList``: the
    sub-modules named ``<container>.<index>`` (or ``<index>`` at the top level) under the
    container with the most of them; empty when no container has two.

    Example:
        >>> repeated_blocks(ModelInfo(module_names=("", "emb", "blocks", "blocks.0", "blocks.1")))
        ('blocks.0', 'blocks.1')
    """
    children: dict[str, list[str]] = {}
    for name in model.module_names:
        parent, _, last = name.rpartition(".")
        if name and last.isdigit():
            children.setdefault(parent, []).append(name)
    if not children:
        return ()
    parent = max(sorted(children), key=lambda p: len(children[p]))
    return tuple(children[parent]) if len(children[parent]) >= 2 else ()


def _searchable(strategy: Any, name: str) -> bool:
    from fleetx.strategy.fields import TopLevelConfig  # fields imports the strategy modules
    return not strategy.is_set(name) and not TopLevelConfig.specs()[name].no_effect


def _choices(base: Any, plan_input: PlanInput) -> list[list[tuple[str, Any]]]:
    """Per searched switch, its options as ``(label, settings)``; settings is a dict of strategy
    fields to assign, ``{}`` meaning "leave it off"."""
    dims = []
    if _searchable(base, "amp"):
        dims.append([("", {}), ("amp", {"amp": True})])
    blocks = repeated_blocks(plan_input.model)
    if _searchable(base, "recompute") and blocks:
        dims.append([("", {}), ("recompute", {"recompute": True,
                                              "recompute_configs": {"checkpoints": list(blocks)}})])
    if _searchable(base, "sharding") and plan_input.world.world_size > 1:
        from fleetx.strategy.algorithms.sharding import ShardingConfig
        if "stage" in ShardingConfig.specs():
            dims.append([("", {})] + [(f"sharding stage {k}", {
                "sharding": True, "sharding_configs": {"stage": k}}) for k in (1, 2, 3)])
    return dims


def candidates(base: Any, plan_input: PlanInput) -> list[Candidate]:
    """Every combination of the searched switches that the planner accepts, plain first.

    Pure: builds strategies and plans, runs nothing. A combination the planner refuses (a
    conflict with a switch the user set) is left out. Each is planned with
    ``plan_input.planner`` (the planner passes itself there; this module cannot import it,
    since the planner imports every strategy).

    Raises:
        StrategyError: ``plan_input`` carries no planner.
    """
    make_plan = plan_input.planner
    if make_plan is None:
        raise StrategyError("auto: plans its candidates with PlanInput.planner, which "
                            "make_plan sets; build the PlanInput with planner=make_plan")
    found = []
    for combo in itertools.product(*_choices(base, plan_input)):
        strategy = copy.deepcopy(base)
        strategy.auto = False
        for _, settings in combo:
            for field, value in settings.items():
                setattr(strategy, field, value)
        try:
            make_plan(PlanInput(strategy, plan_input.world, plan_input.model,
                                plan_input.optimizer, make_plan))
        except StrategyError:
            continue
        labels = [label for label, _ in combo if label]
        plain = "data parallel" if plan_input.world.world_size > 1 else "plain"
        found.append(Candidate(" + ".join(labels) or plain, strategy, len(labels)))
    return found


@dataclass(frozen=True)
class SearchReport:
    """The outcome of a search: every candidate's figures, the budget, the winner and why."""

    names: tuple[str, ...]
    measurements: tuple[Measurement, ...]
    budget_bytes: int
    budget_source: str
    winner: int
    reason: str

    @property
    def winner_name(self) -> str:
        return self.names[self.winner]

    def __str__(self) -> str:
        lines = [f"fleetx auto: chose {self.winner_name!r}: {self.reason}",
                 f"  budget {self.budget_bytes / _MIB:.1f} MiB per rank ({self.budget_source})",
                 f"  {'candidate':<40} {'ms/step':>9} {'state MiB':>10} {'saved MiB':>10} "
                 f"{'peak MiB':>9}  fits"]
        for i, (name, m) in enumerate(zip(self.names, self.measurements)):
            mark = "*" if i == self.winner else " "
            if m.error:
                lines.append(f"{mark} {name:<40} {m.error}")
                continue
            fits = "yes" if m.peak_bytes <= self.budget_bytes else "no"
            lines.append(f"{mark} {name:<40} {m.seconds * 1e3:9.2f} {m.state_bytes / _MIB:10.3f} "
                         f"{m.saved_bytes / _MIB:10.3f} {m.peak_bytes / _MIB:9.3f}  {fits}")
        return "\n".join(lines)


def choose(names: Sequence[str], measurements: Sequence[Measurement], budget_bytes: int,
           budget_source: str = "given", sizes: Optional[Sequence[int]] = None) -> SearchReport:
    """The fastest candidate whose peak bytes fit ``budget_bytes``; with none fitting, the one
    with the fewest peak bytes. Pure.

    Candidates within :data:`NOISE` of the fastest fitting one count as equally fast; among
    them the smallest ``sizes`` (strategies switched on; default all 0), then the fastest, wins.

    Raises:
        ValueError: no candidates, or names and measurements differ in number.
    """
    if not names or len(names) != len(measurements):
        raise ValueError(f"choose needs one measurement per candidate, got {len(names)} "
                         f"names and {len(measurements)} measurements")
    ran = [i for i, m in enumerate(measurements) if not m.error]
    fits = [i for i in ran if measurements[i].peak_bytes <= budget_bytes]
    sizes = list(sizes) if sizes is not None else [0] * len(names)
    if fits:
        best = min(fits, key=lambda i: (measurements[i].seconds, i))
        fastest = measurements[best].seconds

        def near(i: int) -> bool:
            m = measurements[i]
            noise = max(NOISE * fastest, m.spread + measurements[best].spread)
            return m.seconds - fastest <= noise

        winner = min((i for i in fits if near(i)),
                     key=lambda i: (sizes[i], measurements[i].seconds, i))
        others = [i for i in fits if i != winner]
        if others:
            runner = min(others, key=lambda i: measurements[i].seconds)
            lead = "fastest" if measurements[winner].seconds == fastest else \
                "as fast as the fastest within the timing noise, and the simplest"
            reason = (f"{lead} of the {len(fits)} plans that fit the budget "
                      f"({measurements[winner].seconds * 1e3:.2f} ms/step; next "
                      f"{names[runner]!r} {measurements[runner].seconds * 1e3:.2f} ms/step)")
        else:
            reason = (f"the only plan that fits the budget "
                      f"({measurements[winner].peak_bytes / _MIB:.3f} MiB per rank)")
        if len(fits) < len(ran):
            reason += f"; {len(ran) - len(fits)} faster or slower plan(s) need more memory"
    elif ran:
        winner = min(ran, key=lambda i: (measurements[i].peak_bytes, i))
        reason = ("no plan fits the budget: the one that needs the least memory "
                  f"({measurements[winner].peak_bytes / _MIB:.3f} MiB per rank)")
    else:
        raise StrategyError("auto: no candidate plan could run one training step: "
                            + "; ".join(f"{n}: {m.error}" for n, m in zip(names, measurements)))
    return SearchReport(tuple(names), tuple(measurements), int(budget_bytes), budget_source,
                        winner, reason)


def held_bytes(model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> int:
    """Bytes of the parameters, gradients and optimizer state this process holds, counted as
    ``fleet.state_bytes()`` counts them (:func:`fleetx.strategy.measured.measure`)."""
    return sum(measure([model], optimizer).values())


def memory_budget(world: Any, held: int) -> tuple[int, str]:
    """Bytes one rank may use, and where the figure comes from.

    ``FLEETX_AUTO_MEMORY_MB`` (from ``world.environ``) when set; else the device's free memory
    now plus ``held`` (what the real model and optimizer hold already, which the candidates'
    figures include).

    Raises:
        fleetx.env.EnvError: the variable is not a positive number.
    """
    from fleetx import env
    mib = env.get_float(BUDGET_VARIABLE, env=world.environ)
    if mib is not None:
        if not mib > 0:
            raise env.EnvError(f"{BUDGET_VARIABLE}={mib:g} must be a positive number of MiB")
        return int(mib * _MIB), BUDGET_VARIABLE
    if world.device == "cuda":
        free, _ = torch.cuda.mem_get_info()
        return int(free) + held, "free CUDA memory + the model's state"
    available = _mem_available()
    if available is None:
        return 2 ** 62, "no memory figure on this system: unbounded"
    share = available // max(1, world.local_world_size)
    return share + held, (f"MemAvailable / {world.local_world_size} local process(es) + the "
                          f"model's state")


def _mem_available() -> Optional[int]:
    try:
        with open("/proc/meminfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _agree(world: Any, report_inputs: tuple[list[Measurement], int]) -> tuple[list, int]:
    """All ranks' figures made one: memory the largest over ranks, budget the smallest, timings
    rank 0's (broadcast)."""
    measured, budget = report_inputs
    if world.world_size <= 1 or not dist.is_initialized():
        return measured, budget
    device = torch.device("cuda", torch.cuda.current_device()) if world.device == "cuda" \
        else torch.device("cpu")
    big = float(2 ** 62)
    mem = torch.tensor([[float(m.state_bytes) if not m.error else big,
                         float(m.saved_bytes) if not m.error else big] for m in measured]
                       + [[-float(budget), 0.0]], dtype=torch.float64, device=device)
    dist.all_reduce(mem, op=dist.ReduceOp.MAX)  # the budget row carries -budget: MAX is MIN
    times = torch.tensor([[m.seconds, m.spread] for m in measured], dtype=torch.float64,
                         device=device)
    dist.broadcast(times, src=0)
    agreed = []
    for m, (state, saved), (t, spread) in zip(measured, mem[:-1].tolist(), times.tolist()):
        error = m.error or ("out of memory on another rank" if state >= big else "")
        agreed.append(Measurement(t, int(state), int(saved), spread=spread) if not error
                      else Measurement(math.inf, 0, 0, error))
    return agreed, int(-mem[-1, 0].item())


def _broadcast_choice(world: Any, index: int) -> int:
    if world.world_size <= 1 or not dist.is_initialized():
        return index
    device = torch.device("cuda", torch.cuda.current_device()) if world.device == "cuda" \
        else torch.device("cpu")
    choice = torch.tensor([index], dtype=torch.int64, device=device)
    dist.broadcast(choice, src=0)
    return int(choice.item())


def search(ctx: TrainingContext, base: Any, args: tuple, kwargs: dict) -> None:
    """Measure every candidate on this batch, choose, and have the engine re-plan with the
    winner (``ctx.replan``). Runs on every rank at the first training forward.

    Raises:
        StrategyError: no optimizer was wrapped yet, or no candidate could run a step.
    """
    if ctx.optimizer is None or ctx.trial is None or ctx.planner is None:
        raise StrategyError("auto: measures training steps, so call "
                            "fleet.distributed_optimizer(optimizer) before the first training "
                            "forward of the model")
    world = ctx.world
    plan_input = PlanInput(base, world, ModelInfo.of(ctx.model), planner=ctx.planner)
    found = candidates(base, plan_input)
    budget, source = memory_budget(world, held_bytes(ctx.model, ctx.optimizer))
    rng = _rng_state()
    measured = [ctx.trial(c.strategy, args, kwargs) for c in found]
    _set_rng_state(rng)  # training draws the same numbers as it would have without the search
    measured, budget = _agree(world, (measured, budget))
    report = choose([c.name for c in found], measured, budget, source, [c.size for c in found])
    winner = _broadcast_choice(world, report.winner)
    report = SearchReport(report.names, report.measurements, report.budget_bytes,
                          report.budget_source, winner, report.reason)
    if report.measurements[winner].peak_bytes > budget:
        warnings.warn(f"fleetx auto: {report.reason}", stacklevel=4)
    ctx.replan(found[winner].strategy, report)


def _rng_state() -> tuple:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


@register
class AutoStrategy(Strategy):
    """Choose the plan by measuring candidates at the first training forward."""

    name = "auto"
    replaces_plan = True

    def can_apply(self, plan_input: PlanInput) -> Verdict:
        if plan_input.world.mode is not Mode.COLLECTIVE:
            return Verdict.fail("runs in collective mode only")
        found = candidates(self.strategy, plan_input)
        names = ", ".join(repr(c.name) for c in found)
        return Verdict.ok(f"measures {len(found)} candidate plan(s) at the first training "
                          f"forward and keeps the fastest that fits in memory: {names}")

    def apply(self, ctx: TrainingContext) -> None:
        base = self.strategy
        ctx.first_batch.append(lambda args, kwargs: search(ctx, base, args, kwargs))
