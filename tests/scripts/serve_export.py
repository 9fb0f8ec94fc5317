"""Score an export of ``ps_export_train.py`` the way a serving team would: plain torch and
numpy, with fleetx made impossible to import, through the loader printed in
``docs/ps_tables.md`` (run from the page itself). Prints the scores of the fixed batch as JSON.

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


def doc_loader() -> dict:
    """The loader code block of docs/ps_tables.md, run: its ``load_export`` and ``lookup``."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "ps_tables.md").read_text()
    block = page.split("<!-- export-loader:", 1)[1].split("```python\n", 1)[1]
    namespace: dict = {}
    exec(compile(block.split("```", 1)[0], "docs/ps_tables.md", "exec"), namespace)
    return namespace


def main() -> None:
    try:
        import fleetx  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("fleetx imported: the check is void")
    loader = doc_loader()
    state, tables = loader["load_export"](Path(sys.argv[1]))
    model = Net()
    model.load_state_dict(state)
    model.eval()
    g = torch.Generator().manual_seed(100)  # the batch of ps_export_train.batch(100)
    ids = torch.randint(0, 30, (16,), generator=g)
    users = torch.tensor(USERS)[torch.randint(0, len(USERS), (16,), generator=g)]
    x = torch.rand(16, 3, generator=g)
    assert np.isin(users.numpy(), tables["user"][0]).all(), "a user id is not in the export"
    user_rows = torch.from_numpy(loader["lookup"](tables["user"], users.numpy()))
    with torch.no_grad():
        print(json.dumps(model(ids, user_rows, x).tolist()))


if __name__ == "__main__":
    main()
