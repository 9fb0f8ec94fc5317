"""``python -m fleetx.run script.py [args...]`` (or ``-m module [args...]``): run a training
script as ``python`` would, with fleetrun's clean-exit guarantee, under any launcher.

A script that returns normally exits 0 every time: the process ends without interpreter teardown,
which is where torch's gloo threads can abort a finished job ("terminate called without an
active exception"; :mod:`fleetx.launch.script` explains why). Exit codes, ``sys.exit`` and
uncaught exceptions behave as under plain ``python``. fleetrun gives every process this already;
use this module with other launchers::

    torchrun --nproc_per_node 2 -m fleetx.run train.py --epochs 4
    srun python -m fleetx.run train.py
    mpirun -np 4 python -m fleetx.run train.py
"""
from __future__ import annotations

import sys
from typing import NoReturn, Optional, Sequence

from fleetx.launch.script import run_script

__all__ = ["main"]

_USAGE = "usage: python -m fleetx.run (script.py | -m module) [args...]"


def main(argv: Optional[Sequence[str]] = None) -> NoReturn:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["-m"]:
        if len(argv) < 2:
            sys.exit(f"{_USAGE}\nfleetx.run: error: -m needs a module name")
        run_script(argv[1], argv[2:], module=True)
    if not argv or argv[0].startswith("-"):
        sys.exit(f"{_USAGE}\nfleetx.run: error: "
                 + (f"unknown option {argv[0]}" if argv else "no script given"))
    run_script(argv[0], argv[1:])


if __name__ == "__main__":
    main()
