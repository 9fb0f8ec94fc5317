"""One rank's scalars, written to a CSV file and to a TensorBoard run.

Layout under the scalars folder: ``scalars.<rank>.csv`` (a header line, :data:`COLUMNS`, then one
row per logged step) and ``tb/rank<rank>/`` (a TensorBoard run per rank, so TensorBoard's run
selector shows each rank as its own curve).
"""
from __future__ import annotations

import csv
import os
from typing import Mapping, Optional

from fleetx import env
from fleetx.observe.api import COLUMNS, csv_path, require

__all__ = ["ScalarWriter"]


def _has_header(path: str) -> bool:
    try:
        with open(path, newline="") as f:
            return next(csv.reader(f), None) == list(COLUMNS)
    except OSError:
        return False


class ScalarWriter:
    """Writes the rows of one rank.

    Args:
        log_dir: the scalars folder (created when missing).
        rank: this process's rank (names its CSV and its TensorBoard run).
        tensorboard: also write a TensorBoard run (needs the ``tensorboard`` package).
        csv_file: also write the CSV file.

    Raises:
        MissingExtraError: ``tensorboard=True`` and the package is missing.

    Example:
        >>> w = ScalarWriter("runs/exp1", rank=0)
        >>> w.write({"step": 10, "time": 1.5, "loss": 0.7})
        >>> w.close()
    """

    def __init__(self, log_dir: str, rank: int, tensorboard: bool = True,
                 csv_file: bool = True) -> None:
        os.makedirs(log_dir, exist_ok=True)
        self._tb = None
        if tensorboard:
            require("tensorboard", "TensorBoard scalars")
            writer = require("torch.utils.tensorboard", "TensorBoard scalars").SummaryWriter
            self._tb = writer(os.path.join(log_dir, "tb", f"rank{rank}"))
        self._file = self._csv = None
        if csv_file:
            path = csv_path(log_dir, rank)
            # a restarted process (fleetrun --max_restarts, elastic) goes on with its rank's
            # rows; a new run starts the file afresh
            resume = env.get_int("TORCHELASTIC_RESTART_COUNT") > 0 and _has_header(path)
            self._file = open(path, "a" if resume else "w", newline="")
            self._csv = csv.writer(self._file)
            if not resume:
                self._csv.writerow(COLUMNS)
            self._file.flush()

    def write(self, row: Mapping[str, Optional[float]]) -> None:
        """One row; keys outside :data:`COLUMNS` are refused, missing ones left empty.

        Raises:
            KeyError: an unknown column (the message lists the known ones).
        """
        unknown = set(row) - set(COLUMNS)
        if unknown:
            raise KeyError(f"unknown scalar(s) {sorted(unknown)}; known: {list(COLUMNS)}")
        if self._csv is not None:
            self._csv.writerow(["" if row.get(k) is None else repr(float(row[k]))
                                for k in COLUMNS])
            self._file.flush()  # a killed run keeps every row written so far
        if self._tb is not None:
            step = int(row["step"])
            for name in COLUMNS[2:]:
                if row.get(name) is not None:
                    self._tb.add_scalar(name, float(row[name]), step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
