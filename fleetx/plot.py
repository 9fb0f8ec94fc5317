"""``python -m fleetx.plot LOG_DIR [--out FILE.png]`` (also ``fleetrun --plot LOG_DIR``): a PNG of
the loss and the throughput of every rank, from the ``scalars.<rank>.csv`` files that
``fleet.observe`` wrote (into fleetrun's log folder, or its ``scalars_dir``). Two panels (loss,
samples/s against the step), one line per rank. matplotlib (the ``observe`` extra) draws it with
the Agg backend: no display needed.
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import sys
from typing import Optional, Sequence

from fleetx.observe.api import read_scalars, require

__all__ = ["figure", "plot", "main"]

_CSV = re.compile(r"scalars\.(\d+)\.csv$")


def _runs(log_dir: str) -> dict[int, list]:
    files = {int(m.group(1)): path for path in glob.glob(os.path.join(log_dir, "scalars.*.csv"))
             if (m := _CSV.search(path))}
    if not files:
        raise FileNotFoundError(f"{log_dir}: no scalars.<rank>.csv here (fleet.observe writes "
                                f"them: into fleetrun's log folder, or its scalars_dir)")
    return {rank: read_scalars(files[rank]) for rank in sorted(files)}


def plot(log_dir: str, out: Optional[str] = None) -> str:
    """Draw the PNG; returns its path (default ``<log_dir>/scalars.png``).

    Raises:
        FileNotFoundError: ``log_dir`` holds no scalars file.
        ValueError: a file is not a fleetx scalars file (named).
        MissingExtraError: matplotlib is not installed.

    Example:
        >>> plot("runs/exp1")            # doctest: +SKIP
        'runs/exp1/scalars.png'
    """
    fig = figure(log_dir)
    out = out or os.path.join(log_dir, "scalars.png")
    fig.savefig(out, format="png")
    require("matplotlib.pyplot", "fleetx.plot").close(fig)
    return out


def figure(log_dir: str):
    """The matplotlib figure :func:`plot` saves: axes 0 the loss, axes 1 samples/s, one line
    per rank in each (raises as :func:`plot`)."""
    runs = _runs(log_dir)
    matplotlib = require("matplotlib", "fleetx.plot")
    matplotlib.use("Agg")  # files only: works without a display
    pyplot = require("matplotlib.pyplot", "fleetx.plot")
    fig, (loss_ax, rate_ax) = pyplot.subplots(2, 1, sharex=True, figsize=(8, 6))
    for rank, rows in runs.items():
        for ax, column in ((loss_ax, "loss"), (rate_ax, "samples_per_s")):
            points = [(r["step"], r[column]) for r in rows if r[column] is not None]
            ax.plot([p[0] for p in points], [p[1] for p in points], label=f"rank {rank}")
    loss_ax.set_ylabel("loss")
    rate_ax.set_ylabel("samples/s")
    rate_ax.set_xlabel("step")
    loss_ax.legend(loc="best")
    loss_ax.set_title(f"{os.path.abspath(log_dir)}: {len(runs)} rank(s)")
    return fig


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command line; returns the exit code (1 with a message on a missing or bad file)."""
    parser = argparse.ArgumentParser(prog="python -m fleetx.plot", description=__doc__.split(
        "\n\n")[0])
    parser.add_argument("log_dir", help="the folder of the scalars.<rank>.csv files")
    parser.add_argument("--out", help="the PNG to write (default: LOG_DIR/scalars.png)")
    args = parser.parse_args(argv)
    try:
        print(plot(args.log_dir, args.out))
    except (OSError, ValueError, ImportError) as exc:
        print(f"fleetx.plot: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
