"""Launched by tests/launch: rank 1 exits with code 7 in the first worker group and succeeds once
the group was restarted; every rank prints which attempt it is."""
import sys

from fleetx import env

rank, restart = env.get_int("RANK"), env.get_int("TORCHELASTIC_RESTART_COUNT")
print(f"attempt {restart} of rank {rank}", flush=True)
if rank == 1 and restart == 0:
    sys.exit(7)
