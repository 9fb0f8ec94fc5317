"""Recompute selects modules by qualified name, by a glob of names, or by class.

* ``select_modules``: a class name selects every module of it; in a glob ``*`` is one name
  between dots (``"h.*"`` selects the blocks, not what is inside them); a module inside another
  selected one is left out; an entry selecting nothing names the closest names and classes.
* On GPT-2 (transformers, tiny config): ``["GPT2Block"]`` through ``fleet.distributed_model``
  checkpoints exactly the blocks, the plan lists them, and the gradients equal the plain model's;
  a model whose own gradient checkpointing is on is refused with both ways out.
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

from fleetx import DistributedStrategy
from fleetx.fleet import Fleet
from fleetx.strategy.algorithms.recompute import (_RecomputedForward, checkpoint_modules,
                                                  select_modules)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hf_models  # noqa: E402  (tests/hf_models.py)

NAMES = ["", "emb", "h", "h.0", "h.0.mlp", "h.1", "h.1.mlp", "head"]
CLASSES = ["Net", "Embedding", "ModuleList", "Block", "MLP", "Block", "MLP", "Linear"]


@pytest.mark.parametrize("entries, chosen", [
    (["Block"], ["h.0", "h.1"]),
    (["h.*"], ["h.0", "h.1"]),
    (["h.*.mlp"], ["h.0.mlp", "h.1.mlp"]),
    (["h.1", "MLP"], ["h.0.mlp", "h.1"]),  # h.1.mlp is inside h.1
    (["h.?", "h.0.mlp"], ["h.0", "h.1"]),
])
def test_names_globs_and_classes_select_the_outermost_modules(entries, chosen):
    assert select_modules(NAMES, CLASSES, entries) == (chosen, "")


def test_an_entry_selecting_nothing_names_the_closest_names_and_classes():
    chosen, error = select_modules(NAMES, CLASSES, ["Blok", "layers.*"])
    assert chosen == []
    assert "names no module 'Blok' (closest: 'Block'" in error
    assert "'layers.*' (closest:" in error
    assert "a glob of names ('blocks.*') or a class name" in error
    assert error.endswith("classes: Embedding, ModuleList, Block, MLP, Linear")


def _fleet(entries):
    s = DistributedStrategy()
    s.recompute = True
    s.recompute_configs = {"checkpoints": entries}
    fleet = Fleet()
    fleet.init(is_collective=True, strategy=s)
    return fleet


def _grads(model, plain, ids):
    """The gradients of ``plain``'s parameters after a step of ``model`` (itself or wrapped)."""
    model(input_ids=ids, labels=ids).loss.backward()
    return {n: p.grad.clone() for n, p in plain.named_parameters() if p.grad is not None}


def test_gpt2_by_class_checkpoints_its_blocks_and_keeps_the_gradients(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PADDLE_TRAINER_ENDPOINTS"):
        monkeypatch.delenv(name, raising=False)
    net = hf_models.gpt2(n_layer=3)
    plain = copy.deepcopy(net)
    fleet = _fleet(["GPT2Block"])
    model = fleet.distributed_model(net)
    fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    assert ("3 module(s) selected by GPT2Block: transformer.h.0, transformer.h.1, "
            "transformer.h.2") in str(fleet.explain())
    ids = hf_models.batch(2)
    got, want = _grads(model, net, ids), _grads(plain, plain, ids)  # the first forward wraps the blocks
    marked = [n for n, m in net.named_modules()
              if isinstance(m.__dict__.get("forward"), _RecomputedForward)]
    assert marked == ["transformer.h.0", "transformer.h.1", "transformer.h.2"]
    assert got.keys() == want.keys()
    assert max((got[k] - want[k]).abs().max().item() for k in got) < 1e-6


def test_a_model_with_its_own_gradient_checkpointing_is_refused():
    net = hf_models.gpt2()
    net.activation_checkpointing_enable()  # gradient_checkpointing_enable() before 5.x
    with pytest.raises(ValueError) as err:
        checkpoint_modules(net, ["GPT2Block"])
    text = str(err.value)
    assert "own gradient checkpointing is on (transformer.gradient_checkpointing" in text
    assert "model.activation_checkpointing_disable()" in text and "strategy.recompute" in text
    net.activation_checkpointing_disable()
    assert checkpoint_modules(net, ["GPT2Block"]) is net


def test_a_class_name_selects_blocks_fully_shard_has_swapped():
    """fully_shard swaps a block's class for FSDP<cls>(FSDPModule, cls): the block is still
    selected by the class name it was written as, and no other."""
    from torch.distributed.fsdp import FSDPModule

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x).relu()

    net = torch.nn.Sequential(Block(), Block())
    net[0].__class__ = type("FSDPBlock", (FSDPModule, Block), {})  # as fully_shard does
    checkpoint_modules(net, ["Block"])
    assert [isinstance(m.__dict__.get("forward"), _RecomputedForward) for m in net] == [True, True]
    swapped = torch.nn.Sequential(Block())
    swapped[0].__class__ = net[0].__class__
    with pytest.raises(ValueError, match="names no module 'FSDPBlock'"):  # not by FSDP's name
        checkpoint_modules(swapped, ["FSDPBlock"])
