"""``DistributedStrategy``: every distributed-training setting in one object.

This is Fleet's user surface, field for field (Paddle 2.2): boolean switches
(``strategy.amp = True``), a ``*_configs`` dictionary per algorithm
(``strategy.amp_configs = {"init_loss_scaling": 1024}``), communication flags, and
``build_strategy`` / ``execution_strategy``. Behind it each group of settings is a typed
:class:`~fleetx.strategy.config.Config` dataclass (``AmpConfig``...), so every assignment is
checked at once and the dictionary form, the printed overview and the file formats are all
generated from the declared fields.

Reading a ``*_configs`` attribute returns a new dict holding every key; assigning a dict merges
the given keys (checked before anything is written) and a list replaces the old list.
Assignments are remembered, so ``save_to_prototxt`` writes what was set, like protobuf's
``HasField``.

Example:
    >>> s = DistributedStrategy()
    >>> s.amp = True
    >>> s.amp_configs = {"init_loss_scaling": 1024}
    >>> s.amp_configs["init_loss_scaling"], s.amp_configs["incr_ratio"]
    (1024.0, 2.0)
    >>> s.typed_config("amp").init_loss_scaling
    1024.0
"""
from __future__ import annotations

import copy
import json
import logging
import os
import warnings
from dataclasses import dataclass
from typing import Any, Mapping, Union

from fleetx.strategy import file_formats, prototxt
from fleetx.strategy.a_sync import AsyncConfig
from fleetx.strategy.adaptive_localsgd import AdaptiveLocalSGDConfig
from fleetx.strategy.amp import AmpConfig
from fleetx.strategy.build import BuildStrategy, ExecutionStrategy
from fleetx.strategy.config import (Config, markdown_table, option, unknown_name,
                                    warn_old_name)
from fleetx.strategy.dgc import DGCConfig
from fleetx.strategy.gradient_merge import GradientMergeConfig
from fleetx.strategy.gradient_scale import GradientScaleConfig
from fleetx.strategy.hybrid import HybridConfig
from fleetx.strategy.lamb import LambConfig
from fleetx.strategy.lars import LarsConfig
from fleetx.strategy.localsgd import LocalSGDConfig
from fleetx.strategy.pipeline import PipelineConfig
from fleetx.strategy.recompute import RecomputeConfig
from fleetx.strategy.sharding import ShardingConfig
from fleetx.strategy.tensor_parallel import TensorParallelConfig
from fleetx.strategy.trainer_desc import TrainerDescConfig

__all__ = ["DistributedStrategy", "TopLevelConfig", "MESSAGES", "markdown_reference"]

_log = logging.getLogger(__name__)
PathLike = Union[str, "os.PathLike[str]"]


