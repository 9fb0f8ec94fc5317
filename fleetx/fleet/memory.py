"""Per-rank memory accounting: the bytes of training state this process holds now.

``fleet.state_bytes()`` answers with three figures, ``parameters``, ``gradients`` and
``optimizer``, for the model given to ``distributed_model`` and the optimizer given to
``distributed_optimizer``. What is counted is what the process really holds, so it shows what
sharding saves:

* local shards only: a ``DTensor`` (FSDP2 parameters, their gradients and optimizer state) counts
  its ``to_local()`` part;
* each storage once, at its full size: tied weights count once, gradients that are views into
  one flat buffer (FSDP2's reduce-scatter output) count the buffer, padding included;
* gradients as they are at the moment of the call (none after ``zero_grad``, all after a
  backward); the parameters too (with sharding stage 2 the gathered parameters live from the
  forward to the backward, and the module then holds them as well as its shards);
* the inner optimizer's state, and, for an optimizer that keeps its own optimizer as ``.optim``
  (``ZeroRedundancyOptimizer``: its ``.optim`` holds this rank's partition, its own ``.state``
  is empty until a ``load_state_dict`` fills it with this rank's entries), both.

A storage is counted under the first of parameters, gradients, optimizer that holds it.
``fleet.explain()`` prints the figures expected for the plan (:mod:`fleetx.strategy.footprint`).
"""
from __future__ import annotations

from fleetx.fleet.api import FleetError
from fleetx.strategy.measured import measure

__all__ = ["measure", "MemoryQueries"]


class MemoryQueries:
    """``Fleet.state_bytes``: the bytes of training state this process holds (a mixin of
    ``Fleet``, which supplies ``_rm``, ``_models`` and ``_dist_optimizer``)."""

    def state_bytes(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state held by this process now.

        Local shards only (a sharded parameter counts its local part), gradients as they are
        at the call (none after ``zero_grad``; call it after ``backward`` to see them), the
        state of the optimizer given to ``distributed_optimizer`` (0 without one); each
        storage counted once. ``fleet.explain()`` prints what the plan should hold.

        Returns:
            ``{"parameters": int, "gradients": int, "optimizer": int}``.

        Raises:
            FleetError: before ``fleet.init``, or before ``distributed_model`` /
                ``distributed_optimizer`` (there is nothing to measure yet).

        Example:
            >>> opt.backward(loss)                      # doctest: +SKIP
            >>> fleet.state_bytes()                     # doctest: +SKIP
            {'parameters': 40400, 'gradients': 40400, 'optimizer': 0}
        """
        self._rm("state_bytes")
        dist_opt = self._dist_optimizer
        if not self._models and dist_opt is None:
            raise FleetError("fleet.state_bytes() measures the model and optimizer given to "
                             "fleet.distributed_model / fleet.distributed_optimizer; call them "
                             "first")
        inner = dist_opt.inner if dist_opt is not None else None
        return measure([m.module for m in self._models], inner)
