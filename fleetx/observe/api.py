"""The contract of :mod:`fleetx.observe`: the extras check, the CSV's columns and file names, and
the throughput file a process leaves for fleetrun's summary. Torch-free: the launcher and
:mod:`fleetx.plot` read these files without the training stack."""
from __future__ import annotations

import csv
import importlib
import json
import os
from typing import Any, Optional

__all__ = ["MissingExtraError", "require", "COLUMNS", "csv_path", "read_scalars",
           "throughput_path", "write_throughput", "read_throughput"]

#: The scalars of one logged step, in CSV column order (an empty cell: not measured there).
#: ``loss`` is the mean of the losses of the steps since the previous row; ``samples_per_s``
#: over the same steps; latencies are the PS client's since the start, in milliseconds, and its
#: traffic to and from the servers since the start, in MB (10^6 bytes of whole frames).
COLUMNS = ("step", "time", "loss", "samples_per_s", "loss_scale", "dgc_sparsity",
           "ps_pull_p50_ms", "ps_pull_p99_ms", "ps_push_p50_ms", "ps_push_p99_ms",
           "ps_sent_mb", "ps_received_mb")


class MissingExtraError(ImportError):
    """A feature needs a library that is not installed; the message names the extra.

    Example:
        >>> require("no_such_lib", "the progress bar")  # doctest: +SKIP
        MissingExtraError: the progress bar needs no_such_lib: pip install "fleetx[observe]"
    """


def require(module: str, feature: str) -> Any:
    """Import ``module`` for ``feature``.

    Raises:
        MissingExtraError: it is not installed (naming the ``observe`` extra).
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        top = module.split(".")[0]
        raise MissingExtraError(f"{feature} needs {top}, which is not installed: "
                                f'pip install "fleetx[observe]" ({exc})') from None


def csv_path(log_dir: str, rank: int) -> str:
    """The CSV of ``rank`` under a scalars folder: ``<log_dir>/scalars.<rank>.csv``."""
    return os.path.join(log_dir, f"scalars.{rank}.csv")


def read_scalars(path: str) -> list[dict[str, Optional[float]]]:
    """The rows of one CSV, each column a float (None for an empty cell).

    Raises:
        ValueError: the header is not :data:`COLUMNS` (the message names the file).
    """
    with open(path, newline="") as f:
        reader = csv.reader(f)
        header = tuple(next(reader, ()))
        if header != COLUMNS:
            raise ValueError(f"{path}: not a fleetx scalars file (header {list(header)}, "
                             f"expected {list(COLUMNS)})")
        return [{k: float(v) if v != "" else None for k, v in zip(COLUMNS, row)}
                for row in reader]


def throughput_path(log_dir: str, index: int) -> str:
    """Where worker (or trainer) ``index`` leaves its throughput for fleetrun."""
    return os.path.join(log_dir, f"throughput.{index}")


def write_throughput(path: str, samples_per_s: float, steps: int) -> None:
    """Replace the file atomically: fleetrun never reads half of it."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"samples_per_s": samples_per_s, "steps": steps}, f)
    os.replace(tmp, path)


def read_throughput(log_dir: str, index: int) -> Optional[float]:
    """Samples/s that worker ``index`` reported, or None (it reported none, or the file is
    damaged)."""
    try:
        with open(throughput_path(log_dir, index)) as f:
            return float(json.load(f)["samples_per_s"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
