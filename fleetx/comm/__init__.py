"""Collective communication: joining the world, carrying gradients, and naming the rank at fault.

What it offers:

* ``groups.py``: the rendezvous over a ``TCPStore`` that names ranks that never arrive, the
  training process group, a gloo side group for host-side utilities, ``pick_backend`` and
  ``default_timeout``;
* ``hooks.py``: the one DDP comm hook, composed from the stages strategies add
  (``GradientCodec`` casts or sparsifies, ``AllReducePath`` routes, ``Channels`` spreads buckets);
* ``progress.py`` / ``blame.py``: every rank publishes how far it got; a rank whose collective
  fails works out which peer did not arrive and says so (and leaves a ``Blame`` for fleetrun);
* ``debug.py``: ``FLEETX_DEBUG_COLLECTIVES=1``, every rank checks the others make the same call;
* ``api.py``: the contract types: ``CommError``, ``Blame`` and its fault file, the call-check
  protocol.

What it may import: torch, the standard library, :mod:`fleetx.env` and its own modules. It
imports no other fleetx package (``fleet``, ``strategy``, ``launch``, ``ps``...): they import it.
``api.py`` imports no torch, so the launcher reads a fault report without it.

Invariants:

* every wait is bounded (the collective timeout, ``FLEETX_TIMEOUT``) and a peer that does not
  come is an error naming its rank, never a silent hang;
* ranks never diverge silently: a gradient pipeline sends the same calls in the same order on
  every rank, and the debug checks, when on, prove it before each call;
* the environment is read through :mod:`fleetx.env` only.
"""
