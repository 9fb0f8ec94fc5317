"""``fleet.distributed_loader``: this rank's batches of a dataset, whose position the training
checkpoints save and restore (a mixin of :class:`~fleetx.fleet.fleet.Fleet`).

The loader itself (:class:`fleetx.data.loader.DistributedLoader`) knows nothing of the fleet: it
is handed the rank and world size. The fleet keeps every loader it built, in creation order;
``save_checkpoint`` saves their states and ``load_checkpoint`` / ``auto_checkpoint`` give them
back (:mod:`fleetx.checkpoint.training`).
"""
from __future__ import annotations

from typing import Any

from fleetx.fleet.api import FleetError

__all__ = ["LoaderCalls"]


class LoaderCalls:
    """Data loaders registered with the fleet (mixed into ``Fleet``)."""

    _loaders: tuple = ()        # built since fleet.init, in creation order
    _unrestored_loaders = 0     # positions the last load found and no loader took

    def distributed_loader(self, dataset: Any, batch_size: int, shuffle: bool = True,
                           seed: int = 0, **kwargs: Any) -> Any:
        """This rank's share of a map-style dataset, in batches; its position (epoch, samples
        consumed, the order's seed, workers' state) is saved by :meth:`save_checkpoint` and
        restored by :meth:`load_checkpoint` / :meth:`auto_checkpoint` with no user code.

        Each epoch has one order of the whole dataset (``torch.randperm`` seeded by ``seed +
        epoch``, or 0, 1, 2... without ``shuffle``) that the ranks share out in lock-step; the
        tail is padded with the epoch's first samples when the dataset does not divide among
        the ranks. Every ``iter()`` starts the next epoch, except the first after a load, which
        continues the saved epoch from the sample where it stopped. Resumed at another world
        size, the rest of the epoch is split among the new ranks, each sample seen once.

        Build every loader before the load (before ``auto_checkpoint``): checkpoint positions
        go to the loaders in creation order, and a load refuses a checkpoint holding another
        number of them.

        Args:
            dataset: a map-style dataset (``__len__`` and ``__getitem__``: a ``Dataset``,
                ``TensorDataset``...).
            batch_size: samples per batch on each rank.
            shuffle: a new random order every epoch.
            seed: the seed of the orders (and of the workers' random numbers).
            **kwargs: torchdata ``StatefulDataLoader`` (``DataLoader``) keyword arguments:
                ``num_workers``, ``collate_fn``, ``drop_last``, ``pin_memory``...

        Returns:
            A :class:`fleetx.data.loader.DistributedLoader`: iterate it as a ``DataLoader``;
            ``loader.epoch`` is the epoch it iterates (after a load: the one it continues).

        Raises:
            FleetError: called before ``fleet.init``, or after a load that found loader
                positions no loader took (build the loaders before the load).
            TypeError: ``dataset`` is an ``IterableDataset`` (or has no ``__len__`` /
                ``__getitem__``), or ``kwargs`` names ``sampler``, ``batch_sampler`` or
                ``generator`` (the loader sets them itself).
            ValueError: ``batch_size`` is not a whole number of at least 1.
            ImportError: torchdata is missing (``pip install "fleetx[data]"``).

        Example:
            >>> loader = fleet.distributed_loader(dataset, batch_size=32, num_workers=2)
            >>> start = fleet.auto_checkpoint("ckpt", every_steps=100)
            >>> for epoch in range(loader.epoch, epochs):
            ...     for x, y in loader:
            ...         opt.minimize(loss_fn(model(x), y))
        """
        rm = self._rm("distributed_loader")
        if self._unrestored_loaders:
            raise FleetError(
                f"fleet.distributed_loader() after a load: the checkpoint loaded held the "
                f"position of {self._unrestored_loaders} data loader(s), and a loader built now "
                f"would start at epoch 0; build the loaders before fleet.load_checkpoint / "
                f"fleet.auto_checkpoint")
        from fleetx.data.loader import DistributedLoader

        loader = DistributedLoader(dataset, batch_size, rm._worker_index(), rm._worker_num(),
                                   shuffle=shuffle, seed=seed, **kwargs)
        self._loaders = (*self._loaders, loader)
        return loader

    def _loaded_loaders(self, saved: int) -> None:
        """After a load: ``saved`` positions were in the checkpoint (none taken without
        loaders)."""
        self._unrestored_loaders = saved if not self._loaders else 0
