"""The data loader of a collective job whose position a training checkpoint holds
(``fleet.distributed_loader``).

:class:`DistributedLoader` is torchdata's ``StatefulDataLoader`` over a map-style dataset, with
:class:`RankSampler` choosing this rank's indices. Every epoch has one order of the whole
dataset (a permutation seeded by ``seed + epoch``, as ``DistributedSampler`` seeds it); the
ranks walk it in lock-step, rank ``r`` taking the order's item ``position + r`` while
``position`` advances by the world size. The loader's state is therefore a few numbers (epoch,
``position``: the samples of the epoch all ranks together have consumed, the seed, the world
size) plus torchdata's own (its workers' state), and:

* at the same world size, a loaded state resumes exactly where the batches stopped, workers
  included (torchdata's state);
* at another world size, the rest of the epoch's order (from ``position`` on) is split among
  the new ranks, so each sample of the epoch is seen once; only the tail is padded, repeating
  the epoch's first samples, when the rest does not divide among the ranks (as
  ``DistributedSampler`` pads).

Each ``iter()`` after the first starts the next epoch (``set_epoch`` is automatic), except the
first after a load, which continues the loaded epoch. Workers are seeded from ``seed``, the
epoch and the rank (the loader's ``generator``), so a resumed job's workers draw what the
uninterrupted job's drew.

torchdata is imported here only (``pip install "fleetx[data]"``), and this module only when a
loader is built.
"""
from __future__ import annotations

import warnings
from typing import Any, Iterator, Optional

import torch
from torch.utils.data import IterableDataset, Sampler

__all__ = ["DistributedLoader", "RankSampler", "check_dataset"]

# DataLoader keyword arguments the loader sets itself, and why the user may not
_OWN = {
    "sampler": "the loader splits the data among ranks with its own sampler: choose its order "
               "with shuffle= and seed=",
    "batch_sampler": "the loader batches its own sampler's indices: give batch_size= (and "
                     "drop_last=)",
    "generator": "the loader seeds its workers from seed, the epoch and the rank, so that a "
                 "resumed job draws what the uninterrupted one drew",
}


def check_dataset(dataset: Any) -> None:
    """Refuse what the loader cannot split among ranks by index.

    Raises:
        TypeError: ``dataset`` is an ``IterableDataset``, or has no ``__len__`` /
            ``__getitem__`` (the supported kind is named).
    """
    kind = type(dataset).__name__
    if isinstance(dataset, IterableDataset):
        raise TypeError(
            f"fleet.distributed_loader() takes a map-style dataset (a torch.utils.data.Dataset "
            f"with __len__ and __getitem__, e.g. a TensorDataset); {kind} is an IterableDataset, "
            f"which has no index to split among ranks and no position to save: shard it per "
            f"rank yourself and use torchdata's StatefulDataLoader")
    missing = [m for m in ("__len__", "__getitem__") if not hasattr(dataset, m)]
    if missing:
        raise TypeError(f"fleet.distributed_loader() takes a map-style dataset (with __len__ "
                        f"and __getitem__, e.g. a TensorDataset); {kind} has no "
                        f"{' or '.join(missing)}")


