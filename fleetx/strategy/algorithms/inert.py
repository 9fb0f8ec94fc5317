"""Settings fleetx accepts but does not act on, named in the plan instead of ignored silently.

Some of Paddle's settings describe machinery PyTorch does not have (static-graph passes, cuDNN
workspace limits, fusion by TFLOPS), features fleetx does not offer yet (pipeline,
tensor and hybrid parallelism, recompute's offload) or parameter-server knobs with nothing to tune here. A
script written for Paddle may set them; rejecting it would break the script, and ignoring them
silently would mislead. Each such setting declares why where it is declared
(``option(..., no_effect="why")``, or ``no_effect`` on a whole config class); this module only
reads those declarations. Two plan entries come from it, each a warning:

* ``no_effect``: every setting declared without effect whose value differs from its default;
* ``configs_without_switch``: a ``*_configs`` changed from its defaults while its switch stays
  off (its keys are then ignored). ``hybrid_configs``, ``pipeline_configs`` and
  ``tensor_parallel_configs`` are left out: in Paddle 2.2's dynamic graph their degrees alone
  turn hybrid parallelism on, whatever the switch. ``a_sync_configs`` is left out too:
  ``k_steps`` chooses the parameter-server mode with ``a_sync`` either way.

``build_strategy`` and ``execution_strategy`` report their own fields (``build_execution.py``).
"""
from __future__ import annotations

from typing import Any

from fleetx.strategy.api import PlanInput, Strategy, TrainingContext, Verdict, register
from fleetx.strategy.config import Config

__all__ = ["NoEffectSettings", "ConfigsWithoutSwitch", "without_effect", "configs_without_switch"]

# Their degrees alone turn hybrid parallelism on (Paddle 2.2 dynamic graph); k_steps picks the
# parameter-server mode whether a_sync is on or off.
_NO_SWITCH_NEEDED = ("hybrid_configs", "pipeline_configs", "tensor_parallel_configs",
                     "a_sync_configs")
_BAGS = ("build_strategy", "execution_strategy")


def _declarations() -> tuple[type[Config], dict[str, type[Config]]]:
    # Imported here: fields imports the strategy modules, which must not wait on this one.
    from fleetx.strategy.fields import MESSAGES, top_level
    return top_level(), MESSAGES


def _changed(cls: type[Config], values: dict[str, Any]) -> list[str]:
    return [key for key, spec in cls.specs().items() if values[key] != spec.default]


def without_effect(strategy: Any) -> dict[str, list[str]]:
    """Reason -> the settings changed from their defaults that are declared without effect
    (``"recompute"``, ``"a_sync_configs.use_ps_gpu"``), in declaration order."""
    top, messages = _declarations()
    values = strategy.to_dict()
    found: dict[str, list[str]] = {}
    for key in _changed(top, values):
        if top.no_effect_of(key):
            found.setdefault(top.no_effect_of(key), []).append(key)
    for section, cls in messages.items():
        if section in _BAGS:
            continue
        for key in _changed(cls, values[section]):
            why = cls.no_effect_of(key)
            if why:
                found.setdefault(why, []).append(cls.key_name(key))
    return found


def configs_without_switch(strategy: Any) -> list[str]:
    """The ``*_configs`` changed from their defaults whose switch is off (see the module)."""
    top, messages = _declarations()
    values = strategy.to_dict()
    unused = []
    for section, cls in messages.items():
        switch = section[:-len("_configs")]
        if (section in _NO_SWITCH_NEEDED or cls.no_effect or switch not in top.specs()
                or values[switch] or not _changed(cls, values[section])):
            continue
        unused.append(section)
    return unused


class _Notice(Strategy):
    """A plan entry that never applies: a warning about the settings themselves."""

    @classmethod
    def enabled(cls, strategy: Any) -> bool:
        return hasattr(strategy, "to_dict") and bool(cls.findings(strategy))

    @classmethod
    def findings(cls, strategy: Any) -> Any:
        raise NotImplementedError

    def apply(self, ctx: TrainingContext) -> None:  # pragma: no cover - never planned
        raise AssertionError(f"{self.name} is a notice and is never applied")


@register
class NoEffectSettings(_Notice):
    """Warns in the plan about settings declared without effect that were changed.

    Example:
        >>> from fleetx.strategy.api import WorldInfo
        >>> from fleetx.strategy.distributed_strategy import DistributedStrategy
        >>> s = DistributedStrategy(); s.a_sync_configs = {"use_ps_gpu": 1}
        >>> NoEffectSettings(s).can_apply(PlanInput(s, WorldInfo())).reason
        'set but without effect in fleetx: a_sync_configs.use_ps_gpu (GPU parameter servers are not offered)'
    """

    name = "no_effect"
    findings = staticmethod(without_effect)

    def can_apply(self, plan_input: PlanInput) -> Verdict:
        found = without_effect(plan_input.strategy)
        return Verdict.warning("set but without effect in fleetx: " + "; ".join(
            f"{', '.join(names)} ({why})" for why, names in found.items()))


@register
class ConfigsWithoutSwitch(_Notice):
    """Warns in the plan about a ``*_configs`` set while its switch is off.

    Example:
        >>> from fleetx.strategy.api import WorldInfo
        >>> from fleetx.strategy.distributed_strategy import DistributedStrategy
        >>> s = DistributedStrategy(); s.amp_configs = {"init_loss_scaling": 1024}
        >>> ConfigsWithoutSwitch(s).can_apply(PlanInput(s, WorldInfo())).reason
        'amp_configs set while strategy.amp is off: ignored (set strategy.amp = True to use it)'
    """

    name = "configs_without_switch"
    findings = staticmethod(configs_without_switch)

    def can_apply(self, plan_input: PlanInput) -> Verdict:
        texts = []
        for section in configs_without_switch(plan_input.strategy):
            switch = section[:-len("_configs")]
            texts.append(f"{section} set while strategy.{switch} is off: ignored "
                         f"(set strategy.{switch} = True to use it)")
        return Verdict.warning("; ".join(texts))
