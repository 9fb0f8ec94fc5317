"""Launched by tests/launch: ``launch_raise.py R`` makes rank R raise an exception (a traceback
in its log); the other ranks wait to be stopped."""
import sys
import time

from fleetx import env


def train_step():
    raise RuntimeError(f"rank {env.get_int('RANK')} cannot train: broken batch")


if env.get_int("RANK") == int(sys.argv[1]):
    train_step()
time.sleep(60)
