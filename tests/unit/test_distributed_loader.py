"""fleet.distributed_loader without processes: the ranks' shares of each epoch's order, the
state that resumes mid-epoch (workers included) and re-splits the rest of an epoch at another
world size, the errors, and (one process) the positions saved and restored by
save_checkpoint / load_checkpoint / auto_checkpoint with no user code."""
import json
import warnings
from collections import Counter

import pytest
import torch
from torch import nn
from torch.utils.data import IterableDataset, TensorDataset

from fleetx import fleet
from fleetx.checkpoint import CheckpointError
from fleetx.data.loader import DistributedLoader, RankSampler
from fleetx.fleet.api import FleetError

DATA = TensorDataset(torch.arange(24))


def loaders(world: int, **kw):
    return [DistributedLoader(DATA, kw.pop("batch_size", 2), r, world, seed=3, **kw)
            for r in range(world)]


def indices(loader, batches=None) -> list:
    """The sample indices of ``batches`` batches of one iteration (all when None)."""
    out = []
    for i, (b,) in enumerate(loader):
        out += b.tolist()
        if batches is not None and i + 1 == batches:
            break
    return out


def saved(loader) -> dict:
    return json.loads(json.dumps(loader.state_dict()))  # what a checkpoint's record keeps


def test_the_ranks_share_each_epochs_order_and_a_new_iter_is_the_next_epoch():
    ranks = loaders(2)
    first = [indices(lo) for lo in ranks]
    assert sorted(first[0] + first[1]) == list(range(24))
    order = RankSampler(24, 0, 1, seed=3).order()  # epoch 0's order: randperm seeded by 3
    assert first[0] == order[0::2] and first[1] == order[1::2]
    second = [indices(lo) for lo in ranks]
    assert [lo.epoch for lo in ranks] == [1, 1] and second != first
    assert sorted(second[0] + second[1]) == list(range(24))
    assert indices(DistributedLoader(DATA, 4, 0, 1, shuffle=False)) == list(range(24))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_loaded_state_continues_mid_epoch_as_the_uninterrupted_loader(workers):
    ref = DistributedLoader(DATA, 3, 1, 2, seed=3, num_workers=workers)
    reference = [indices(ref) for _ in range(2)]
    cut = DistributedLoader(DATA, 3, 1, 2, seed=3, num_workers=workers)
    head = indices(cut, batches=2)  # 2 batches of 4 taken, epoch 0
    state = saved(cut)
    assert (state["epoch"], state["position"]) == (0, 12)
    resumed = DistributedLoader(DATA, 3, 1, 2, seed=3, num_workers=workers)
    resumed.load_state_dict(state)
    assert resumed.epoch == 0
    assert head + indices(resumed) == reference[0]
    assert indices(resumed) == reference[1]  # then the next epoch, as the uninterrupted one
    # a state saved at the end of an epoch continues with the next epoch
    end = DistributedLoader(DATA, 3, 1, 2, seed=3, num_workers=workers)
    indices(end)
    again = DistributedLoader(DATA, 3, 1, 2, seed=3, num_workers=workers)
    again.load_state_dict(saved(end))
    assert again.epoch == 1 and indices(again) == reference[1]


@pytest.mark.parametrize("world", [1, 3, 4])
def test_at_another_world_size_the_rest_of_the_epoch_is_split_each_sample_once(world):
    old = loaders(2)
    seen = [i for lo in old for i in indices(lo, batches=3)]  # 12 of 24 consumed
    state = saved(old[0])
    new = loaders(world, batch_size=5)
    for lo in new:
        lo.load_state_dict(state)
    rest = [i for lo in new for i in indices(lo)]
    assert sorted(seen + rest) == list(range(24))  # 12 left: divide among 1, 3, 4 ranks
    assert [lo.epoch for lo in new] == [0] * world


def test_a_rest_that_does_not_divide_is_padded_with_the_epochs_first_samples():
    old = loaders(2)
    seen = [i for lo in old for i in indices(lo, batches=1)]  # 4 consumed, 20 left
    new = loaders(3)
    for lo in new:
        lo.load_state_dict(saved(old[0]))
    shares = [indices(lo) for lo in new]
    assert [len(s) for s in shares] == [7, 7, 7]  # 20 left: one padded sample
    counts = Counter(seen + sum(shares, []))
    assert set(counts) == set(range(24)) and sum(counts.values()) == 25
    assert [i for i, n in counts.items() if n == 2] == [RankSampler(24, 0, 1, seed=3).order()[0]]


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(3))