@dataclass
class TopLevelConfig(Config):
    """The scalar fields of :class:`DistributedStrategy`, in protobuf field-number order (1-35)."""

    mode: str = option("COLLECTIVE", "Job architecture as recorded in saved strategies.",
                       enum={"COLLECTIVE": 1, "PS": 2, "PIPELINE": 3, "HETER": 4},
                       no_effect="fleetx takes the mode from fleet.init(is_collective=...)")
    amp: bool = option(False, "Automatic mixed precision (amp_configs).")
    recompute: bool = option(False, "Recompute / activation checkpointing (recompute_configs).",
                             no_effect=RecomputeConfig.no_effect)
    localsgd: bool = option(False, "Local SGD (localsgd_configs).")
    dgc: bool = option(False, "Deep gradient compression (dgc_configs).")
    gradient_merge: bool = option(False, "Gradient accumulation (gradient_merge_configs).")
    lars: bool = option(False, "LARS optimizer (lars_configs).")
    lamb: bool = option(False, "LAMB optimizer (lamb_configs).")
    pipeline: bool = option(False, "Pipeline parallelism (pipeline_configs).",
                            no_effect=PipelineConfig.no_effect)
    elastic: bool = option(False, "Elastic training (Paddle 2.2 does not act on it either).",
                           no_effect="elastic jobs come from fleetrun --nnodes MIN:MAX")
    auto: bool = option(False, "Paddle: let Fleet choose strategies when no other switch is set.",
                        no_effect="fleetx has no automatic strategy search")
    a_sync: bool = option(True, "Parameter server: async (True) or sync (False); assigning it "
                          "resets a_sync_configs['k_steps'] to 0 (a_sync_configs).")
    sync_nccl_allreduce: bool = option(True, "Wait for each all-reduce before computing on.",
                                       no_effect="DDP always synchronises its gradient buckets")
    nccl_comm_num: int = option(1, "Communicators (streams) used for gradient all-reduce.", ge=1)
    use_hierarchical_allreduce: bool = option(
        False, "All-reduce inside each node first, then across nodes.")
    hierarchical_allreduce_inter_nranks: int = option(
        1, "Ranks per node for hierarchical all-reduce.", ge=1)
    sync_batch_norm: bool = option(False, "Batch-norm statistics over all workers.")
    fuse_all_reduce_ops: bool = option(True, "Fuse gradient all-reduces into buckets.")
    fuse_grad_size_in_MB: int = option(32, "Bucket size in MB of fused all-reduce.", gt=0)
    fuse_grad_size_in_TFLOPS: float = option(
        50.0, "Layers per fused all-reduce (Paddle attribute _fuse_grad_size_in_TFLOPS).", gt=0,
        no_effect="buckets are sized in MB (fuse_grad_size_in_MB)")
    cudnn_exhaustive_search: bool = option(
        False, "Benchmark convolution algorithms.",
        no_effect="set torch.backends.cudnn.benchmark in the script")
    conv_workspace_size_limit: int = option(512, "cuDNN workspace limit in MB.", gt=0,
                                            no_effect="no cuDNN workspace knob in PyTorch")
    cudnn_batchnorm_spatial_persistent: bool = option(
        False, "Use cuDNN's persistent spatial batch-norm mode.",
        no_effect="no such cuDNN switch in PyTorch")
    adaptive_localsgd: bool = option(False, "Adaptive local SGD (adaptive_localsgd_configs).")
    fp16_allreduce: bool = option(False, "Cast gradients to float16 for all-reduce.")
    sharding: bool = option(False, "ZeRO-style sharding (sharding_configs).",
                            no_effect=ShardingConfig.no_effect)
    last_comm_group_size_MB: float = option(
        1.0, "Size in MB of the last gradient bucket (filled first in backward).", gt=0,
        no_effect="DDP sizes its first bucket itself")
    find_unused_parameters: bool = option(
        False, "Data parallel: look for parameters that got no gradient.")
    tensor_parallel: bool = option(False, "Tensor parallelism (tensor_parallel_configs).",
                                   no_effect=TensorParallelConfig.no_effect)
    without_graph_optimization: bool = option(
        False, "Insert all-reduces directly instead of through the graph executor.",
        no_effect="no static graph")
    fuse_grad_size_in_num: int = option(
        8, "Gradients per fused all-reduce without graph optimization.", ge=1,
        no_effect="buckets are sized in MB (fuse_grad_size_in_MB)")
    calc_comm_same_stream: bool = option(
        False, "Compute and communicate on one stream (Paddle attribute _calc_comm_same_stream).",
        no_effect="DDP chooses its streams")
    asp: bool = option(False, "2:4 structured sparsity.", no_effect="not implemented")
    fuse_grad_merge: bool = option(
        False, "Fuse the gradient-merge buffers.",
        no_effect="gradient merge accumulates in the parameters' .grad")
    semi_auto: bool = option(False, "Semi-automatic parallelism (experimental).",
                             no_effect="no auto-parallel planner")


# The message fields in protobuf field-number order: *_configs 101-114, build_strategy 201,
# execution_strategy 202, gradient_scale_configs 203. Prototxt output follows this order.
MESSAGES: dict[str, type[Config]] = {cls.section: cls for cls in (
    RecomputeConfig, AmpConfig, LocalSGDConfig, GradientMergeConfig, DGCConfig, PipelineConfig,
    AsyncConfig, LarsConfig, LambConfig, AdaptiveLocalSGDConfig, ShardingConfig, HybridConfig,
    TensorParallelConfig, TrainerDescConfig, BuildStrategy, ExecutionStrategy,
    GradientScaleConfig)}
