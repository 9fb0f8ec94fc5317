"""Inference on the parameter servers' tables: lookups that never create rows, no updates.

A worker reaches inference in one of two ways (``docs/ps_inference.md``):

* **an inference-only job** (``DistributedInfer(model).init_distributed_infer_env(dirname=D)``
  in a job that never trained): the servers load the save ``D`` and serve it read-only, and
  :meth:`InferenceSession.connect` registers as a reading worker (HELLO says ``infer``) and loads
  the servers' dense weights;
* **after training in the same job** (the same call after the training loop):
  :meth:`InferenceSession.after_training` sends what the worker still holds (an async queue, a
  GEO worker's pending steps), tells every server that this worker only reads from now on
  (INFER: its writes are refused and the sync rounds go on without it), and waits at a barrier
  for every other worker to do the same, so no update is still on its way. Then it loads the
  servers' dense weights. From that point the tables no longer change, so what this worker
  scores is exactly what ``save_persistables`` writes and what an inference-only job started
  from that save scores.

Either way lookups go straight to the servers with ``create=False`` (a GEO worker's local
tables are no longer used) and the optimizer may not step.
"""
from __future__ import annotations

from typing import Callable, Mapping, Optional

import numpy as np

from fleetx.ps.api import PSConfig, StateError
from fleetx.ps.client import KVClient
from fleetx.ps.tracker import Handle
from fleetx.ps_torch.layout import ModelLayout, RemoteSparseBackend

__all__ = ["InferenceSession", "INFER_BARRIER", "NO_STEP"]

#: the barrier every worker passes when it turns to inference after training
INFER_BARRIER = "fleetx.ps.infer"
#: what an optimizer step in inference mode raises
NO_STEP = ("optimizer step in inference mode: this worker called DistributedInfer."
           "init_distributed_infer_env() and only reads; train before turning to inference")


class _ServerReads:
    """What :class:`RemoteSparseBackend` asks of a communicator, answered by the servers and
    never creating a row (whatever the caller asks)."""

    def __init__(self, client: KVClient) -> None:
        self.client = client

    def pull_sparse(self, ids: Mapping[str, np.ndarray], create: bool = False) -> Handle:
        return self.client.pull(ids, create=False)


class _Reader:
    """The communicator an inference-only worker has: its client, nothing queued to send
    (what ``fleet.save_inference_model`` and ``fleet.table_stats`` ask of a session)."""

    def __init__(self, client: KVClient) -> None:
        self.client = client

    def flush(self) -> None:
        """Nothing is ever queued: an inference-only worker sends no update."""


class InferenceSession:
    """A worker that only reads: lookups from the servers, the servers' dense weights.

    Args:
        layout: the model's tables (every dense table is loaded, heter sections' included:
            in inference they run on the worker).
        client: a started client.
        stop: disconnects (BYE).
        save: writes a checkpoint (after training only; None in an inference-only job).

    Build it with :meth:`connect` or :meth:`after_training`.
    """

    def __init__(self, layout: ModelLayout, client: KVClient, stop: Callable[[], None],
                 save: Optional[Callable[[str, int], object]] = None, comm=None) -> None:
        self.layout, self.client, self.stopped = layout, client, False
        self._stop, self._save = stop, save
        self.comm = comm if comm is not None else _Reader(client)
        self.backend = RemoteSparseBackend(_ServerReads(client), create=False)
        names = [t.name for t in layout.tables.dense]
        if names:
            layout.load_dense(client.pull(dense=names).wait().dense)

    @classmethod
    def connect(cls, layout: ModelLayout, config: PSConfig, rank: int) -> "InferenceSession":
        """A worker of an inference-only job: register as a reader and load the dense weights.

        Raises:
            PSConfigError: a server has another table layout, or serves a training job's mode
                other than this one.
            PSTimeoutError / AuthError: as :meth:`KVClient.start`.
        """
        client = KVClient(config, rank, layout.tables, infer=True)
        client.start()
        return cls(layout, client, client.stop)

    @classmethod
    def after_training(cls, layout: ModelLayout, comm,
                       save: Callable[[str, int], object]) -> "InferenceSession":
        """Turn a training worker's communicator to inference: flush, INFER, barrier, load;
        ``save(dirname, mode)`` writes a checkpoint from it (``save_persistables``).

        Raises:
            PeerLostError: a server or another worker was lost while this one waited.
        """
        comm.flush()
        comm.client.turn_to_inference().wait()
        comm.client.barrier(INFER_BARRIER).wait()
        return cls(layout, comm.client, comm.stop, save, comm)

    def set_lr(self, lr: float, tables: list) -> None:
        """Nothing trains: a learning rate has nothing to change."""

    def save(self, dirname: str, mode: int = 0) -> None:
        if self._save is None:
            raise StateError("save_persistables() in an inference-only job: it reads a save "
                             "and writes none; save in the training job")
        self._save(dirname, mode)

    def barrier(self, name: str) -> None:
        self.client.barrier(name).wait()

    def stop(self) -> None:
        self.stopped = True
        self._stop()
