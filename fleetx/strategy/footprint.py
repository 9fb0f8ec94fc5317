"""Expected training-state bytes per rank: parameters, gradients, optimizer state.

A :class:`Footprint` is what one process should hold for a plan, computed from what the planner
knows without running anything: the model's parameter bytes (:class:`ModelInfo`), the optimizer
class and options (:class:`OptimizerInfo`), and what each applied strategy changes (a strategy
that partitions state overrides ``Strategy.footprint``). ``fleet.explain()`` prints it beside the
plan; ``fleet.state_bytes()`` measures the same three figures on a live process.

How many tensors of a parameter's size each optimizer keeps (:data:`STATE_TENSORS`) comes from
PyTorch's implementations: Adam keeps ``exp_avg`` and ``exp_avg_sq`` (and ``max_exp_avg_sq`` with
``amsgrad``) plus a one-element ``step`` tensor; SGD keeps a ``momentum_buffer`` only when
``momentum`` is not 0. The one-element tensors are counted apart (:attr:`Footprint.scalars`)
because sharding divides them differently: ZeRO stage 1 gives each parameter's whole state to one
rank, FSDP (stages 2 and 3) gives every rank a shard of every parameter, and so a ``step`` each.

Example:
    >>> model = ModelInfo(param_numels=(1000,), param_bytes=(4000,), trainable=(True,))
    >>> fp = Footprint.of(model, OptimizerInfo("Adam", (("amsgrad", False),)))
    >>> (fp.parameters, fp.gradients, fp.optimizer)
    (4000, 4000, 8004)
    >>> fp.sharded(stage=2, degree=4).optimizer
    2004
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional

from fleetx.strategy.plan import ModelInfo, OptimizerInfo

__all__ = ["Footprint", "STATE_TENSORS", "SCALAR_BYTES", "state_tensors"]

#: Bytes of one one-element state tensor (``step`` is float32 in torch's optimizers).
SCALAR_BYTES = 4

# class name -> fn(options) -> (tensors of the parameter's size, one-element tensors) per
# trainable parameter, once every parameter has taken a step.
STATE_TENSORS: dict[str, Callable[[OptimizerInfo], tuple[int, int]]] = {
    "SGD": lambda o: (1 if o.get("momentum", 0) else 0, 0),
    "Adam": lambda o: (3 if o.get("amsgrad", False) else 2, 1),
    "AdamW": lambda o: (3 if o.get("amsgrad", False) else 2, 1),
    "Adamax": lambda o: (2, 1),
    "NAdam": lambda o: (2, 2),  # step and mu_product
    "RAdam": lambda o: (2, 1),
    "Adagrad": lambda o: (1, 1),
    "Adadelta": lambda o: (2, 1),
    "RMSprop": lambda o: (1 + bool(o.get("momentum", 0)) + bool(o.get("centered", False)), 1),
    "Rprop": lambda o: (2, 1),  # prev and step_size
    "ASGD": lambda o: (1, 3),  # ax; eta, mu and step
    "LarsMomentum": lambda o: (1, 0),  # fleetx.optim: velocity
    "Lamb": lambda o: (2, 0),  # fleetx.optim: moments; its step is a Python int
}


def state_tensors(optimizer: OptimizerInfo) -> Optional[tuple[int, int]]:
    """(full-size tensors, one-element tensors) kept per trainable parameter, or None when the
    optimizer class is not in :data:`STATE_TENSORS`."""
    rule = STATE_TENSORS.get(optimizer.class_name)
    return rule(optimizer) if rule is not None else None


@dataclass(frozen=True)
class Footprint:
    """Expected bytes one rank holds between steps, once every parameter has a gradient and
    optimizer state.

    Attributes:
        parameters: parameter bytes (local shards).
        gradients: gradient bytes (local shards) after a backward.
        optimizer: optimizer-state bytes, ``scalars`` included; None when the optimizer class
            is unknown (see :data:`STATE_TENSORS`).
        scalars: the part of ``optimizer`` held in one-element tensors (``step``).
        parameters_in_step: parameter bytes held from forward to backward, when it differs
            from ``parameters`` (stage 2 keeps the gathered parameters, beside the shards,
            until the backward).
        how: what shaped the figures, for the printed plan (``"sharding stage 2 over 4
            ranks"``); empty for a plain copy of everything.
        missing: why ``optimizer`` is None.
    """

    parameters: int
    gradients: int
    optimizer: Optional[int]
    scalars: int = 0
    parameters_in_step: Optional[int] = None
    how: str = ""
    missing: str = ""

    @classmethod
    def of(cls, model: ModelInfo, optimizer: OptimizerInfo) -> "Footprint":
        """Every rank holding a full copy (plain data parallel, or one process)."""
        params = sum(model.param_bytes)
        trainable = [b for b, t in zip(model.param_bytes, model.trainable) if t]
        if not optimizer.class_name:
            return cls(params, sum(trainable), None, missing="no optimizer given yet")
        kept = state_tensors(optimizer)
        if kept is None:
            return cls(params, sum(trainable), None,
                       missing=f"{optimizer.class_name} is not in footprint.STATE_TENSORS")
        tensors, scalars = kept
        scalar_bytes = scalars * SCALAR_BYTES * len(trainable)
        return cls(params, sum(trainable), tensors * sum(trainable) + scalar_bytes, scalar_bytes)

    def sharded(self, stage: int, degree: int) -> "Footprint":
        """The figures when state is partitioned over ``degree`` ranks at ``stage`` (1: the
        optimizer state, 2: also the gradients, 3: also the parameters), as averages over the
        group: uneven partitions put a little more on some ranks.

        With FSDP (stages 2 and 3) the parameters rest sharded between steps at both stages;
        stage 2 differs in keeping them gathered, beside the shards, from forward to backward
        (:attr:`parameters_in_step`).

        Raises:
            ValueError: ``stage`` is not 1, 2 or 3, or ``degree`` < 1.
        """
        if stage not in (1, 2, 3):
            raise ValueError(f"sharding stage must be 1, 2 or 3, got {stage!r}")
        if degree < 1:
            raise ValueError(f"sharding degree must be >= 1, got {degree!r}")
        optimizer = None
        scalars = self.scalars // degree if stage == 1 else self.scalars
        if self.optimizer is not None:
            optimizer = (self.optimizer - self.scalars) // degree + scalars
        gradients = self.gradients if stage == 1 else self.gradients // degree
        parameters = self.parameters if stage == 1 else self.parameters // degree
        # FSDP2 swaps the gathered parameters in for the forward and keeps its shards: both
        # are held until the backward reshards.
        in_step = self.parameters + parameters if stage == 2 else None
        return replace(self, parameters=parameters, gradients=gradients, optimizer=optimizer,
                       scalars=scalars, parameters_in_step=in_step,
                       how=f"sharding stage {stage} over {degree} ranks")

    @property
    def total(self) -> Optional[int]:
        """parameters + gradients + optimizer (None when the optimizer state is unknown)."""
        if self.optimizer is None:
            return None
        return self.parameters + self.gradients + self.optimizer

    def __str__(self) -> str:
        opt = f"unknown ({self.missing})" if self.optimizer is None else _size(self.optimizer)
        text = (f"expected state per rank: parameters {_size(self.parameters)}, gradients "
                f"{_size(self.gradients)}, optimizer {opt}")
        if self.parameters_in_step is not None:
            text += f"; parameters {_size(self.parameters_in_step)} from forward to backward"
        return text + (f" ({self.how})" if self.how else "")


def _size(n: int) -> str:
    """Bytes, exactly, with a readable unit beside large ones."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n:,} B ({n / scale:.1f} {unit})"
    return f"{n:,} B"