_BAGS = ("build_strategy", "execution_strategy")
_FIELDS = tuple(TopLevelConfig.specs()) + tuple(MESSAGES)
# Paddle's attribute spellings of two proto fields: accepted silently.
_SPELLINGS = {"_fuse_grad_size_in_TFLOPS": "fuse_grad_size_in_TFLOPS",
              "_calc_comm_same_stream": "calc_comm_same_stream"}
# Older names from earlier releases and their docs: accepted with a DeprecationWarning.
_ALIASES = {"fp16_compress": "fp16_allreduce"}
_STATE = ("_flags", "_msgs", "_set")


class DistributedStrategy:
    """All distributed-training settings: switches, ``*_configs`` dicts, communication flags.

    Every field of Paddle 2.2's strategy exists with its default (see
    ``docs/distributed_strategy.md``).
    Assignments are validated at once:

    Raises:
        TypeError: an unknown attribute, or a value of the wrong type (a bool is not a number).
        ValueError: an unknown ``*_configs`` key, or a value out of range.

    Example:
        >>> s = DistributedStrategy()
        >>> s.nccl_comm_num = True
        Traceback (most recent call last):
        TypeError: nccl_comm_num must be an int, got bool True
        >>> s.a_sync = True
        >>> s.a_sync_configs = {"k_steps": 100}
        >>> s.ps_mode()
        'geo'
    """

    __hash__ = None  # mutable, compared by value

    def __init__(self) -> None:
        object.__setattr__(self, "_flags", TopLevelConfig())
        object.__setattr__(self, "_msgs", {name: cls() for name, cls in MESSAGES.items()})
        object.__setattr__(self, "_set", set())  # "amp", "amp_configs.decr_ratio", ...

    # -- attribute surface ----------------------------------------------------------------------
    @staticmethod
    def _resolve(name: str) -> str:
        if name in _FIELDS:
            return name
        if name in _SPELLINGS:
            return _SPELLINGS[name]
        if name in _ALIASES:
            warn_old_name(f"strategy.{name} is an old name; use strategy.{_ALIASES[name]}")
            return _ALIASES[name]
        raise TypeError(unknown_name("DistributedStrategy attribute", name, _FIELDS))

    def __getattr__(self, name: str) -> Any:
        # Only reached for names that are not real attributes (the fields).
        if name.startswith("__") or name in _STATE:
            raise AttributeError(name)
        try:
            field = self._resolve(name)
        except TypeError as e:
            raise AttributeError(str(e)) from None
        if field in _BAGS:
            return self._msgs[field].copy()
        if field in self._msgs:
            return self._msgs[field].to_dict()
        return getattr(self._flags, field)

    def __setattr__(self, name: str, value: Any) -> None:
        self._assign(self._resolve(name), value, user=True)

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(_FIELDS))

    def _assign(self, field: str, value: Any, user: bool = False) -> None:
        """Validate and store one field; ``user`` applies the setter side effects (``a_sync``),
        which restoring from a file or dict does not."""
        if field not in self._msgs:
            setattr(self._flags, field, value)
            self._set.add(field)
            if field == "a_sync" and user:
                self._assign("a_sync_configs", {"k_steps": 0})
            return
        current = self._msgs[field]
        if isinstance(value, type(current)):
            value = value.to_dict()
        elif field in _BAGS and not isinstance(value, Mapping):
            # Any object with the bag's attribute names (a Paddle BuildStrategy, say).
            found = {k: getattr(value, k) for k in current.specs() if hasattr(value, k)}
            if not found:
                raise TypeError(f"{field} must be a {type(current).__name__} or a dict, "
                                f"got {type(value).__name__} {value!r}")
            value = found
        updates = current.resolve(value)
        self._msgs[field] = current.merged(updates)
        self._set.update(f"{field}.{key}" for key in updates)

    def is_set(self, name: str) -> bool:
        """Whether a field was assigned (even to its default), like protobuf's ``HasField``.

        ``name`` is a field (``"amp"``), a config (``"amp_configs"``: any of its keys) or one key
        (``"amp_configs.decr_ratio"``).
        """
        return name in self._set or any(p.startswith(name + ".") for p in self._set)

    # -- typed access ---------------------------------------------------------------------------
    def typed_config(self, name: str) -> Config:
        """A copy of the config dataclass of switch ``name`` (``"amp"`` -> ``AmpConfig``).

        The attribute name (``"amp_configs"``) is accepted too.

        Raises:
            ValueError: ``name`` has no config (the message lists the names that do).
        """
        section = name if name.endswith("_configs") else f"{name}_configs"
        if section not in MESSAGES:
            known = [s[:-len("_configs")] for s in MESSAGES if s.endswith("_configs")]
            raise ValueError(unknown_name("strategy config", name, known))
        return self._msgs[section].copy()

    def ps_mode(self) -> str:
        """The parameter-server mode: ``"sync"``, ``"async"`` or ``"geo"``.

        ``a_sync=False, k_steps=0`` is sync; ``a_sync=True, k_steps=0`` async;
        ``a_sync=True, k_steps>0`` GEO. ``k_steps=-1`` (``a_sync`` never assigned) counts as 0.

        Raises:
            ValueError: ``a_sync=False`` with ``k_steps > 0``.
        """
        k_steps = self._msgs["a_sync_configs"].k_steps
        if k_steps <= 0:
            return "async" if self._flags.a_sync else "sync"
        if not self._flags.a_sync:
            raise ValueError(
                f"a_sync=False (sync) cannot be combined with a_sync_configs['k_steps']="
                f"{k_steps} (GEO); set a_sync=True for GEO, or k_steps=0 for sync")
        return "geo"

    # -- value semantics ------------------------------------------------------------------------
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DistributedStrategy):
            return NotImplemented
        return self._flags == other._flags and self._msgs == other._msgs

    def __getstate__(self) -> dict[str, Any]:
        return {name: self.__dict__[name] for name in _STATE}

    def __setstate__(self, state: Mapping[str, Any]) -> None:
        for name in _STATE:
            object.__setattr__(self, name, state[name])

    def __repr__(self) -> str:
        return _overview(self)

    # -- dict, JSON, YAML -----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Every field with its value; configs and build/execution strategies as dicts."""
        out = self._flags.to_dict()
        out.update((name, msg.to_dict()) for name, msg in self._msgs.items())
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "DistributedStrategy":
        """A strategy with the fields of ``data`` (as from :meth:`to_dict`; may be partial).

        Raises:
            TypeError / ValueError: as attribute assignment does.
        """
        strategy = cls()
        strategy._restore(data)
        return strategy

    def _restore(self, data: Mapping[str, Any]) -> None:
        """Merge ``data`` into this strategy, all or nothing, without setter side effects."""
        if not isinstance(data, Mapping):
            raise TypeError(f"a strategy dict must be a mapping, got {type(data).__name__}")
        trial = copy.deepcopy(self)
        for name, value in data.items():
            trial._assign(self._resolve(name), value)
        self.__setstate__(trial.__getstate__())

    def save_to_json(self, path: PathLike) -> None:
        """Write :meth:`to_dict` as JSON."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2)
            f.write("\n")

    def load_from_json(self, path: PathLike) -> None:
        """Merge the fields of a JSON file into this strategy (lists replace), all or nothing.

        Raises:
            ValueError: malformed JSON (``file:line:col:``), an unknown config key or a value out
                of range (``file:line:``, with the valid choices).
            TypeError: an unknown field or a value of the wrong type (``file:line:``).
        """
        self._load_file(path, "json")

    def save_to_yaml(self, path: PathLike) -> None:
        """Write :meth:`to_dict` as YAML (needs pyyaml)."""
        yaml = _yaml()
        with open(path, "w", encoding="utf-8") as f:
            yaml.safe_dump(self.to_dict(), f, sort_keys=False)

    def load_from_yaml(self, path: PathLike) -> None:
        """Merge the fields of a YAML file into this strategy (needs pyyaml), all or nothing.

        Raises:
            ValueError / TypeError: as :meth:`load_from_json` (``file:line:`` first).
        """
        self._load_file(path, "yaml")

    def _load_file(self, path: PathLike, kind: str) -> None:
        source = os.fspath(path)
        with open(path, encoding="utf-8") as f:
            data, locate = file_formats.read_mapping(f.read(), source, kind)
        if data is None and kind == "yaml":
            data = {}  # an empty YAML file
        if not isinstance(data, Mapping):
            raise TypeError(f"{source}: a strategy file holds a mapping of fields, "
                            f"got {type(data).__name__}")
        try:
            self._restore(data)
        except (TypeError, ValueError) as e:
            failing = _failing_path(data)
            line = locate(failing) if failing else None
            raise type(e)(f"{source}:{line}: {e}" if line else f"{source}: {e}") from None

    # -- prototxt -------------------------------------------------------------------------------
    def save_to_prototxt(self, output: PathLike) -> None:
        """Write the assigned fields in protobuf text format, in Paddle's field order."""
        message: dict[str, Any] = {}
        for name, spec in TopLevelConfig.specs().items():
            if name in self._set:
                value = getattr(self._flags, name)
                message[name] = prototxt.Ident(value) if spec.enum else value
        for name, msg in self._msgs.items():
            block = {key: value for key, value in msg.to_dict().items()
                     if f"{name}.{key}" in self._set and value != []}
            if block:
                message[name] = block
        with open(output, "w", encoding="utf-8") as f:
            f.write(prototxt.dumps(message))

    def load_from_prototxt(self, pb_file: PathLike, ignore_unknown: bool = False) -> list[str]:
        """Merge a protobuf text file (ours or Paddle's) into this strategy, all or nothing.

        Scalars overwrite, a repeated field's lines replace the old list, aliases are accepted.

        Args:
            pb_file: the file.
            ignore_unknown: skip unknown field names (logged) instead of raising.

        Returns:
            The skipped names (``"adam_d2sum"``, ``"amp_configs.use_bf16"``), empty if none.

        Raises:
            ValueError: a syntax error, an unknown field, or a bad value (``file:line:`` first).
            TypeError: a value of the wrong type (``file:line:`` first).
        """
        source = os.fspath(pb_file)
        with open(pb_file, encoding="utf-8") as f:
            entries = prototxt.parse(f.read(), source)
        skipped: list[str] = []
        updates = _decode(entries, TopLevelConfig, source, ignore_unknown, skipped)
        self._restore(updates)
        for name in skipped:
            _log.warning("%s: skipped unknown strategy field %s", source, name)
        return skipped


