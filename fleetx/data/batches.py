"""Batches of torch tensors from sample blocks.

A batch is a dict keyed by slot name: a dense slot gives a ``(batch, dense_width)`` tensor
(int64 or float32); a sparse slot gives a :class:`~fleetx.data.api.RaggedSlot` of ``values``,
``offsets`` and ``lengths`` (``nn.EmbeddingBag(...)(slot.values, slot.offsets)``). The tensors
own their memory: changing one in place does not change the dataset.
"""
from __future__ import annotations

from typing import Iterable, Iterator

import numpy as np
import torch

from fleetx.data.api import RaggedSlot
from fleetx.data.block import SampleBlock

__all__ = ["to_batch", "iter_batches"]


def to_batch(block: SampleBlock) -> dict:
    """The samples of ``block`` as one batch (see the module docstring)."""
    batch = {}
    for slot in block.slots:
        values = torch.from_numpy(np.array(block.values[slot.name]))  # a copy, writable
        if slot.dense:
            batch[slot.name] = values.view(block.size, slot.dense_width)
            continue
        lengths = torch.from_numpy(block.lengths[slot.name].astype(np.int64))
        offsets = torch.zeros_like(lengths)
        if len(lengths) > 1:
            torch.cumsum(lengths[:-1], 0, out=offsets[1:])
        batch[slot.name] = RaggedSlot(values, offsets, lengths)
    return batch


def iter_batches(blocks: Iterable[SampleBlock], batch_size: int) -> Iterator[dict]:
    """Batches of ``batch_size`` samples across ``blocks`` (a batch may span two blocks); the
    last one holds what is left."""
    carry = None
    for block in blocks:
        start = 0
        if carry is not None and carry.size:
            start = min(batch_size - carry.size, block.size)
            carry = SampleBlock.concat(block.slots, [carry, block.slice(0, start)])
            if carry.size < batch_size:
                continue
            yield to_batch(carry)
        while block.size - start >= batch_size:
            yield to_batch(block.slice(start, start + batch_size))
            start += batch_size
        carry = block.slice(start, block.size)
    if carry is not None and carry.size:
        yield to_batch(carry)
