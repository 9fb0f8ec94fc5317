"""Hugging Face models through the failure-proof loop, in one process: GPT-2 (its head tied to
the token embedding) and Llama trained from ``fleet.distributed_loader`` with
``auto_checkpoint(async_save=True, keep_last=2)``, stopped mid-epoch and resumed in a fresh
fleet, end bit-identical to the uninterrupted run, the tie intact, each sample seen once."""
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import Dataset

from fleetx import fleet

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hf_models  # noqa: E402  (tests/hf_models.py)

pytestmark = pytest.mark.usefixtures("one_process")

STEPS, EVERY, STOP = 9, 3, 7  # 9 steps of 4 samples of a 40-sample epoch; stopped after 7


class Tokens(Dataset):
    """40 fixed sequences of byte tokens; each item also says which sample it is."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(5)
        self.ids = torch.randint(0, hf_models.VOCAB, (40, 16), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int):
        return self.ids[i], i


def job(make):
    f = fleet.Fleet()
    f.init(is_collective=True)
    model = f.distributed_model(make())
    opt = f.distributed_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    loader = f.distributed_loader(Tokens(), batch_size=4, shuffle=True, seed=11)
    return f, model, opt, loader


def train(f, model, opt, loader, path, stop):
    start = f.auto_checkpoint(path, every_steps=EVERY, async_save=True, keep_last=2)
    seen, it = [], iter(loader)
    for _ in range(start, stop):
        ids, index = next(it)
        seen += index.tolist()
        opt.minimize(model(input_ids=ids, labels=ids).loss)
    f._wait_for_save()  # what the end of the process does
    return start, seen


@pytest.mark.parametrize("make", [hf_models.gpt2, hf_models.llama], ids=["gpt2", "llama"])
def test_a_stopped_hf_job_resumes_bit_identical_with_its_data_position(tmp_path, make):
    f, model, opt, loader = job(make)
    _, whole = train(f, model, opt, loader, tmp_path / "ref", STEPS)
    reference = {k: v.clone() for k, v in model.state_dict().items()}

    f, model, opt, loader = job(make)
    assert train(f, model, opt, loader, tmp_path / "c", STOP)[0] == 0
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["latest", "step-3", "step-6"]
    f, model, opt, loader = job(lambda: make(seed=1))  # other weights: the load must set them
    start, rest = train(f, model, opt, loader, tmp_path / "c", STEPS)
    assert start == 6
    assert whole[:4 * 6] + rest == whole  # the epoch goes on where step 6 left it
    assert all(torch.equal(v, reference[k]) for k, v in model.state_dict().items())
    if make is hf_models.gpt2:
        assert model.lm_head.weight is model.transformer.wte.weight
