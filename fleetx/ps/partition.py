"""Where a key lives: the one partition function shared by clients and servers.

Sparse ids: ``shard = mix64(id) % shard_num`` and ``server = shard * num_servers // shard_num``
(contiguous blocks of shards per server). Hashing first matters because raw ids are rarely
spread (Criteo tokens, ``user_id * 1000 + slot``...); mapping shards rather than ids to servers
keeps an id's shard fixed when the number of servers changes, which is what lets a checkpoint
be loaded by a different number of servers.

Dense tables: a flat vector is split into ``num_servers`` contiguous ranges whose sizes differ
by at most one (the first ``numel % num_servers`` ranges get the extra element).
"""
from __future__ import annotations

import numpy as np

from fleetx.ps.kernels import mix64, unique_first

__all__ = ["shard_of", "server_of", "route", "dense_ranges", "Route"]


def shard_of(ids: np.ndarray, shard_num: int) -> np.ndarray:
    """Logical shard of every id (int64 array of the same shape)."""
    ids = np.ascontiguousarray(ids, np.int64)
    return (mix64(ids.view(np.uint64)) % np.uint64(shard_num)).astype(np.int64)


def server_of(ids: np.ndarray, num_servers: int, shard_num: int) -> np.ndarray:
    """Index of the server that owns every id."""
    if num_servers == 1:
        return np.zeros(np.shape(ids), np.int64)
    return shard_of(ids, shard_num) * num_servers // shard_num


class Route:
    """Unique ids grouped by owning server.

    Attributes:
        ids: the unique ids, reordered so that each server's ids are contiguous.
        offsets: ``ids[offsets[s]:offsets[s + 1]]`` belong to server ``s``.
        inverse: ``original_ids == ids[inverse]`` (flattened).
    """

    __slots__ = ("ids", "offsets", "inverse")

    def __init__(self, ids: np.ndarray, offsets: np.ndarray, inverse: np.ndarray) -> None:
        self.ids, self.offsets, self.inverse = ids, offsets, inverse

    def part(self, server: int) -> np.ndarray:
        return self.ids[self.offsets[server]:self.offsets[server + 1]]


def route(ids: np.ndarray, num_servers: int, shard_num: int) -> Route:
    """De-duplicate ``ids`` and group them by server (no per-id Python; the unique ids of a
    server come in no particular order).

    Example:
        >>> r = route(np.array([7, 3, 7]), 1, 1000)
        >>> r.ids[r.inverse].tolist()
        [7, 3, 7]
    """
    uniq, inverse = unique_first(ids)  # a hash pass (C): the order within a server is free
    if num_servers == 1:
        return Route(uniq, np.array([0, len(uniq)], np.int64), inverse)
    owner = server_of(uniq, num_servers, shard_num)
    order = np.argsort(owner, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    counts = np.bincount(owner, minlength=num_servers)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return Route(uniq[order], offsets, rank[inverse.reshape(-1)])


def dense_ranges(numel: int, num_servers: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of every server's slice of a flat dense vector of ``numel`` elements."""
    base, extra = divmod(numel, num_servers)
    out, start = [], 0
    for s in range(num_servers):
        stop = start + base + (1 if s < extra else 0)
        out.append((start, stop))
        start = stop
    return out
