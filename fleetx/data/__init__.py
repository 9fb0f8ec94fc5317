"""Datasets and data generators for parameter-server training: Paddle Fleet's
``InMemoryDataset`` / ``QueueDataset`` fed by ``MultiSlotDataGenerator`` scripts.

What it offers:

* ``generator.py``: :class:`MultiSlotDataGenerator` and :class:`MultiSlotStringDataGenerator`,
  the user's script that turns raw lines into slot text (``<count> v1 v2 ...`` per slot, one
  sample a line), run as a dataset's ``pipe_command``;
* ``dataset.py``: :class:`InMemoryDataset` (load, local / global shuffle, several passes),
  :class:`QueueDataset` (streaming) and :class:`DatasetFactory`; iterating a dataset yields
  batches of torch tensors keyed by slot name (sparse slots as :class:`RaggedSlot` ids +
  offsets, ready for ``nn.EmbeddingBag`` / ``fleetx.nn.SparseEmbeddingBag``);
* ``pipe.py`` (one file's ``download_cmd | pipe_command`` pipeline), ``reading.py`` (one file
  read: its pipeline, then the parser), ``readers.py`` and ``reader_process.py`` (``thread_num``
  parallel readers, threads or processes, each reading files as ``reading.py`` does), ``parse.py``
  with ``_slots.c`` (the slot text parser, C or numpy), ``block.py`` (samples in columns, packed
  into raw buffers), ``shuffle.py`` (local and global shuffles), ``batches.py`` (tensors);
* ``loader.py``: :class:`~fleetx.data.loader.DistributedLoader` (``fleet.distributed_loader``),
  a rank's share of a map-style torch dataset on torchdata's ``StatefulDataLoader``, whose
  position training checkpoints hold; it is handed the rank and world size;
* ``api.py``: the contract: :class:`Slot`, :class:`RaggedSlot`, the errors, and the protocol of
  the fleet a global shuffle is handed.

What it may import: numpy, the standard library, :mod:`fleetx.env`; torch in ``batches.py``,
``dataset.py`` and ``loader.py`` (with torchdata) only, which load on first use: a generator
script (``from fleetx.data import MultiSlotDataGenerator``) and a reader process start without torch. It never imports
``fleetx.fleet``: what a global shuffle needs of the fleet (``worker_num``, ``worker_index``,
``util``) it is handed as an argument. ``fleetx.fleet`` re-exports the public names
(``fleet.InMemoryDataset``, ``fleet.MultiSlotDataGenerator``...).

Invariants:

* a file is either read whole or its dataset operation fails naming the file (a failed pipe
  command, a malformed line); malformed lines are dropped only when asked
  (``skip_bad_lines=True``), and counted;
* samples reach the dataset in file-list order whatever the readers' speeds, so a seeded
  shuffle gives the same order every time;
* samples cross process boundaries as raw numpy buffers (``SampleBlock.pack``), never pickle.

Example:
    >>> from fleetx.data import InMemoryDataset, Slot
    >>> dataset = InMemoryDataset()
    >>> dataset.init(batch_size=2, use_var=["words", Slot("label", "int64", dense_width=1)])
    >>> dataset.set_filelist(["part-0"])          # lines like "3 11 12 13 1 0"
    >>> dataset.load_into_memory()
    >>> next(iter(dataset))["words"].values
"""
import importlib
from typing import Any

from fleetx.data.api import (BadLineError, DataError, PipeCommandError, PipeTimeoutError,
                             RaggedSlot, SampleError, ShuffleError, Slot)
from fleetx.data.generator import (DataGenerator, MultiSlotDataGenerator,
                                   MultiSlotStringDataGenerator)

__all__ = ["Slot", "RaggedSlot", "DataError", "SampleError", "BadLineError", "PipeCommandError",
           "PipeTimeoutError", "ShuffleError", "DataGenerator", "MultiSlotDataGenerator",
           "MultiSlotStringDataGenerator", "DatasetBase", "InMemoryDataset", "QueueDataset",
           "DatasetFactory"]

_LAZY = {"DatasetBase", "InMemoryDataset", "QueueDataset", "DatasetFactory"}


def __getattr__(name: str) -> Any:
    # the datasets need torch (their batches are tensors); generators and readers do not
    if name not in _LAZY:
        raise AttributeError(f"module 'fleetx.data' has no attribute {name!r}")
    value = getattr(importlib.import_module("fleetx.data.dataset"), name)
    globals()[name] = value
    return value
