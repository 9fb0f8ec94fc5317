"""A small CTR model over MovieLens-100k's slots, with growth control on its id table.

``ids`` (user, movie, zip) is where new ids keep arriving: a row is created only for ids seen
``count_filter`` times in training lookups (``CountFilterEntry``), and a row not updated for more
than ``unseen_passes`` passes is evicted at ``fleet.shrink()`` (``AccessorConfig``). ``attrs``
(gender, occupation, age bucket) and ``genres`` are small and keep every row.
"""
from __future__ import annotations

import torch
from torch import nn

from fleetx.nn import SparseEmbedding, SparseEmbeddingBag
from fleetx.ps.api import AccessorConfig, CountFilterEntry, InitConfig


class MovieLensCTR(nn.Module):
    """Three slots of ``ids``, three of ``attrs`` and a bag of genres, then an MLP.

    Args:
        dim: embedding width.
        count_filter: training sightings before an id gets a row.
        unseen_passes: passes a row may go without an update before a shrink evicts it.
    """

    def __init__(self, dim: int = 8, count_filter: int = 2, unseen_passes: int = 1) -> None:
        super().__init__()
        init = InitConfig("normal", std=0.05)
        self.ids = SparseEmbedding(dim, name="ids", init=init,
                                   entry=CountFilterEntry(count_filter),
                                   accessor=AccessorConfig(delete_after_unseen_days=unseen_passes))
        self.attrs = SparseEmbedding(dim, name="attrs", init=init)
        self.genres = SparseEmbeddingBag(dim, name="genres", mode="sum", padding_idx=0,
                                         init=init)
        self.mlp = nn.Sequential(nn.Linear(7 * dim, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, ids: torch.Tensor, attrs: torch.Tensor,
                genres: torch.Tensor) -> torch.Tensor:
        feats = torch.cat([self.ids(ids).flatten(1), self.attrs(attrs).flatten(1),
                           self.genres(genres)], 1)
        return self.mlp(feats).squeeze(1)
