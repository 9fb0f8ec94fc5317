"""``fleet.consolidated_model`` on one process (the multi-process stages are in
tests/distributed/test_recipe_runtime.py): the copy is the model's own class, equal outputs,
tied weights still tied, buffers outside the state dict kept, independent of later training; a
model fleetx did not wrap is a ValueError naming the fix; the skeleton's doctest."""
from __future__ import annotations

import doctest
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hf_models import batch, llama  # noqa: E402

from fleetx.fleet import Fleet, consolidate  # noqa: E402


def test_doctests_pass():
    assert doctest.testmod(consolidate).failed == 0


def test_a_consolidated_copy_of_a_hugging_face_model(one_process):
    f = Fleet()
    f.init(is_collective=True)
    model = f.distributed_model(llama())
    opt = f.distributed_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    ids = batch(2)
    opt.minimize(model(ids, labels=ids).loss)
    plain = f.consolidated_model(model)
    assert type(plain).__name__ == "LlamaForCausalLM" and plain.training
    assert plain.lm_head.weight is not model.module.lm_head.weight  # a copy
    rotary = dict(plain.named_buffers())  # inv_freq: not in the state dict, kept with its values
    assert rotary and all(torch.equal(b, dict(model.module.named_buffers())[k])
                          for k, b in rotary.items())
    with torch.no_grad():
        want = model.eval()(ids).logits
        assert torch.equal(plain.eval()(ids).logits, want)
    model.train()
    opt.minimize(model(ids, labels=ids).loss)  # training the model leaves the copy
    with torch.no_grad():
        assert torch.equal(plain(ids).logits, want)


def test_tied_weights_stay_tied(one_process):
    f = Fleet()
    f.init(is_collective=True)
    net = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
    net[1].weight = net[0].weight
    plain = f.consolidated_model(f.distributed_model(net))
    assert plain[1].weight is plain[0].weight and torch.equal(plain[0].weight, net[0].weight)


def test_a_model_fleetx_did_not_wrap_is_refused(one_process):
    f = Fleet()
    f.init(is_collective=True)
    with pytest.raises(ValueError, match="fleet.consolidated_model: the Linear given is not a "
                                         "model fleet.distributed_model returned"):
        f.consolidated_model(torch.nn.Linear(2, 2))
