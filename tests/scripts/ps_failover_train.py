"""An async parameter-server job that trains until told to stop
(tests/launch/test_fleetrun_ps_failover.py).

The same unchanged script on every role: servers call ``init_server()`` / ``run_server()``;
workers train ``ps_fleet_model.Net`` and append ``<step> <time>`` to ``<out>/progress<rank>``
after every step, until ``<out>/stop`` exists (or ``--max-seconds`` passed), then stop.
"""
import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ps_fleet_model import batch, loss_of, make_model, make_optimizer  # noqa: E402

from fleetx import fleet  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--max-seconds", type=float, default=120.0)
ap.add_argument("--pause", type=float, default=0.01, help="seconds between steps")
ap.add_argument("--tag", default="", help="ignored: lets a test find the job's processes")
ap.add_argument("--mode", choices=("async", "sync", "geo"), default="async")
args = ap.parse_args()

fleet.init()
model = fleet.distributed_model(make_model())
strategy = fleet.DistributedStrategy()
strategy.a_sync = args.mode != "sync"
if args.mode == "geo":
    strategy.a_sync_configs = {"k_steps": 4}
opt = fleet.distributed_optimizer(make_optimizer("adagrad", model.parameters(), 0.1), strategy)

if fleet.is_server():
    fleet.init_server()
    fleet.run_server()
    sys.exit(0)

rank, nranks = fleet.worker_index(), fleet.worker_num()
fleet.init_worker()
out = Path(args.out)
began, step = time.monotonic(), 0
with open(out / f"progress{rank}", "a") as progress:
    while not (out / "stop").exists() and time.monotonic() - began < args.max_seconds:
        loss = loss_of(model, *batch(step % 64, rank, nranks))
        opt.minimize(loss)
        step += 1
        progress.write(f"{step} {time.time():.3f} {loss.item():.5f}\n")
        progress.flush()
        time.sleep(args.pause)
fleet.stop_worker()
print(f"worker {rank} done after {step} steps", flush=True)
