"""A server's own snapshots, for failover (``fleetrun --max_restarts N`` in a PS job).

With ``PSConfig.snapshot_dir`` set, server ``i`` of ``n`` keeps the latest copy of its shard
in ``<snapshot_dir>/server-<i>-of-<n>/``: a checkpoint of :mod:`fleetx.checkpoint` (written
beside the previous one, committed by renaming its manifest, so a kill at any moment leaves a
whole snapshot) holding one save-mode-0 server folder (:func:`fleetx.ps.checkpoint.save_server`:
every row with its optimizer state and statistics, the dense slices with theirs). The
manifest's ``info`` records the job (``PSConfig.snapshot_job``: a snapshot of an earlier job in
the same folder is never loaded) and how many pushes of each worker the shard had applied, so
that a worker reconnecting to the restarted server can say how many of its updates were lost.

Snapshots never touch the chain of the user's own saves (``save_persistables``): a delta saved
after a snapshot still follows the user's last save.

Example:
    >>> snaps = Snapshots(config, 0)                                # doctest: +SKIP
    >>> restored = snaps.restore(shard)      # None: none of this job yet
    >>> snaps.take(shard, {0: 12, 1: 9})
"""
from __future__ import annotations

import logging
import os
import time
from typing import NamedTuple, Optional

from fleetx.checkpoint import Checkpoint, SaveWriter
from fleetx.checkpoint.manifest import has_checkpoint
from fleetx.ps.api import PSConfig
from fleetx.ps.checkpoint import load_server_folder, save_server, server_folder

__all__ = ["Snapshots", "Restored"]

log = logging.getLogger("fleetx.ps")


class Restored(NamedTuple):
    """The snapshot a restarted server loaded: its save id, when it was written (UTC text),
    and each worker rank's pushes it holds."""

    save_id: str
    created: str
    pushes: dict


class Snapshots:
    """Server ``index``'s snapshots under ``config.snapshot_dir``.

    Args:
        config: the cluster; ``snapshot_dir`` must be set.
        index: the server.
    """

    def __init__(self, config: PSConfig, index: int) -> None:
        self.config, self.index = config, index
        self.folder = server_folder(index, config.num_servers)
        self.dirname = os.path.join(os.path.abspath(config.snapshot_dir), self.folder)
        self.last = time.monotonic()  # the interval counts from the start

    def due(self, now: float) -> bool:
        return now - self.last >= self.config.snapshot_interval

    def available(self) -> bool:
        """A snapshot of this job is committed here (its files may still prove damaged on
        load).

        Raises:
            CheckpointError: the snapshot's manifest is damaged (named): the workers will not
                send their initial values again, so starting afresh would lose the job.
        """
        return self._open() is not None

    def _open(self) -> Optional[Checkpoint]:
        """The committed snapshot of this job, its manifest read; None when there is no
        snapshot or it is of another job."""
        if not has_checkpoint(self.dirname):
            return None
        ckpt = Checkpoint(self.dirname)
        if ckpt.manifest.info.get("snapshot_job") != self.config.snapshot_job:
            log.info("server %d: the snapshot in %s is of another job (%r); not loading it",
                     self.index, self.dirname, ckpt.manifest.info.get("snapshot_job"))
            return None
        return ckpt

    def take(self, shard, pushes: dict) -> str:
        """Write and commit a snapshot of ``shard``; returns its save id.

        Raises:
            CheckpointError: a table holds NaN or inf, or a file cannot be written (the
                previous snapshot stays).
        """
        began = time.monotonic()
        writer = SaveWriter(self.dirname)
        rows = save_server(writer, self.index, self.config.num_servers, self.config.shard_num,
                           shard.sparse, shard.dense, 0)
        writer.commit({"mode": 0, "snapshot_job": self.config.snapshot_job,
                       "pushes": {str(r): int(n) for r, n in pushes.items()},
                       "initialized": sorted(shard.initialized)})
        self.last = time.monotonic()
        log.info("server %d: snapshot %s written to %s (%s rows, %.2f s)", self.index,
                 writer.save_id, self.dirname, sum(rows.values()), self.last - began)
        return writer.save_id

    def restore(self, shard) -> Optional[Restored]:
        """Load this job's latest snapshot into ``shard`` (its tables as a fresh server built
        them); None when there is none (the shard is left as it is).

        Raises:
            CheckpointError: the snapshot is damaged (a file does not match its manifest, or
                the manifest itself; named).
        """
        ckpt = self._open()
        if ckpt is None:
            return None
        loaded = load_server_folder(ckpt, self.index, self.config.num_servers,
                                    self.config.shard_num, shard.sparse, shard.dense)
        info = ckpt.manifest.info
        shard.initialized |= set(info.get("initialized", ())) & set(loaded.rows)
        pushes = {int(r): int(n) for r, n in dict(info.get("pushes", {})).items()}
        return Restored(ckpt.save_id, ckpt.manifest.created, pushes)
