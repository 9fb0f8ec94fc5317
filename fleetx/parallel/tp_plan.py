"""Tensor parallelism from a plan: the model's layers replaced by fleetx's parallel layers.

A plan maps globs over qualified module names to a style, in the vocabulary of Hugging Face
transformers' ``_tp_plan`` (``model.layers.*.self_attn.q_proj: "colwise"``). A ``*`` stands
for one whole name segment (``model.layers.*.mlp`` matches ``model.layers.3.mlp``, not
``model.layers.3.x.mlp``). The styles fleetx carries out, and the layer each becomes:

=============================== ============================================================
style                           becomes
=============================== ============================================================
``colwise``                     ``ColumnParallelLinear(gather_output=False)``: this rank's
                                slice of the output features (its heads, its part of the MLP)
``colwise_gather_output``,      ``ColumnParallelLinear(gather_output=True)``: the full output
``colwise_rep``                 on every rank (an ``lm_head``'s logits)
``rowwise``                     ``RowParallelLinear(input_is_parallel=True)``: takes the
                                slice a ``colwise`` layer made; the sum is whole, the bias is
                                added once
``rowwise_split_input``,        ``RowParallelLinear(input_is_parallel=False)``: takes the full
``rowwise_rep``                 input and keeps this rank's slice
``embedding_rowwise``           ``VocabParallelEmbedding``: the vocabulary (the weight's rows)
                                split, the lookups summed
``replicate``                   left as it is (whole on every rank)
=============================== ============================================================

Any other style (``packed_colwise``, ``sequence_parallel``, the MoE styles...) is refused,
naming the entry and the styles above. What the model must allow: a ``colwise`` layer's output
holds whole heads on each rank and the code after it must read the number of heads from the
tensor (``view(*shape, -1, head_dim)``, as Hugging Face's Llama, Mistral and Qwen do), not from
a stored head count; a fused ``qkv`` projection split ``colwise`` would give rank 0 all of the
queries and none of the values, so it is refused when its module sits beside a ``head_dim``
that three parts would need (write the model with separate ``q``/``k``/``v`` projections). A
module with a ``head_dim`` attribute is taken as the attention whose projections the plan
splits: its projections must split into whole heads, or the plan is refused naming the layer,
its heads and the degree.

Tied weights (an embedding and a head sharing one tensor) stay tied when both sides split the
tensor's rows (``embedding_rowwise`` and ``colwise*``: the same rows on each rank); any other
tie that the plan touches is refused, naming both names.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist
from torch import nn

from fleetx.parallel.api import ParallelError
from fleetx.parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                    VocabParallelEmbedding, _ShardedModule)
from fleetx.parallel.mp_ops import ModelParallelGroup, resolve_group

__all__ = ["STYLES", "PlanError", "model_plan", "resolve_plan", "parallelize",
           "full_state_dict"]


class PlanError(ParallelError):
    """A tensor-parallel plan that cannot be applied to the model (named in the message)."""


#: style -> (layer kind, flag): the column layer's ``gather_output``, the row layer's
#: ``input_is_parallel``; kind None leaves the module whole
STYLES: dict[str, tuple[Optional[str], Optional[bool]]] = {
    "colwise": ("column", False),
    "colwise_gather_output": ("column", True),
    "colwise_rep": ("column", True),
    "rowwise": ("row", True),
    "rowwise_split_input": ("row", False),
    "rowwise_rep": ("row", False),
    "embedding_rowwise": ("embedding", None),
    "replicate": (None, None),
}
_NEEDS = {"column": nn.Linear, "row": nn.Linear, "embedding": nn.Embedding}
# the dimension of the full weight each kind splits (a tie must split both sides alike)
_WEIGHT_DIM = {"column": 0, "row": 1, "embedding": 0}
_MARK = "_fleetx_tp_plan"  # set on a parallelized model: applying again is a no-op


@dataclass(frozen=True)
class Assignment:
    """One module the plan splits: its qualified name, the plan entry and its style."""

    name: str
    pattern: str
    style: str

    @property
    def kind(self) -> Optional[str]:
        return STYLES[self.style][0]


def model_plan(model: nn.Module) -> Optional[dict]:
    """The tensor-parallel plan ``model`` carries, or None: a Hugging Face model's ``_tp_plan``
    (its own entries and its base model's ``config.base_model_tp_plan``, prefixed), as
    transformers builds it.

    Example:
        >>> model_plan(transformers.LlamaForCausalLM(config))["lm_head"]
        'colwise_gather_output'
    """
    plan = getattr(model, "_tp_plan", None)
    return dict(plan) if isinstance(plan, Mapping) and plan else None


def _matches(pattern: str, name: str) -> bool:
    parts, names = pattern.split("."), name.split(".")
    return len(parts) == len(names) and all(map(fnmatchcase, names, parts))


def _unknown_style(pattern: str, style: Any) -> PlanError:
    return PlanError(f"tensor-parallel plan entry {pattern!r}: style {style!r} is not one fleetx "
                     f"carries out; choose one of {', '.join(sorted(STYLES))}")


def _no_match(pattern: str, model: nn.Module, modules: dict) -> PlanError:
    params = [n for n, _ in model.named_parameters() if _matches(pattern, n)]
    if params:
        return PlanError(f"tensor-parallel plan entry {pattern!r} names parameters "
                         f"({params[0]}...); name their module instead "
                         f"({params[0].rsplit('.', 1)[0]})")
    close = difflib.get_close_matches(pattern, list(modules), n=3, cutoff=0.5)
    hint = f"; closest module names: {', '.join(close)}" if close else ""
    return PlanError(f"tensor-parallel plan entry {pattern!r} matches no module of "
                     f"{type(model).__name__}{hint}")


def _check_module(a: Assignment, module: nn.Module, degree: int) -> None:
    need = _NEEDS[a.kind]
    if not isinstance(module, need):
        raise PlanError(f"{a.name} ({type(module).__name__}): style {a.style!r} (plan entry "
                        f"{a.pattern!r}) splits an nn.{need.__name__}; give it another style "
                        f"or leave it out of the plan")
    if a.kind == "embedding":
        size, what = module.num_embeddings, "vocabulary size (num_embeddings)"
    elif a.kind == "column":
        size, what = module.out_features, "out_features"
    else:
        size, what = module.in_features, "in_features"
    if size % degree:
        raise PlanError(f"{a.name} ({a.style}): {what}={size} is not divisible by the "
                        f"model-parallel degree {degree}")


# the names fused query/key/value projections go by (GPT-2 and nanoGPT, GPT-NeoX and Falcon,
# Phi-3, MPT, nn.MultiheadAttention): split by columns, rank 0 would get the queries only
_FUSED_QKV = ("c_attn", "qkv", "qkv_proj", "query_key_value", "Wqkv", "in_proj")


def _check_fused(a: Assignment) -> None:
    if a.kind == "column" and not STYLES[a.style][1] and a.name.rpartition(".")[2] in _FUSED_QKV:
        raise PlanError(f"{a.name} ({a.style}): a fused query/key/value projection cannot be "
                        f"split by columns (rank 0 would hold the queries, the last rank the "
                        f"values); write the attention with separate q/k/v projections, plan "
                        f"each as 'colwise' and the output projection as 'rowwise'")


def _check_heads(a: Assignment, module: nn.Module, parent: nn.Module, degree: int) -> None:
    """A projection beside a ``head_dim`` must split into whole heads (of one kind)."""
    _check_fused(a)
    head_dim = getattr(parent, "head_dim", None)
    if a.kind not in ("column", "row") or not isinstance(head_dim, int) or head_dim <= 0:
        return
    if a.kind == "column" and STYLES[a.style][1]:
        return  # gathered: the heads are whole again
    size = module.out_features if a.kind == "column" else module.in_features
    heads = size // head_dim
    if size % head_dim == 0 and heads % degree == 0:
        return
    if size % head_dim == 0:
        raise PlanError(f"{a.name} ({a.style}): its {size} features are {heads} heads of "
                        f"head_dim {head_dim}, and {heads} heads cannot be split over "
                        f"model-parallel degree {degree}; choose a degree that divides {heads}")
    raise PlanError(f"{a.name} ({a.style}): its {size} features are not whole heads of head_dim "
                    f"{head_dim} (a fused projection?); split it into separate q/k/v "
                    f"projections, each a multiple of head_dim, and plan each as 'colwise'")


def resolve_plan(model: nn.Module, plan: Mapping[str, str], degree: int) -> list[Assignment]:
    """The modules ``plan`` splits, checked against ``degree`` without communicating.

    Args:
        model: the unsplit model.
        plan: glob over qualified module names -> style (see the module docstring).
        degree: the model-parallel degree.

    Returns:
        One :class:`Assignment` per module, in the model's module order; a module matched by
        two entries takes the first.

    Raises:
        PlanError: an unknown style, an entry matching no module, a module of the wrong kind,
            a size (features, heads, vocabulary) that ``degree`` does not divide, or a tie the
            plan would break; each names the module and the numbers.
    """
    for pattern, style in plan.items():
        if style not in STYLES:
            raise _unknown_style(pattern, style)
    modules = dict(model.named_modules())
    found: dict[str, Assignment] = {}
    for pattern, style in plan.items():
        hits = [n for n in modules if n and _matches(pattern, n)]
        if not hits:
            raise _no_match(pattern, model, modules)
        for name in hits:
            found.setdefault(name, Assignment(name, pattern, style))
    assignments = [found[n] for n in modules if n in found and found[n].kind is not None]
    for a in assignments:
        _check_module(a, modules[a.name], degree)
        _check_heads(a, modules[a.name], modules[a.name.rpartition(".")[0]], degree)
    _check_ties(model, {a.name: a for a in assignments})
    return assignments


def _ties(model: nn.Module) -> list[list[str]]:
    """Groups of qualified parameter names that share one tensor."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def _check_ties(model: nn.Module, planned: dict) -> None:
    for group in _ties(model):
        owners = [n.rpartition(".") for n in group]
        touched = [o for o, _, _ in owners if o in planned]
        if not touched:
            continue
        dims = {(_WEIGHT_DIM[planned[o].kind] if o in planned else None, leaf)
                for o, _, leaf in owners}
        if len(dims) != 1 or next(iter(dims))[1] != "weight":
            styles = ", ".join(f"{n} ({planned[o].style if o in planned else 'not planned'})"
                               for n, (o, _, _) in zip(group, owners))
            raise PlanError(f"tied parameters {styles} would be split differently; give both "
                            f"'embedding_rowwise' / 'colwise*' styles (the same rows), or untie "
                            f"them (e.g. tie_word_embeddings=False)")


def _split(module: nn.Module, a: Assignment, group: Any) -> nn.Module:
    flag = STYLES[a.style][1]
    if a.kind == "column":
        return ColumnParallelLinear.from_linear(module, gather_output=flag, mp_group=group)
    if a.kind == "row":
        return RowParallelLinear.from_linear(module, input_is_parallel=flag, mp_group=group)
    return VocabParallelEmbedding.from_embedding(module, mp_group=group)


def _broadcast(model: nn.Module, mp: ModelParallelGroup) -> None:
    """Every rank of the group starts from the group's first rank's weights (as DDP does over
    its group): shards cut from different initialisations would make no model at all."""
    if mp.world_size == 1:
        return
    src = dist.get_global_rank(mp.group, 0) if mp.group is not None else 0
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            dist.broadcast(t.data, src=src, group=mp.group)


def parallelize(model: nn.Module, plan: Optional[Mapping[str, str]] = None, *,
                mp_group: Any = None) -> nn.Module:
    """Split ``model`` over the model-parallel group by ``plan``, in place.

    Each planned module is replaced by this rank's shard of it (a layer of
    :mod:`fleetx.parallel.layers`, built with ``from_linear`` / ``from_embedding``), so the
    qualified names and ``state_dict`` keys stay the plain model's. First every rank of the
    group takes the group's first rank's parameters and buffers (a broadcast), so ranks seeded
    apart still split one model. Applying a plan to a model already split is a no-op.

    Args:
        model: the unsplit model (changed in place and returned).
        plan: glob over qualified module names -> style (see :data:`STYLES`); default: the
            model's own (:func:`model_plan`, a Hugging Face model's ``_tp_plan``).
        mp_group: the ``torch.distributed`` process group to split over; default: the
            model-parallel group of the topology ``fleet.init`` built.

    Returns:
        ``model``.

    Raises:
        PlanError: no plan given and the model carries none, or a plan that cannot apply
            (see :func:`resolve_plan`).
        NoHybridGroupError: no ``mp_group`` and no hybrid topology (``fleet.init`` not called).

    Example:
        >>> plan = {"blocks.*.attn.q": "colwise", "blocks.*.attn.k": "colwise",
        ...         "blocks.*.attn.v": "colwise", "blocks.*.attn.proj": "rowwise",
        ...         "blocks.*.mlp.fc": "colwise", "blocks.*.mlp.proj": "rowwise"}
        >>> model = fleet.meta_parallel.parallelize(model, plan)
    """
    if model.__dict__.get(_MARK) is not None:
        return model
    plan = model_plan(model) if plan is None else dict(plan)
    if not plan:
        raise PlanError(f"{type(model).__name__} carries no tensor-parallel plan (_tp_plan); "
                        f"pass one: parallelize(model, {{'layers.*.q_proj': 'colwise', ...}})")
    mp = resolve_group(mp_group, "parallelize")
    assignments = resolve_plan(model, plan, mp.world_size)
    _broadcast(model, mp)
    ties = _ties(model)
    for a in assignments:
        parent_name, _, leaf = a.name.rpartition(".")
        parent = model.get_submodule(parent_name)
        parent.register_module(leaf, _split(getattr(parent, leaf), a, mp.group))
    _retie(model, ties)
    model.__dict__[_MARK] = plan
    return model


def _retie(model: nn.Module, ties: list[list[str]]) -> None:
    """Tie again what was tied before the split (each side was split alike, from one tensor)."""
    for group in ties:
        first = model.get_parameter(group[0])
        for name in group[1:]:
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner), leaf, first)


def full_state_dict(model: nn.Module) -> dict:
    """``model.state_dict()`` with every tensor-parallel shard gathered back to the plain
    model's shape (keys unchanged). A collective: every rank of the model-parallel group calls
    it, and every rank gets the full tensors.

    Example:
        >>> plain.load_state_dict(full_state_dict(split_model))  # strict
    """
    state = model.state_dict()
    for prefix, module in model.named_modules():
        if isinstance(module, _ShardedModule):
            for name in module.split_dims:
                if getattr(module, name) is not None:
                    key = f"{prefix}.{name}" if prefix else name
                    state[key] = module.gathered(name)
    return state
