"""The parameter server's PyTorch adapter: torch models and optimizers on :mod:`fleetx.ps` tables.

The server-side core (:mod:`fleetx.ps`: transport, tracker, client, server, shard, tables and
rules) knows nothing of torch or of a training step. This package is what a worker adds on top:

* :mod:`.layout` - a torch model and optimizer laid out as tables (sparse embeddings become
  :class:`~fleetx.nn.SparseEmbedding`), and values moved between the model and flat arrays.
* :mod:`.communicator`, :mod:`.async_communicator`, :mod:`.geo` - what a training step sends in
  sync, async and GEO mode; :func:`make_communicator` (:mod:`.worker`) picks one. These are
  numpy-only, so a process that drives only a communicator does not import torch.
* :mod:`.prefetch` - rows pulled ahead of the lookups that use them (``fleet.prefetch``: the next
  batch's rows while one trains).
* :mod:`.progress` - a worker's samples/s and mean-loss lines.
* :mod:`.runtime` - :class:`PSRuntime`, what ``fleet.init_worker`` / ``init_server`` /
  ``run_server`` / ``stop_worker`` and each optimizer step do.
* :mod:`.inference` - a worker that only reads (distributed inference).
* :mod:`.heter`, :mod:`.heter_worker` - heter workers: the trainer's link to its heter worker
  and the service that runs the model's :class:`~fleetx.nn.HeterSection` blocks.

Contract: this package imports :mod:`fleetx.ps` and :mod:`fleetx.nn`; neither imports it back
(a test of the import graph keeps it so). Its public names are the ones below.

Example:
    >>> from fleetx.ps_torch import ModelLayout, make_communicator   # doctest: +SKIP
    >>> layout = ModelLayout.of(model, optimizer)
    >>> comm = make_communicator(config, rank, layout.tables)
"""
import importlib
from typing import Any

from fleetx.ps_torch.communicator import Communicator
from fleetx.ps_torch.worker import make_communicator

# The communicators are numpy-only: a worker process that only drives one (as the tests' workers
# do) should not pay torch's ~2 s import. The torch-facing names load on first use.
_LAZY = {"LocalSparseBackend": "layout", "ModelLayout": "layout", "RemoteSparseBackend": "layout",
         "PSRuntime": "runtime"}

__all__ = ["Communicator", "LocalSparseBackend", "ModelLayout", "PSRuntime", "RemoteSparseBackend",
           "make_communicator"]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'fleetx.ps_torch' has no attribute {name!r}; "
                             f"it has {', '.join(__all__)}")
    return getattr(importlib.import_module(f"fleetx.ps_torch.{_LAZY[name]}"), name)
