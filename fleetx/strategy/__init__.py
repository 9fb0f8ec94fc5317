"""Distributed strategies: which algorithms run, in what order and why, and their settings.

The algorithms themselves are :mod:`fleetx.strategy.algorithms`, one module each. This package
holds the machinery around them: the contract every strategy follows and the training context
it changes (``api.py``, with the plan's types in ``plan.py``), the pure planner
(``planner.py``), the typed settings (``config.py``, ``fields.py``, and ``build.py`` for
Paddle's build and execution strategies) behind Fleet's ``DistributedStrategy``
(``distributed_strategy.py``, with its file formats and printed overview), the process grid the
hybrid degrees resolve to (``topology.py``) and the state bytes a plan is expected to hold and
does hold (``footprint.py``, ``measured.py``).
"""
