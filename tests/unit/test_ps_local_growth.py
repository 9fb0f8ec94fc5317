"""A one-process job (no servers): save modes and chains through the runtime, a failed save
blocking deltas until a full save, and the row storage that grows by remapping."""
import numpy as np
import pytest
import torch
from torch import nn

from fleetx.checkpoint import CheckpointError
from fleetx.nn import SparseEmbedding
from fleetx.ps.api import AccessorConfig, InitConfig, StateError
from fleetx.ps.storage import RowArray
from fleetx.ps_torch.runtime import PSRuntime


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = SparseEmbedding(3, name="emb", init=InitConfig("uniform", seed=2),
                                   accessor=AccessorConfig(delete_after_unseen_days=0))
        self.out = nn.Linear(3, 1)

    def forward(self, ids):
        return self.out(self.emb(ids)).squeeze(-1)


def runtime(load=None):
    torch.manual_seed(0)
    model = Net()
    rt = PSRuntime(model, torch.optim.SGD(model.parameters(), lr=0.1), None, is_server=False,
                   index=0, log_interval=0)
    if load is not None:
        rt.init_server(load)
    rt.init_worker()
    return rt, model


def train(rt, model, ids):
    loss = model(torch.tensor(ids)).pow(2).mean()
    loss.backward()
    rt.step()
    rt.zero_grad()


def rows(rt):
    t = rt._session.backend.tables["emb"]
    return dict(zip(t.index.keys.tolist(), t.slab.tolist()))


def test_a_local_base_and_deltas_reload_exactly(tmp_path):
    rt, model = runtime()
    train(rt, model, [1, 2, 3, 4])
    assert rt.shrink()["emb"] == {"removed": 0, "forgotten": 0, "rows": 4}
    rt.save_persistables(str(tmp_path / "base"), mode=1)
    train(rt, model, [3, 4, 5])
    assert rt.shrink()["emb"]["removed"] == 2  # 1 and 2 were not updated in pass 1
    rt.save_persistables(str(tmp_path / "d1"), mode=2)
    train(rt, model, [1, 6])
    rt.save_persistables(str(tmp_path / "d2"), mode=2)
    again, model2 = runtime([str(tmp_path / d) for d in ("base", "d1", "d2")])
    assert rows(again) == rows(rt) and sorted(rows(rt)) == [1, 3, 4, 5, 6]
    for a, b in zip(model.out.parameters(), model2.out.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_failed_save_blocks_deltas_until_a_full_save(tmp_path):
    rt, model = runtime()
    train(rt, model, [1])
    rt.save_persistables(str(tmp_path / "base"), mode=1)
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(CheckpointError):
        rt.save_persistables(str(tmp_path / "file"), mode=2)
    with pytest.raises(StateError, match=r"the previous save failed, so a delta would follow a "
                                         r"save that was never committed"):
        rt.save_persistables(str(tmp_path / "d"), mode=2)
    rt.save_persistables(str(tmp_path / "base2"), mode=0)
    rt.save_persistables(str(tmp_path / "d"), mode=2)
    with pytest.raises(ValueError, match=r"save_persistables\(mode=3\): expected 0"):
        rt.save_persistables(str(tmp_path / "x"), mode=3)


def test_a_local_delta_needs_a_base():
    rt, model = runtime()
    with pytest.raises(StateError, match=r"mode=2\): a delta needs a base"):
        rt.save_persistables("/nonexistent/never", mode=2)


def test_row_arrays_grow_in_place_and_give_pages_back():
    a = RowArray(4, np.float32, 10)
    a.array[:10] = np.arange(40, dtype=np.float32).reshape(10, 4)
    a.reserve(100_000, used=10)
    assert a.capacity >= 100_000
    np.testing.assert_array_equal(a.array[:10].reshape(-1), np.arange(40))
    held = a.array[:3]  # a live view: the mapping cannot move, so growth copies
    a.reserve(1_000_000, used=10)
    np.testing.assert_array_equal(a.array[:10].reshape(-1), np.arange(40))
    assert held[2, 3] == 11  # the old view is still valid memory
    a.array[5000:] = 1.0
    a.release(10)
    assert (a.array[2000:] == 0).all() and a.array[9, 3] == 39