def _failing_path(data: Mapping[str, Any]) -> Union[tuple[str, ...], None]:
    """The first field (or ``(config, key)``) of ``data`` that assignment refuses, to say where
    it stands in its file; None when no single entry is at fault."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # old names warn on the real load
        for name, value in data.items():
            try:
                field = DistributedStrategy._resolve(name)
                if field not in MESSAGES:
                    TopLevelConfig.check(field, value)
                    continue
                if not isinstance(value, Mapping):
                    return (name,)
            except (TypeError, ValueError):
                return (name,)
            cls = MESSAGES[field]
            for key, item in value.items():
                try:
                    cls.check(cls.canonical(key), item)
                except (TypeError, ValueError):
                    return (name, key)
    return None


def _yaml() -> Any:
    try:
        import yaml
    except ImportError:
        raise ImportError("YAML strategy files need pyyaml: pip install pyyaml "
                          "(or pip install fleetx[yaml])") from None
    return yaml


def _decode(entries: tuple[prototxt.Entry, ...], cls: type[Config], source: str,
            ignore_unknown: bool, skipped: list[str]) -> dict[str, Any]:
    """Typed values of parsed prototxt entries against ``cls`` (and, at the top, ``MESSAGES``).

    Repeated lines gather into one list; a later scalar overwrites an earlier one.
    """
    top = cls is TopLevelConfig
    out: dict[str, Any] = {}
    for entry in entries:
        where = f"{source}:{entry.line}"
        name = _decoded_name(cls, entry.name)
        if name is None:
            if not ignore_unknown:
                known = _FIELDS if top else cls.specs()
                what = "DistributedStrategy field" if top else f"{cls.section} field"
                raise ValueError(f"{where}: {unknown_name(what, entry.name, known)}")
            skipped.append(entry.name if top else f"{cls.section}.{entry.name}")
            continue
        is_message = top and name in MESSAGES
        if entry.is_message != is_message:
            form = f"{name} {{ ... }}" if is_message else f"{name}: value"
            raise ValueError(f"{where}: {name} must be written as {form}")
        if is_message:
            merged = out.setdefault(name, {})
            for key, value in _decode(entry.value, MESSAGES[name], source, ignore_unknown,
                                      skipped).items():
                merged[key] = merged.get(key, []) + value if isinstance(value, list) else value
            continue
        spec = cls.specs()[name]
        value = prototxt.value_of(entry.value, spec.type, cls.label(name), source, spec.enum)
        try:
            value = spec.coerce_item(value, cls.label(name))
        except (TypeError, ValueError) as e:
            raise type(e)(f"{where}: {e}") from None
        if spec.is_list:
            out.setdefault(name, []).append(value)
        else:
            out[name] = value
    return out


def _decoded_name(cls: type[Config], name: str) -> Union[str, None]:
    try:
        if cls is TopLevelConfig:
            return DistributedStrategy._resolve(name)
        return cls.canonical(name)
    except (TypeError, ValueError):
        return None


# -- the printed overview (Paddle's layout) --------------------------------------------------------
_KEY_W, _GAP, _VAL_W = 38, 2, 38
_WIDTH = _KEY_W + _GAP + _VAL_W


def _title(text: str) -> str:
    return f"    |{text:^{_WIDTH}}|\n"


def _row(key: str, value: Any) -> str:
    return f"    |{key:>{_KEY_W}}{' ' * _GAP}{str(value):^{_VAL_W}}|\n"


def _rows(cfg: Config) -> str:
    """One row per key; a list prints one row per element with the key on the first only."""
    out = []
    for key, value in cfg.to_dict().items():
        items = value if isinstance(value, list) else [value]
        out.extend(_row(key if i == 0 else "", v) for i, v in enumerate(items))
    return "".join(out)


def _overview(s: DistributedStrategy) -> str:
    border = "    +" + "=" * _WIDTH + "+\n"
    line = "    +" + "-" * _WIDTH + "+\n"
    out = [border, _title(""), _title("DistributedStrategy Overview"), _title("")]
    env = []
    for name, spec in TopLevelConfig.specs().items():
        value = getattr(s._flags, name)
        if spec.type is bool and f"{name}_configs" in MESSAGES:
            if value:  # a switch with a config prints as a block, and only when on
                out += [border, _title(f"{name}=True <-> {name}_configs"), line,
                        _rows(s._msgs[f"{name}_configs"])]
            continue
        env.append(_row(name, spec.enum[value] if spec.enum else value))
    out += [border, _title("Environment Flags, Communication Flags"), line, *env]
    out += [border, _title("Build Strategy"), line, _rows(s._msgs["build_strategy"]), border]
    out += [_title("Execution Strategy"), line, _rows(s._msgs["execution_strategy"]), border]
    return "".join(out)


def markdown_reference() -> str:
    """The field reference of ``docs/distributed_strategy.md``, generated from the declarations.

    Settings declared without effect are marked (**no effect**, and why); a config with no
    effect at all says so once, above its table.
    """
    parts = ["### Top-level fields\n\n", markdown_table(TopLevelConfig, "field")]
    for name, cls in MESSAGES.items():
        parts.append(f"\n### `{name}` ({cls.__name__}, `{cls.__module__}`)\n\n")
        if cls.no_effect:
            parts.append(f"**No effect in fleetx** ({cls.no_effect}): every key is accepted and "
                         f"checked, and named in the plan when changed.\n\n")
        parts.append(markdown_table(cls))
    return "".join(parts)
