"""``fleet.save_inference_model``: the trained model in files a serving team reads without fleetx.

The export is a checkpoint folder (atomic, with a manifest of SHA-256 hashes); inside its save
folder (``manifest.json``'s ``"folder"``)::

    export.json                  what is where (below)
    model.pt                     torch.save of the model's state_dict: the dense parameters and
                                 buffers, and the full weight of every table that came from an
                                 nn.Embedding / nn.EmbeddingBag (under its original key), so
                                 the user's own model class loads it with load_state_dict
    server-<i>-of-<n>/sparse-<table>.keys.npy   int64 ids
    server-<i>-of-<n>/sparse-<table>.rows.npy   float32 (ids, dim) weights, same order

``export.json`` = ``{"format": 1, "state_dict": "model.pt", "sparse": {table: {"dim",
"module" (its path in the model), "state_dict_key" (or null), "missing" ("zeros" for tables
with an admission entry, else "initial": the row's initial value, docs/ps_tables.md), "parts":
[{"ids": path, "rows": path}, ...]}}}``. A loader concatenates a table's parts; every id is in
exactly one part. Only weights are exported: no optimizer state, statistics or counts.
"""
from __future__ import annotations

import io
from typing import Any

import numpy as np
import torch

from fleetx.checkpoint import SaveWriter
from fleetx.ps import checkpoint
from fleetx.ps_torch.layout import ModelLayout

__all__ = ["export", "describe", "FORMAT"]

FORMAT = 1


def export(session: Any, layout: ModelLayout, model: torch.nn.Module, dirname: str) -> dict:
    """Write the export of ``model`` (whose tables ``session`` serves) to ``dirname`` and
    commit it; returns the content of ``export.json``.

    Raises:
        fleetx.checkpoint.CheckpointError: a file or the commit cannot be written.
        fleetx.ps.RemoteError: a server refused (NaN rows, a folder outside its save root).
    """
    writer = SaveWriter(dirname)
    comm = getattr(session, "comm", None)
    own = None
    if comm is not None:  # servers write their shards' weights
        if hasattr(session, "flush_heter"):  # a heter worker's queued steps first
            session.flush_heter()
        comm.flush()
        _, files = comm.client.save(writer.dirname, writer.save_id, "export").wait()
        writer.add(files)
        names = [t.name for t in layout.tables.dense]
        if names:  # the servers' dense weights are the model's; this worker's stay its own
            own = {n: np.array(v, copy=True) for n, v in layout.dense_values().items()}
            layout.load_dense(comm.client.pull(dense=names).wait().dense)
    else:
        checkpoint.save_server(writer, 0, 1, 1, session.backend.tables, {}, "export")
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    if own is not None:
        # A GEO worker's local weights differ from the servers' between exchanges, and its
        # next delta is measured from them: an export must not change them.
        layout.load_dense(own)
    paths = {id(m): p for p, m in model.named_modules()}
    described = {}
    for name, m in layout.sparse.items():
        key = None
        if m.num_embeddings is not None:  # a converted nn.Embedding: its whole weight
            key = f"{paths[id(m)]}.weight" if paths[id(m)] else "weight"
            state[key] = torch.from_numpy(_rows(session, name, np.arange(m.num_embeddings)))
        described[name] = {"dim": m.embedding_dim, "module": paths.get(id(m), ""),
                           "state_dict_key": key,
                           "missing": "zeros" if layout.tables.get(name).admission
                           else "initial",
                           "parts": _parts(writer, name)}
    buf = io.BytesIO()
    torch.save(state, buf)
    writer.write_bytes("model.pt", buf.getvalue())
    doc = {"format": FORMAT, "state_dict": "model.pt", "sparse": described}
    writer.write_json("export.json", doc)
    writer.commit({"mode": "export"})
    return doc


def _rows(session: Any, table: str, ids: np.ndarray) -> np.ndarray:
    """The current weights of ``ids`` (read without creating rows)."""
    comm = getattr(session, "comm", None)
    if comm is None:
        return session.backend.tables[table].pull(ids, create=False)
    rows = comm.client.pull({table: ids}, create=False).wait().sparse[table]
    return rows.expand()


def _parts(writer: SaveWriter, table: str) -> list:
    keys = sorted(p for p in writer.entries if p.endswith(f"/sparse-{table}.keys.npy"))
    return [{"ids": k, "rows": k[:-len(".keys.npy")] + ".rows.npy"} for k in keys]


def describe(doc: dict) -> str:
    """One line per exported table, for the worker's console."""
    return "; ".join(f"{n}: dim {t['dim']}, {len(t['parts'])} part(s)"
                     + (f", also {t['state_dict_key']}" if t["state_dict_key"] else "")
                     for n, t in doc["sparse"].items()) or "no sparse tables"
