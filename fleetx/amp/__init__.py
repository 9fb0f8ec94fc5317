"""Mixed precision: the dynamic loss scaler and the module-level precision lists.

``torch.autocast`` decides the precision of each op; this package adds what Paddle's AMP has and
autocast lacks:

* :class:`~fleetx.amp.scaler.LossScaler`: dynamic loss scaling with Paddle's update rule (shrink
  after ``decr_every_n_nan_or_inf`` bad steps in a row, grow after ``incr_every_n_steps`` good
  ones, skip every step whose gradients hold inf or nan).
* :mod:`~fleetx.amp.precision`: Paddle's op names mapped onto ``torch.nn`` module types, and the
  forward hooks that keep black-listed modules in float32 and white-listed ones in low precision.

The ``amp`` strategy (``fleetx/strategy/algorithms/amp.py``) puts them together.

What it may import: torch and its own modules; no other fleetx package (``strategy`` imports it,
not the reverse), so both pieces can be used without a fleet.

Invariants:

* the scale follows Paddle's ``update_loss_scaling`` rule exactly (floor at 1, no growth past
  float32's range); a step whose gradients hold inf or nan is skipped whole, optimizer state
  included (Paddle's static graph would zero the gradients and still step);
* the hooks change precision only inside the autocast region they are installed for; outside it
  a module runs as the user wrote it.
"""
from fleetx.amp.precision import PADDLE_OPS, PrecisionHooks, low_precision_dtype, resolve
from fleetx.amp.scaler import LossScaler

__all__ = ["LossScaler", "PrecisionHooks", "PADDLE_OPS", "low_precision_dtype", "resolve"]
