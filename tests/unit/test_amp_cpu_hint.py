"""AMP on a CPU without fast bfloat16 gets a hint in the plan (the detection reads the CPU's
flags once; the parser is tested on flag lines of both kinds)."""
from __future__ import annotations

from fleetx.strategy.algorithms.amp import cpu_has_fast_bf16, fast_bf16_flags
from fleetx.strategy.api import PlanInput, WorldInfo
from fleetx.strategy.distributed_strategy import DistributedStrategy
from fleetx.strategy.planner import make_plan

HINT = "hint: this CPU has no fast bfloat16"


def amp_reason(device):
    s = DistributedStrategy()
    s.amp = True
    plan = make_plan(PlanInput(s, WorldInfo(device=device)))
    return next(e.reason for e in plan.entries if e.name == "amp")


def test_flag_parser():
    assert fast_bf16_flags("processor : 0\nflags : fpu sse avx2 fma\n") is False
    assert fast_bf16_flags("flags\t\t: fpu avx512f avx512_bf16\n") is True
    assert fast_bf16_flags("flags : fpu amx_bf16 amx_tile\n") is True
    assert fast_bf16_flags("Features : fp asimd bf16\n") is True  # Arm's BF16 extension
    assert fast_bf16_flags("Features : fp asimd\n") is False
    assert fast_bf16_flags("") is None


def test_the_plan_hints_exactly_when_this_cpu_lacks_fast_bf16():
    has = cpu_has_fast_bf16()
    reason = amp_reason("cpu")
    assert reason.startswith("autocast bfloat16 on cpu")
    assert (HINT in reason) == (has is False)
    assert "strategy.amp = False" in reason or has is not False


def test_no_hint_on_gpus():
    assert HINT not in amp_reason("cuda")
