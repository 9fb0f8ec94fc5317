"""Saves whose metadata lies (written by a hostile or broken writer, with a consistent
manifest): every field a load sizes or trusts is checked for its type and range before it is
used, and the load is refused with an error naming the file, fast and without allocating for
what the file claims."""
import time
import tracemalloc

import numpy as np
import pytest

from fleetx.checkpoint import CheckpointError, SaveWriter
from fleetx.ps import RuleConfig, SparseTableSpec
from fleetx.ps.api import AccessorConfig, ShowClickEntry
from fleetx.ps.chain import open_chain
from fleetx.ps.checkpoint import load_server
from fleetx.ps.rules import make_rule
from fleetx.ps.table import SparseTable

SPEC = SparseTableSpec("t", 2, RuleConfig("sgd"), entry=ShowClickEntry(),
                       accessor=AccessorConfig(show_click_decay_rate=0.5))


def meta(writer, server=0, num_servers=1):
    return {"format": 3, "save_id": writer.save_id, "server": server,
           "num_servers": num_servers, "shard_num": 1, "mode": 1,
           "tables": {"t": {"kind": "sparse", "dim": 2, "width": 2, "rule": "sgd", "rows": 1,
                            "passes": 0, "stats": 3}}}


def write(tmp_path, folders=((0, 1),), name="s", info=None, base=None, **fields):
    """A save with the given server folders, each with one row of table ``t``."""
    w = SaveWriter(str(tmp_path / name))
    for server, n in folders:
        folder = f"server-{server}-of-{n}"
        m = meta(w, server, n)
        m.update(fields)
        if m.get("mode") == 2 and base is not None:
            m.update(base_save_id=base, prev_save_id=base)
            m["tables"]["t"]["deleted"] = 0
            w.write_array(f"{folder}/sparse-t.deleted.npy", np.empty(0, np.int64))
        w.write_array(f"{folder}/sparse-t.keys.npy", np.array([server], np.int64))
        w.write_array(f"{folder}/sparse-t.rows.npy", np.ones((1, 2), np.float32))
        w.write_array(f"{folder}/sparse-t.stats.npy", np.ones((1, 3), np.float32))
        w.write_json(f"{folder}/meta.json", m)
    mode = fields.get("mode", 1)
    info = info if info is not None else {"mode": mode} if mode in (0, 1, 2) else {}
    if mode == 2 and base is not None:
        info.update(base_save_id=base, prev_save_id=base)
    w.commit(info)
    return str(tmp_path / name), w.save_id


def refused(dirnames, match):
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(CheckpointError, match=match):
            open_chain(dirnames)
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert time.perf_counter() - t0 < 2.0 and peak < 8 << 20


def test_a_float_num_servers_is_refused_naming_the_file(tmp_path):
    d, _ = write(tmp_path, ((0, 2), (1, 2)), num_servers=2.0)
    refused(d, r"server-\d-of-2/meta.json: says server \d of 2.0 .* must be ints")


def test_a_huge_num_servers_is_refused_without_allocating_for_it(tmp_path):
    d, _ = write(tmp_path, ((0, 3_000_000),))
    refused(d, r"incomplete checkpoint: server-0-of-3000000/meta.json claims 3000000 servers, "
               r"but the save holds 1 server folder")


@pytest.mark.parametrize("field, value", [("server", True), ("server", 1.0),
                                          ("num_servers", "1"), ("shard_num", 1.5),
                                          ("shard_num", None)])
def test_server_fields_must_be_ints(tmp_path, field, value):
    d, _ = write(tmp_path, **{field: value})
    refused(d, r"server-0-of-1/meta.json: says .* must be ints")


@pytest.mark.parametrize("shard_num", [0, 2 ** 40])
def test_shard_num_out_of_range_is_refused(tmp_path, shard_num):
    d, _ = write(tmp_path, shard_num=shard_num)
    refused(d, r"server-0-of-1/meta.json: .* expected 0 <= server < num_servers <= shard_num "
               r"<= 2147483648")


@pytest.mark.parametrize("mode", [1.0, True, "1", 7, None])
def test_a_mode_of_another_type_or_value_is_refused(tmp_path, mode):
    d, _ = write(tmp_path, mode=mode)
    refused(d, r"meta.json: unknown save mode .*: expected one of \(0, 1, 2, 'export'\)")


def test_a_format_of_another_type_is_refused(tmp_path):
    d, _ = write(tmp_path, format=3.0)
    refused(d, r"meta.json: checkpoint format 3.0, expected one of \(2, 3\)")


@pytest.mark.parametrize("value", [5, "../x", "", None])
def test_a_delta_must_name_its_chain_with_save_ids(tmp_path, value):
    base, base_id = write(tmp_path, name="base")
    d, _ = write(tmp_path, name="d", mode=2, info={"mode": 2}, base_save_id=value,
                 prev_save_id=base_id)
    refused([base, d], r"meta.json: base_save_id=.*: expected a save id \(a string\) in a "
                       r"delta \(mode 2\) only")


def test_chain_ids_in_a_full_save_are_refused(tmp_path):
    d, _ = write(tmp_path, base_save_id="20260101T000000Z-00000000")
    refused(d, r"meta.json: base_save_id='20260101T000000Z-00000000': expected a save id "
               r"\(a string\) in a delta \(mode 2\) only")


@pytest.mark.parametrize("name", ["", "a/b", "x\x00", "y" * 201])
def test_bad_table_names_are_refused(tmp_path, name):
    d, _ = write(tmp_path, tables={name: {"kind": "sparse"}})
    refused(d, r"meta.json: bad table name .*: expected 1-200 printable characters without '/'")


@pytest.mark.parametrize("passes", [2.5, -1, "3", True])
def test_a_bad_pass_counter_is_refused(tmp_path, passes):
    w_meta = meta(SaveWriter(str(tmp_path / "x")))["tables"]["t"]
    d, _ = write(tmp_path, tables={"t": {**w_meta, "passes": passes}})
    t = SparseTable(SPEC, make_rule(SPEC.rule))
    with pytest.raises(CheckpointError, match=r"meta.json: malformed 'passes' count"):
        load_server(d, 0, 1, 1, {"t": t}, {})


def test_a_delta_claiming_a_huge_number_of_passes_is_refused_quickly(tmp_path):
    """A delta replays the show/click decay of the passes since the save before it: a delta
    that claims 10**12 of them is refused rather than replayed."""
    base, base_id = write(tmp_path, name="base")
    w_meta = meta(SaveWriter(str(tmp_path / "x")))["tables"]["t"]
    d, _ = write(tmp_path, name="d", mode=2, base=base_id,
                 tables={"t": {**w_meta, "passes": 10 ** 12}})
    t = SparseTable(SPEC, make_rule(SPEC.rule))
    t0 = time.perf_counter()
    with pytest.raises(CheckpointError, match=r"meta.json: table 't': 1000000000000 passes, "
                                              r"1000000000000 after the save before it"):
        load_server([base, d], 0, 1, 1, {"t": t}, {})
    assert time.perf_counter() - t0 < 2.0
