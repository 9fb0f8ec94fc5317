"""Watching a training run: a progress bar on rank 0, per-rank scalars (TensorBoard and CSV),
and the throughput file fleetrun's end-of-job summary reads.

The libraries are optional extras, imported only when a feature is used: ``tqdm`` (the bar),
``tensorboard`` (``torch.utils.tensorboard``), ``matplotlib`` (:mod:`fleetx.plot`); install them
with ``pip install "fleetx[observe]"``. A feature whose library is missing raises
:class:`MissingExtraError` naming the extra. ``fleet.observe(...)`` builds an :class:`Observer`
with the fleet's rank and its strategies' scalars (loss scale, DGC sparsity, PS latency).
"""
from fleetx.observe.api import (COLUMNS, MissingExtraError, csv_path, read_scalars,
                                read_throughput, require, throughput_path)
from fleetx.observe.observer import Observer

__all__ = ["Observer", "MissingExtraError", "COLUMNS", "require", "csv_path", "read_scalars",
           "throughput_path", "read_throughput"]
