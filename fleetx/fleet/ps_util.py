"""``fleet.utils.ps_util``: Paddle's module of that name, with :class:`DistributedInfer`.

Distributed inference evaluates a model whose tables stay on the parameter servers: every
worker scores its shard of the data with lookups that never create rows, and the workers merge
their metrics with ``fleet.metrics`` (``docs/ps_inference.md``).

Example:
    >>> infer = fleet.utils.DistributedInfer(model)          # doctest: +SKIP
    >>> infer.init_distributed_infer_env(dirname="ckpt")     # every role; servers serve here
    >>> if fleet.is_worker():
    ...     model = infer.get_dist_infer_program()           # the model, in eval mode
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from fleetx.fleet.api import FleetError, default_fleet
from fleetx.role_maker import RoleMakerBase

__all__ = ["DistributedInfer"]

#: the stand-in optimizer's rate when the script gives none (nothing steps in inference)
_UNUSED_LR = 0.01


class DistributedInfer:
    """Inference on the parameter servers' tables, after training or from a save.

    The PyTorch shape of Paddle's ``DistributedInfer(main_program, startup_program)``: it takes
    the model (and, optionally, the optimizer the training script used) instead of programs.

    * **After training in the same job**, call :meth:`init_distributed_infer_env` on every
      worker once its training loop is done (where Paddle's workers would skip
      ``stop_worker``): the worker sends what it still holds, the servers refuse its updates
      from then on, and it waits until every worker got there, so the tables no longer change;
      then lookups read the servers without creating rows, in sync, async and GEO mode alike.
      (Paddle's call is a no-op after training; this one makes the switch explicit.)
    * **An inference-only job** (``fleetrun`` running the script with, say, ``--infer``):
      call it on every role with ``dirname``. A server loads the save and serves it read-only
      until the workers stop (every update, initialisation or new row is refused, naming the
      mode) and then returns; a worker connects as a reader and loads the servers' dense
      weights. Without servers (plain ``python``) the process loads ``dirname`` itself.

    If the script has not called ``fleet.distributed_optimizer`` (nothing to train), this
    builds what the tables need: ``fleet.init(role_maker)`` when the fleet is not initialised,
    ``fleet.distributed_model(model)``, and ``fleet.distributed_optimizer`` with ``optimizer``
    (default: ``SGD`` at an unused rate) and the strategy given to ``fleet.init``. Every role
    must then build the same model, as in training.

    Args:
        model: the model (plain, or what ``fleet.distributed_model`` returned).
        optimizer: the optimizer whose param groups lay out the dense tables; only used when
            the script built none.
        fleet: the :class:`~fleetx.fleet.fleet.Fleet` (default: ``fleetx.fleet``'s).

    Example:
        >>> infer = DistributedInfer(model)                      # doctest: +SKIP
        >>> infer.init_distributed_infer_env(dirname="ckpt")
        >>> scores = infer.get_dist_infer_program()(batch)
    """

    def __init__(self, model: Optional[torch.nn.Module] = None,
                 optimizer: Optional[torch.optim.Optimizer] = None, *,
                 fleet: Optional[Any] = None) -> None:
        self._model, self._optimizer, self._fleet = model, optimizer, fleet

    @property
    def fleet(self) -> Any:
        if self._fleet is None:
            self._fleet = default_fleet()
        return self._fleet

    def init_distributed_infer_env(self, exe: Any = None, loss: Any = None,
                                   role_maker: Optional[RoleMakerBase] = None,
                                   dirname: Optional[str] = None) -> None:
        """Turn this process to inference (on a server: serve ``dirname`` read-only until the
        workers stop).

        Args:
            exe, loss: Paddle's executor and loss; PyTorch has neither, so they are ignored
                (the model's forward computes what it computes).
            role_maker: for ``fleet.init`` when the fleet is not initialised yet.
            dirname: the folder ``save_persistables`` wrote; required on the servers of an
                inference-only job, loaded by the process itself without servers, unused
                after training.

        Raises:
            FleetError: a collective job, or no model to lay out.
            fleetx.ps.api.StateError: a server without ``dirname``.
        """
        fleet = self.fleet
        if fleet._role_maker is None:
            fleet.init(role_maker)
        if fleet._rm("init_distributed_infer_env").is_collective:
            raise FleetError("DistributedInfer serves parameter-server jobs; in a collective "
                             "job evaluate the model directly")
        if getattr(fleet._ctx, "runtime", None) is None or fleet._dist_optimizer is None:
            self._build(fleet)
        fleet._runtime("init_distributed_infer_env").init_inference(dirname)

    def _build(self, fleet: Any) -> None:
        """The tables of a script that trains nothing: model, stand-in optimizer, plan."""
        if self._model is None:
            raise FleetError("DistributedInfer(model): pass the model, or call "
                             "fleet.distributed_optimizer(...) before init_distributed_infer_env")
        if not fleet._models or fleet._models[-1] is not self._model:
            self._model = fleet.distributed_model(self._model)
        optimizer = self._optimizer or torch.optim.SGD(self._model.parameters(), lr=_UNUSED_LR)
        fleet.distributed_optimizer(optimizer)

    def get_dist_infer_program(self) -> torch.nn.Module:
        """The model to score with, in eval mode (its lookups read the servers).

        Raises:
            FleetError: no model was given and the fleet wraps none.
        """
        model = self._model
        if model is None and self.fleet._models:
            model = self.fleet._models[-1]
        if model is None:
            raise FleetError("DistributedInfer(model): no model to return; pass it")
        return model.eval()
