"""The distributed-training algorithms, one module each.

A module here holds one algorithm a user switches on through ``DistributedStrategy``: its typed
``*_configs`` dataclass and, where fleetx acts on it through the plan, its
:class:`~fleetx.strategy.api.Strategy` class registered with
:func:`~fleetx.strategy.api.register`. The class carries everything the rest of fleetx needs
to know about it (the switch it answers to, its config, the strategies it requires, conflicts
with and runs after, Paddle's name for it) and changes training only through the hook points
of the :class:`~fleetx.strategy.api.TrainingContext`. The machinery around them stays one
level up, in :mod:`fleetx.strategy`: the contract (``api.py``), the planner, the typed-config
machinery and ``DistributedStrategy`` itself.

:func:`fleetx.strategy.planner.load_strategies` imports every module of this package, so a new
strategy is one new module here plus its ``DistributedStrategy`` field; nothing lists the
modules. Modules that only hold settings (``hybrid``, ``tensor_parallel``, ``gradient_scale``,
``trainer_desc``) declare what acts on them, or that nothing does. ``pipeline`` claims
``PipelineLayer`` models and builds their wrapper; ``sharding_engine`` is sharding's own
helper, and ``inert`` turns the settings declared without effect into plan warnings.

The modules import the contract and each other's ``Strategy`` classes (to declare relations
between them), never the fleet that runs them nor the planner that loads them: ``auto``, which
plans its candidate plans, uses the planner handed to it (``PlanInput.planner``,
``TrainingContext.planner``).
"""