class RankSampler(Sampler):
    """This rank's indices of each epoch's order of the dataset.

    Args:
        length: samples in the dataset.
        rank: this process's rank.
        world_size: processes in the job.
        shuffle: a random order per epoch (``torch.randperm`` seeded by ``seed + epoch``);
            otherwise 0, 1, 2...
        seed: the seed of the epochs' orders.

    Example:
        >>> s = RankSampler(6, rank=1, world_size=2, shuffle=False)
        >>> list(s)
        [1, 3, 5]
        >>> s.seek(0, 2); list(s)   # 2 samples of epoch 0 consumed: the rest
        [3, 5]
    """

    def __init__(self, length: int, rank: int, world_size: int, shuffle: bool = True,
                 seed: int = 0) -> None:
        self.length, self.rank, self.world_size = length, rank, world_size
        self.shuffle, self.seed = shuffle, seed
        self.epoch = 0
        self.position = 0  # samples of the epoch's order consumed by all ranks together

    def seek(self, epoch: int, position: int) -> None:
        """Continue the order of ``epoch`` after its first ``position`` samples."""
        self.epoch, self.position = epoch, position

    def order(self) -> list:
        """The epoch's order of the whole dataset."""
        if not self.shuffle:
            return list(range(self.length))
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.length, generator=generator).tolist()

    def __iter__(self) -> Iterator[int]:
        order = self.order()
        while self.position < self.length:
            # past the end, the order wraps: the padding that gives every rank as many samples
            index = order[(self.position + self.rank) % self.length]
            self.position += self.world_size
            yield index
        self.position = self.length

    def __len__(self) -> int:
        """This rank's samples in a whole epoch."""
        return -(-self.length // self.world_size)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.seek(int(state["epoch"]), int(state["position"]))


class DistributedLoader:
    """This rank's batches of a map-style dataset, their position saved by training checkpoints.

    Built by ``fleet.distributed_loader``; iterate it as a ``DataLoader``. See the module
    docstring for the order of the samples and what a loaded state resumes.

    Args:
        dataset: a map-style dataset (``__len__`` and ``__getitem__``).
        batch_size: samples per batch on this rank.
        rank: this process's rank.
        world_size: processes in the job.
        shuffle: a new random order every epoch (seeded by ``seed + epoch``).
        seed: the seed of the orders and of the workers.
        **kwargs: ``torchdata.stateful_dataloader.StatefulDataLoader`` (``DataLoader``) keyword
            arguments: ``num_workers``, ``collate_fn``, ``drop_last``, ``pin_memory``...

    Raises:
        TypeError: ``dataset`` is not map-style, or ``kwargs`` names ``sampler``,
            ``batch_sampler`` or ``generator`` (the loader sets them; the error says what to
            give instead).
        ValueError: ``batch_size`` is not a whole number of at least 1, or the dataset is empty.
        ImportError: torchdata is not installed (``pip install "fleetx[data]"``).

    Example:
        >>> loader = DistributedLoader(torch.utils.data.TensorDataset(torch.arange(8.)), 2,
        ...                            rank=0, world_size=2, shuffle=False)
        >>> [b[0].tolist() for b in loader]
        [[0.0, 2.0], [4.0, 6.0]]
    """

    def __init__(self, dataset: Any, batch_size: int, rank: int, world_size: int,
                 shuffle: bool = True, seed: int = 0, **kwargs: Any) -> None:
        check_dataset(dataset)
        for name in kwargs.keys() & _OWN.keys():
            raise TypeError(f"fleet.distributed_loader(..., {name}=...) conflicts with the "
                            f"loader's own: {_OWN[name]}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"fleet.distributed_loader(batch_size=...) expects a whole number "
                             f"of samples of at least 1, got {batch_size!r}")
        if len(dataset) == 0:
            raise ValueError(f"fleet.distributed_loader(): the dataset "
                             f"({type(dataset).__name__}) is empty")
        StatefulDataLoader = _stateful_loader_class()
        self.dataset, self.batch_size = dataset, batch_size
        self.sampler = RankSampler(len(dataset), rank, world_size, bool(shuffle), int(seed))
        self._generator = torch.Generator()
        with warnings.catch_warnings():
            # torchdata 0.11 calls torch.set_vital, which torch 2.13 deprecates: not the user's
            warnings.filterwarnings("ignore", message=".*set_vital.*")
            self._loader = StatefulDataLoader(dataset, batch_size=batch_size,
                                              sampler=self.sampler, generator=self._generator,
                                              **kwargs)
        self._begun = False     # an iteration of the current epoch has started
        self._live = False      # that iteration has batches left
        self._pending: Optional[dict] = None  # torchdata's state loaded, for the next iter()

    @property
    def epoch(self) -> int:
        """The epoch being iterated, or after a load the one the next ``iter()`` continues."""
        return self.sampler.epoch

    @property
    def position(self) -> int:
        """Samples of the epoch consumed by all ranks together (at the last batch yielded)."""
        return self._position if self._begun else self.sampler.position

    def __len__(self) -> int:
        """Batches of a whole epoch on this rank."""
        return len(self._loader)

    def __iter__(self) -> Iterator[Any]:
        if self._begun:  # a new iter() is the next epoch, except the first after a load
            self.sampler.seek(self.sampler.epoch + 1, 0)
        self._begun, self._live, self._pending = True, True, None
        self._position = self.sampler.position
        # the workers' seeds: a function of (seed, epoch, rank), never of the global RNG
        self._generator.manual_seed(
            (self.sampler.seed * 1_000_003 + self.sampler.epoch) * 4099 + self.sampler.rank)
        return self._batches(iter(self._loader))

    def _batches(self, inner: Iterator[Any]) -> Iterator[Any]:
        step = self.batch_size * self.sampler.world_size
        for batch in inner:
            self._position = min(self.sampler.length, self._position + step)
            yield batch
        self._position, self._live = self.sampler.length, False

    def state_dict(self) -> dict:
        """The position (JSON-able): epoch, samples consumed, the order's seed, world size."""
        epoch, position = self.sampler.epoch, self.position
        inner = self._pending
        if self._begun:
            inner = self._loader.state_dict() if self._live else None
        if position >= self.sampler.length:  # the end of an epoch is the start of the next
            epoch, position, inner = epoch + 1, 0, None
        return {"epoch": epoch, "position": position, "seed": self.sampler.seed,
                "shuffle": self.sampler.shuffle, "length": self.sampler.length,
                "world_size": self.sampler.world_size, "batch_size": self.batch_size,
                "num_workers": self._loader.num_workers, "loader": inner}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` at the next ``iter()`` (saved at any world size).

        Raises:
            ValueError: ``state`` was saved by a loader over another number of samples, or with
                another ``shuffle`` or ``seed`` (the order it continues would differ).
        """
        for key, mine in (("length", self.sampler.length), ("shuffle", self.sampler.shuffle),
                          ("seed", self.sampler.seed)):
            if state.get(key) != mine:
                raise ValueError(f"the saved data loader position has {key}={state.get(key)!r}, "
                                 f"this loader {key}={mine!r}: build the loader as the job that "
                                 f"saved did (same dataset, shuffle and seed)")
        self.sampler.seek(int(state["epoch"]), int(state["position"]))
        same = all(state.get(k) == v for k, v in (
            ("world_size", self.sampler.world_size), ("batch_size", self.batch_size),
            ("num_workers", self._loader.num_workers)))
        # torchdata's state (its workers') resumes only the loader that saved it; another
        # world size, batch size or worker count continues from the position alone
        self._pending = state.get("loader") if same else None
        self._loader.load_state_dict(self._pending or {})
        self._begun = self._live = False


def _stateful_loader_class() -> Any:
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError as e:
        raise ImportError(f"fleet.distributed_loader() needs torchdata's StatefulDataLoader "
                          f"({e}): pip install \"fleetx[data]\"") from None
    return StatefulDataLoader
