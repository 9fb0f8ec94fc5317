"""Async mode: gradients are queued, merged and sent by a background thread.

``step`` puts the step's gradient arrays (taken, not copied: the caller must not change them
afterwards) into a bounded queue (``send_queue_size``; a full queue makes ``step`` wait, which
bounds staleness) and returns. A sender thread takes up to
``max_merge_var_num`` queued steps, waiting ``send_wait_times`` polls of 1 ms for more to
arrive, sums them, and pushes the sum as ONE request per server; at most
``thread_pool_size`` such pushes are in flight. A push's reply carries the servers' current
dense weights (every push's by default; with ``independent_recv_thread``, every
``min_send_grad_num_before_recv``-th push's, so the dense weights cross the wire less often),
received into a new array; the next ``step`` hands the newest ones over in ``params``
(replacing the entries: the runtime adopts the arrays as the model's storage, no copy).

Merging sums rather than averages: with SGD, applying the sum of k gradients is what applying
them one after another would do, which is what async training means.
"""
from __future__ import annotations

import collections
import queue
import threading
import time
from typing import Optional

import numpy as np

from fleetx.ps.api import PSMode, PSError
from fleetx.ps_torch.communicator import Communicator

__all__ = ["AsyncCommunicator"]


def _merge(batch: list) -> tuple[dict, dict]:
    dense: dict = {}
    for d, _ in batch:
        for n, g in d.items():
            dense[n] = g if n not in dense else dense[n] + g
    parts = collections.defaultdict(list)
    for _, s in batch:
        for n, ids_grads in s.items():
            parts[n].append(ids_grads)
    sparse = {n: (np.concatenate([i for i, _ in p]), np.concatenate([g for _, g in p]))
              if len(p) > 1 else p[0] for n, p in parts.items()}
    return dense, sparse


class AsyncCommunicator(Communicator):
    """Gradients applied on arrival at the servers; sending overlaps training."""

    mode = PSMode.ASYNC

    def _started(self, dense):
        self._queue: queue.Queue = queue.Queue(maxsize=self.comm.send_queue_size)
        self._latest: Optional[dict] = None
        self._lock = threading.Condition()
        self._unsent = 0  # steps queued or in flight
        self._error: Optional[BaseException] = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._send_loop, name="ps-async-send",
                                        daemon=True)
        self._thread.start()

    def step(self, params, grads, sparse_grads):
        self._check()
        # the arrays are taken, not copied: the caller hands over fresh ones every step
        item = ({n: np.asarray(g, np.float32).reshape(-1) for n, g in grads.items()},
                {n: (np.asarray(i, np.int64).reshape(-1),
                     np.asarray(g, np.float32).reshape(np.size(i), -1))
                 for n, (i, g) in sparse_grads.items()})
        with self._lock:
            self._unsent += 1
        while True:  # a full queue blocks, but never past a failed sender
            try:
                self._queue.put(item, timeout=0.1)
                break
            except queue.Full:
                self._check()
        with self._lock:
            latest, self._latest = self._latest, None
        params.update(latest or {})  # newer arrays than the model's, given up: the caller adopts

    def flush(self):
        if not hasattr(self, "_thread"):  # never started
            return
        with self._lock:
            while self._unsent and self._error is None:
                self._lock.wait(0.1)
        self._check()

    def refresh(self, names: list) -> dict:
        """Flush, then the servers' current weights of the dense tables ``names``. A push reply
        not yet handed over by ``step`` is dropped: it is older than these, and the next step
        must not take the model back to it."""
        self.flush()
        weights = self.client.pull(dense=names).wait().dense if names else {}
        with self._lock:
            self._latest = None
        return weights

    def stop(self):
        try:
            self.flush()
        finally:
            if hasattr(self, "_thread"):
                self._stopping.set()
                self._thread.join(timeout=self.config.dead_after)
            self.client.stop()

    def _check(self) -> None:
        if self._error is not None:
            raise PSError(f"async sending failed: {self._error}") from self._error

    def _send_loop(self) -> None:
        inflight: collections.deque = collections.deque()
        pushes = 0
        try:
            while not self._stopping.is_set():
                batch = self._collect()
                if batch:
                    dense, sparse = _merge(batch)
                    pushes += 1
                    recv = pushes % self.comm.recv_every == 0
                    handle = self.client.push(sparse, dense,
                                              pull_dense=list(dense) if recv else ())
                    inflight.append((handle, len(batch)))
                while inflight and (len(inflight) >= self.comm.thread_pool_size
                                    or inflight[0][0].done() or not batch):
                    self._finish(*inflight.popleft())
        except BaseException as e:  # surfaced by the next step()/flush()
            with self._lock:
                self._error = e
                self._lock.notify_all()

    def _collect(self) -> list:
        try:
            batch = [self._queue.get(timeout=0.05)]
        except queue.Empty:
            return []
        waits = 0
        while len(batch) < self.comm.max_merge_var_num:
            try:
                batch.append(self._queue.get_nowait())
            except queue.Empty:
                if waits >= self.comm.send_wait_times:
                    break
                waits += 1
                time.sleep(0.001)
        return batch

    def _finish(self, handle, steps: int) -> None:
        flat, _ = handle.wait()
        with self._lock:
            if flat:
                self._latest = flat
            self._unsent -= steps
            self._lock.notify_all()
