"""An export for serving holds the servers' dense weights and leaves the worker's own model as it
was: a GEO worker's weights differ from the servers' between exchanges and its next delta is
measured from them, so an export that replaced them would send other workers' updates back as
its own."""
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

from fleetx.nn import SparseEmbedding
from fleetx.ps_torch.export import export
from fleetx.ps_torch.layout import ModelLayout

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import Done  # noqa: E402  (tests/helpers.py)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.user = SparseEmbedding(2, name="user")
        self.mlp = nn.Linear(2, 1)


class ServerSide:
    """The communicator an export talks to: servers whose dense weights are ``dense``."""

    def __init__(self, dense):
        self.dense, self.client, self.flushed = dense, self, 0

    def flush(self):
        self.flushed += 1

    def save(self, dirname, save_id, mode):
        assert mode == "export"
        return Done(({}, []))

    def pull(self, ids=None, dense=None, create=True):
        return Done(type("Reply", (), {"dense": {n: self.dense[n] for n in dense}}))


def test_the_export_holds_the_servers_dense_weights_and_the_model_keeps_its_own(tmp_path):
    torch.manual_seed(0)
    model = Net()
    layout = ModelLayout.of(model, torch.optim.SGD(model.parameters(), lr=0.1))
    layout.flatten_dense()
    own = {k: v.clone() for k, v in model.mlp.state_dict().items()}
    (name, values), = layout.dense_values().items()
    servers = ServerSide({name: np.arange(values.size, dtype=np.float32) + 10})
    session = type("Session", (), {"comm": servers})()
    export(session, layout, model, str(tmp_path / "export"))
    assert servers.flushed == 1
    for key, value in model.mlp.state_dict().items():   # the worker's model: unchanged
        assert torch.equal(value, own[key]), key
    saved = torch.load(next((tmp_path / "export").glob("save-*/model.pt")))
    exported = torch.cat([saved["mlp.weight"].reshape(-1), saved["mlp.bias"].reshape(-1)])
    np.testing.assert_array_equal(exported.numpy(), servers.dense[name])
