"""What ``import fleetx`` loads: torch's checkpoint, FSDP2, ZeRO and DTensor modules only when a
job uses them, so a process that never checkpoints or shards (a launcher, a tool, a script's
start before its first step) does not pay for them at start-up."""
import subprocess
import sys

_HEAVY = ("torch.distributed.checkpoint", "torch.distributed.fsdp", "torch.distributed.optim",
          "torch.distributed.tensor")


def test_importing_fleetx_and_every_strategy_loads_no_heavy_torch_module():
    code = ("import sys\nimport fleetx.fleet, fleetx.parallel, fleetx.metrics\n"
            "from fleetx.strategy.planner import load_strategies\nload_strategies()\n"
            f"print(sorted(m for m in {_HEAVY!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"

