"""``fleet.export_model`` on one process: the atomic write, and the errors of a wrong call.

The layouts (data parallel, sharding, tensor and pipeline parallel, Hugging Face models) are
tests/distributed/test_export.py. Here a write that fails half-way (the serializer raises after
writing part of the file) must leave neither the final name nor a temporary file behind, and an
earlier export at that name intact; every file appears by one rename of a flushed temporary
file in the same folder.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from fleetx.checkpoint import export
from fleetx.fleet import Fleet, FleetError

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hf_models  # noqa: E402


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


@pytest.fixture
def fleet(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PADDLE_TRAINER_ENDPOINTS",
                 "PADDLE_TRAINER_ID", "FLEETX_DRY_RUN"):
        monkeypatch.delenv(name, raising=False)
    f = Fleet()
    f.init(is_collective=True)
    return f


def _half_then_fail(tensors, path, metadata=None):
    Path(path).write_bytes(b"\0" * 100)  # part of a file, then the process fails
    raise OSError("disk full")


@pytest.mark.parametrize("hf", [False, True], ids=["file", "hf_directory"])
def test_a_write_that_fails_half_way_leaves_nothing_and_keeps_the_earlier_export(
        tmp_path, monkeypatch, hf):
    model = hf_models.gpt2() if hf else net()
    target = tmp_path / ("out" if hf else "model.safetensors")
    weights = target / "model.safetensors" if hf else target
    export.export_model(model, str(target))
    before = weights.read_bytes()
    monkeypatch.setattr("safetensors.torch.save_file", _half_then_fail)
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    with pytest.raises(OSError, match="disk full"):
        export.export_model(model, str(target))
    assert weights.read_bytes() == before  # the earlier export, whole
    assert sorted(os.listdir(tmp_path)) == [target.name]  # no temporary file or folder
    if hf:
        assert sorted(os.listdir(target)) == ["config.json", "generation_config.json",
                                              "model.safetensors"]


def test_every_file_appears_by_renaming_a_flushed_temporary_file_beside_it(tmp_path,
                                                                           monkeypatch):
    events, real_replace, real_fsync = [], os.replace, export._fsync
    monkeypatch.setattr(export, "_fsync", lambda p: (events.append(("fsync", p)),
                                                     real_fsync(p)))
    monkeypatch.setattr(export.os, "replace", lambda a, b: (events.append(("rename", a, b)),
                                                            real_replace(a, b)))
    target = tmp_path / "model.pt"
    assert export.export_model(net(), str(target), format="torch") == str(target)
    rename = next(e for e in events if e[0] == "rename")
    temp = rename[1]
    assert rename[2] == str(target) and os.path.dirname(temp) == str(tmp_path)
    assert os.path.basename(temp).startswith(".model.pt.fleetx-tmp-")
    assert events.index(("fsync", temp)) < events.index(rename)  # flushed, then renamed
    assert ("fsync", str(tmp_path)) in events[events.index(rename):]  # and the folder after
    net().load_state_dict(torch.load(target, weights_only=True), strict=True)


def test_wrong_calls_name_the_bad_argument_and_the_choices(tmp_path):
    with pytest.raises(ValueError, match=r"must be one of \['safetensors', 'torch'\], got "
                                         r"'onnx'"):
        export.export_model(net(), str(tmp_path / "m"), format="onnx")
    with pytest.raises(IsADirectoryError, match="is a directory; a model that is not a Hugging "
                                                "Face PreTrainedModel is exported as one file"):
        export.export_model(net(), str(tmp_path))
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file; a Hugging Face model is exported "
                                                 "as the directory from_pretrained reads"):
        export.export_model(hf_models.gpt2(), str(tmp_path / "file"))
    export.export_model(hf_models.gpt2(), str(tmp_path / "hf"))
    with pytest.raises(FileExistsError, match="already holds model.safetensors, which "
                                              "from_pretrained reads before the "
                                              "pytorch_model.bin written now"):
        export.export_model(hf_models.gpt2(), str(tmp_path / "hf"), format="torch")


class WithExtraState(nn.Linear):
    def get_extra_state(self):
        return {"note": "kept"}

    def set_extra_state(self, state):
        self.note = state


def test_a_state_entry_that_is_not_a_tensor_needs_the_torch_format(tmp_path):
    with pytest.raises(TypeError, match="'_extra_state' holds a dict, not a tensor; safetensors "
                                        "stores tensors only: use format='torch'"):
        export.export_model(WithExtraState(2, 2), str(tmp_path / "m.safetensors"))
    export.export_model(WithExtraState(2, 2), str(tmp_path / "m.pt"), format="torch")
    assert torch.load(tmp_path / "m.pt", weights_only=False)["_extra_state"] == {"note": "kept"}


def test_fleet_export_model_writes_the_wrapped_model_or_says_what_is_missing(fleet, tmp_path):
    with pytest.raises(FleetError, match=r"writes the model given to fleet.distributed_model"):
        fleet.export_model(tmp_path / "m.safetensors")
    model = fleet.distributed_model(net())
    assert fleet.export_model(tmp_path / "m.safetensors") == str(tmp_path / "m.safetensors")
    fleet.distributed_model(net())
    with pytest.raises(FleetError, match="2 models were given to fleet.distributed_model; name "
                                         "the one to write with model="):
        fleet.export_model(tmp_path / "m.safetensors")
    fleet.export_model(tmp_path / "m.pt", format="torch", model=model)
    model.module.load_state_dict(torch.load(tmp_path / "m.pt", weights_only=True), strict=True)


def test_save_pretrained_on_the_wrapped_model_refuses_what_it_cannot_write(fleet, tmp_path):
    with pytest.raises(AttributeError, match="Sequential has no save_pretrained .not a Hugging "
                                             "Face PreTrainedModel.: use fleet.export_model"):
        fleet.distributed_model(net()).save_pretrained(tmp_path)
    wrapped = fleet.distributed_model(hf_models.gpt2())
    with pytest.raises(TypeError, match=r"\['max_shard_size'\] are not supported: it writes one "
                                        r"consolidated file with fleet.export_model"):
        wrapped.save_pretrained(tmp_path / "hf", max_shard_size="1GB")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "tokenizer.json").write_text("{}")  # saved there before: kept
    wrapped.save_pretrained(tmp_path / "hf", safe_serialization=False)
    assert sorted(os.listdir(tmp_path / "hf")) == ["config.json", "generation_config.json",
                                                   "pytorch_model.bin", "tokenizer.json"]
    assert sorted(os.listdir(tmp_path)) == ["hf"]  # the staging folder is gone