def test_errors_name_the_bad_argument_and_what_is_supported():
    with pytest.raises(TypeError, match=r"takes a map-style dataset .*Stream is an "
                                        r"IterableDataset, which has no index to split"):
        DistributedLoader(Stream(), 2, 0, 1)
    with pytest.raises(TypeError, match=r"takes a map-style dataset .*int has no __len__ or "
                                        r"__getitem__"):
        DistributedLoader(3, 2, 0, 1)
    with pytest.raises(TypeError, match=r"distributed_loader\(\.\.\., sampler=\.\.\.\) conflicts "
                                        r"with the loader's own: the loader splits the data "
                                        r"among ranks .*shuffle= and seed="):
        DistributedLoader(DATA, 2, 0, 1, sampler=range(24))
    with pytest.raises(TypeError, match=r"batch_sampler=\.\.\.\) conflicts"):
        DistributedLoader(DATA, 2, 0, 1, batch_sampler=[[0]])
    with pytest.raises(TypeError, match=r"generator=\.\.\.\) conflicts .*seeds its workers"):
        DistributedLoader(DATA, 2, 0, 1, generator=torch.Generator())
    with pytest.raises(ValueError, match=r"batch_size=\.\.\.\) expects a whole number of "
                                         r"samples of at least 1, got 0"):
        DistributedLoader(DATA, 0, 0, 1)
    lo = DistributedLoader(DATA, 2, 0, 1, seed=4)
    with pytest.raises(ValueError, match=r"position has seed=3, this loader seed=4: build the "
                                         r"loader as the job that saved"):
        lo.load_state_dict(saved(loaders(1)[0]))


# -- the fleet: registered loaders travel in the training checkpoints -------------------------
def job(tmp_path, loaders_made=1):
    f = fleet.Fleet()
    f.init(is_collective=True)
    torch.manual_seed(0)
    model = f.distributed_model(nn.Linear(1, 1))
    opt = f.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.01))
    made = [f.distributed_loader(DATA, 4, seed=7) for _ in range(loaders_made)]
    return f, model, opt, made


def train(model, opt, loader, batches):
    seen = []
    for (b,) in loader:
        opt.minimize(model(b.float()[:, None]).pow(2).mean())
        seen += b.tolist()
        if len(seen) == 4 * batches:
            break
    return seen


@pytest.mark.usefixtures("one_process")
def test_the_fleets_checkpoints_carry_the_loaders_positions(tmp_path):
    f, model, opt, (lo,) = job(tmp_path)
    assert f.auto_checkpoint(tmp_path / "ckpt", every_steps=3) == 0
    head = train(model, opt, lo, 5)  # saved automatically at step 3 (12 samples)
    f, model, opt, (lo,) = job(tmp_path)
    assert f.auto_checkpoint(tmp_path / "ckpt", every_steps=3) == 3
    assert (lo.epoch, lo.position) == (0, 12)
    rest = train(model, opt, lo, 3)
    assert head[:12] + rest == indices(DistributedLoader(DATA, 4, 0, 1, seed=7))
    # another number of loaders is refused, nothing loaded
    f, model, opt, _ = job(tmp_path, loaders_made=2)
    with pytest.raises(CheckpointError, match=r"holds the position of 1 data loader\(s\), this "
                                              r"job built 2 with fleet.distributed_loader"):
        f.load_checkpoint(tmp_path / "ckpt")
    # a loader made after a load that found positions would start at 0: refused
    f, model, opt, _ = job(tmp_path, loaders_made=0)
    f.load_checkpoint(tmp_path / "ckpt")
    with pytest.raises(FleetError, match=r"after a load: the checkpoint loaded held the position "
                                         r"of 1 data loader\(s\).* build the loaders before"):
        f.distributed_loader(DATA, 4)
    # a checkpoint saved without loaders: the loader starts at epoch 0, and says so
    f.save_checkpoint(tmp_path / "none")
    f, model, opt, (lo,) = job(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        f.load_checkpoint(tmp_path / "none")
    assert any("holds no data loader position" in str(w.message) for w in caught), caught
    assert (lo.epoch, lo.position) == (0, 0)
