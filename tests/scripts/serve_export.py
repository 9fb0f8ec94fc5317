"""Score an export of ``ps_export_train.py`` the way a serving team would: plain torch and
numpy, with fleetx made impossible to import. Prints the scores of the fixed batch as JSON.

Usage: python serve_export.py EXPORT_DIR
"""
import importlib.abc
import json
import sys
from pathlib import Path


class _NoFleetx(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "fleetx" or name.startswith("fleetx."):
            raise ImportError(f"{name} is not importable here (a serving process)")
        return None


sys.meta_path.insert(0, _NoFleetx())

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

USERS = [2 ** 40 + k for k in range(12)]


class Net(nn.Module):
    """The trained model's dense part, as the serving side defines it."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(30, 4)
        self.mlp = nn.Sequential(nn.Linear(11, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, ids, user_rows, x):
        return self.mlp(torch.cat([self.emb(ids), user_rows, x], 1)).squeeze(1)


def load(export_dir: Path):
    folder = export_dir / json.loads((export_dir / "manifest.json").read_text())["folder"]
    desc = json.loads((folder / "export.json").read_text())
    model = Net()
    model.load_state_dict(torch.load(folder / desc["state_dict"], weights_only=True))
    tables = {}
    for name, t in desc["sparse"].items():
        ids = np.concatenate([np.load(folder / p["ids"]) for p in t["parts"]])
        rows = np.concatenate([np.load(folder / p["rows"]) for p in t["parts"]])
        order = np.argsort(ids)
        tables[name] = (ids[order], rows[order])
    return model.eval(), tables


def lookup(table, wanted: np.ndarray) -> np.ndarray:
    ids, rows = table
    pos = np.searchsorted(ids, wanted)
    assert (ids[pos] == wanted).all(), "an id of the batch is not in the export"
    return rows[pos]


def main() -> None:
    try:
        import fleetx  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("fleetx imported: the check is void")
    model, tables = load(Path(sys.argv[1]))
    g = torch.Generator().manual_seed(100)  # the batch of ps_export_train.batch(100)
    ids = torch.randint(0, 30, (16,), generator=g)
    users = torch.tensor(USERS)[torch.randint(0, len(USERS), (16,), generator=g)]
    x = torch.rand(16, 3, generator=g)
    user_rows = torch.from_numpy(lookup(tables["user"], users.numpy()))
    with torch.no_grad():
        print(json.dumps(model(ids, user_rows, x).tolist()))


if __name__ == "__main__":
    main()
