"""Launched by tests/launch/test_fleetrun_ps.py on every role of a parameter-server job.

Usage: ps_launch_env.py TOKEN MODE. Records ``<FLEETX_LOG_DIR>/env.<role>.<index>.json`` (the
contract variables it sees), prints one line to stdout and one to stderr, starts a child
process whose command line carries TOKEN (so the test can find every process of the job), and
then, by MODE:

* ``finish``: workers exit 0; servers and heter workers sleep (fleetrun must stop them);
* ``fail``: worker 1 exits 3 after a second; every other process sleeps;
* ``fail-heter`` / ``fail-server``: heter worker 0 / server 0 exits 3 after a second; every
  other process sleeps;
* ``sleep``: every process sleeps.
"""
import json
import os
import subprocess
import sys
import time

from fleetx import env

token, mode = sys.argv[1], sys.argv[2]
role = {"TRAINER": "worker", "HETER_TRAINER": "heter"}.get(env.get("TRAINING_ROLE"), "server")
if role == "worker":
    index = env.get_int("PADDLE_TRAINER_ID")
else:
    listed = env.get_list("PADDLE_PSERVERS_IP_PORT_LIST" if role == "server" else
                          "PADDLE_ALL_HETER_TRAINER_IP_PORT_LIST")
    index = listed.index(f"{env.get('POD_IP')}:{env.get('PADDLE_PORT')}")
present = {name: env.environ[name] for name in env.VARIABLES if name in env.environ}
with open(os.path.join(env.get("FLEETX_LOG_DIR"), f"env.{role}.{index}.json"), "w") as f:
    json.dump(present, f)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", token])
print(f"stdout of {role} {index}", flush=True)
print(f"stderr of {role} {index}", file=sys.stderr, flush=True)
if mode == "finish" and role == "worker":
    child.kill()
    sys.exit(0)
if mode == "fail" and role == "worker" and index == 1:
    time.sleep(1)
    print("worker 1 gives up: boom", file=sys.stderr, flush=True)
    sys.exit(3)
if mode == f"fail-{role}" and role in ("heter", "server") and index == 0:
    time.sleep(1)
    print(f"{'heter worker' if role == 'heter' else role} 0 gives up: boom", file=sys.stderr,
          flush=True)
    sys.exit(3)
time.sleep(300)
