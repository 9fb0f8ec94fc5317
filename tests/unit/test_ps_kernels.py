"""The kernel backends are visible and safe: index preconditions (an empty slots array crashed
the C probe, a full table made it spin forever with the GIL released), deletion and relinking
in a crowded index, the backend named in
server and worker logs and in ``fleet.explain()``, and one warning on the numpy fallback.

The crash and hang cases run in a subprocess with a timeout, so that a regression fails the
test instead of the test run.
"""
import json
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from fleetx.ps import kernels

sys.path.insert(0, str(Path(__file__).parent))
from ps_backends import backend, require_c_kernels  # noqa: E402,F401 (backend: a fixture)


def run_python(code: str, timeout: float = 60):
    """Run ``code`` in a fresh interpreter; a crash is a negative return code, a hang a
    TimeoutExpired (both fail the test that called this)."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout)


def full_index(cap=4, avoid=99):
    """An index whose every slot holds a key (0 .. cap-1), each with its own tag, so that it
    finds them; ``avoid``'s tag is in none of them, so the probe for ``avoid`` visits every slot
    and finds neither the key nor an empty slot."""
    keys = np.arange(cap, dtype=np.int64)
    lay = kernels._Layout(cap)
    _, tags = lay.hash(keys)
    _, bad = lay.hash(np.array([avoid], np.int64))
    assert bad[0] not in tags
    return tags | np.arange(cap, dtype=np.uint32), keys


# Every call below crashed (empty slots) or never returned (full table) before the checks.
CASES = {
    "find-empty-slots": "f(np.empty(0, np.uint32), rk, keys, out)",
    "insert-empty-slots": "i(np.empty(0, np.uint32), np.empty(4, np.int64), keys, out, 0)",
    "find-full-table": "f(full, rk, keys, out)",
    "insert-full-table": "i(full, np.zeros(8, np.int64), keys, out, 0)",
    "find-damaged-slot": "f(np.full(3, damaged, np.uint32), rk[:2], keys, out)",
}
EXPECTED = {
    "find-empty-slots": "index_find: slots must hold 1 to 2147483647 uint32 entries; got 0",
    "insert-empty-slots": "index_insert: slots must hold 1 to 2147483647 uint32 entries; got 0",
    "find-full-table": "index_find: the index is full (all 4 slots taken) and a key is absent; "
                       "grow the slots before inserting",
    "insert-full-table": "index_insert: the index is full (all 4 slots taken) and a key is "
                         "absent; grow the slots before inserting",
    "find-damaged-slot": "index_find: a slot names a row outside row_keys (a damaged index)",
}


def _case_code(entry: str, backend: str, case: str) -> str:
    pick = ("from fleetx.ps import _kernels as k" if entry == "extension" else
            f"from fleetx.ps import kernels as k; k.set_backend({backend!r})")
    full = full_index()
    _, tag = kernels._Layout(3).hash(np.array([99], np.int64))  # 99's tag, in 3 slots
    return f"""
        import numpy as np
        {pick}
        f, i, EMPTY = k.index_find, k.index_insert, 0xFFFFFFFF
        keys, out = np.array([99], np.int64), np.empty(1, np.int64)
        full = np.array({full[0].tolist()}, np.uint32)
        rk = np.array({full[1].tolist()}, np.int64)
        damaged = {int(tag[0]) | 3}  # 99's tag and row 3, past the 2 rows of rk[:2]
        try:
            {CASES[case]}
        except ValueError as e:
            print(e)
        """


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_public_index_functions_refuse_what_crashed_or_hung(backend, case):
    res = run_python(_case_code("kernels", backend, case))
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == EXPECTED[case]


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_extension_itself_refuses_what_crashed_or_hung(case):
    # the C functions check on their own: a caller that skips kernels.py cannot crash a server
    require_c_kernels()
    res = run_python(_case_code("extension", "c", case))
    assert res.returncode == 0, f"exit {res.returncode}: {res.stderr}"
    assert res.stdout.strip() == EXPECTED[case]


def test_a_full_table_still_finds_the_keys_it_holds(backend):
    slots, keys = full_index()
    out = np.empty(4, np.int64)
    assert kernels.index_find(slots, keys, np.array([3, 0, 2, 1]), out) == 0
    assert out.tolist() == [3, 0, 2, 1]


EMPTY8 = np.full(8, kernels.EMPTY, np.uint32)


@pytest.mark.parametrize("args, error", [
    ((np.zeros(0, np.uint32), np.zeros(1, np.int64), np.zeros(1, np.int64),
      np.zeros(1, np.int64)),
     "index_find: slots must hold 1 to 2147483647 uint32 entries; got 0"),
    ((EMPTY8, np.zeros(1, np.int64), np.zeros(3, np.int64), np.zeros(2, np.int64)),
     "index_find: out holds 2 rows, fewer than the 3 keys"),
])
def test_find_preconditions_are_named(backend, args, error):
    with pytest.raises(ValueError, match=error):
        kernels.index_find(*args)


def test_wrong_dtypes_are_named(backend):
    with pytest.raises(TypeError, match="index_find: keys must be a contiguous 1-D int64 array; "
                                        "got int32 of shape \\(2,\\)"):
        kernels.index_find(EMPTY8, np.zeros(1, np.int64), np.zeros(2, np.int32),
                           np.zeros(2, np.int64))
    with pytest.raises(TypeError, match="index_find: slots must be a contiguous 1-D uint32 "
                                        "array; got int64 of shape \\(8,\\)"):
        kernels.index_find(np.full(8, -1, np.int64), np.zeros(1, np.int64),
                           np.zeros(2, np.int64), np.zeros(2, np.int64))


def test_insert_without_room_writes_nothing(backend):
    slots, row_keys = EMPTY8.copy(), np.full(2, 7, np.int64)
    with pytest.raises(ValueError, match="index_insert: not enough room for 3 keys from row 0 "
                                         "\\(row_keys holds 2, the slots 8\\)"):
        kernels.index_insert(slots, row_keys, np.arange(3), np.empty(3, np.int64), 0)
    assert (slots == kernels.EMPTY).all() and (row_keys == 7).all()


def test_removing_keys_keeps_every_other_key_findable(backend):
    """Backward-shift deletion in a crowded index (load 0.75, long probe runs): after each
    removal every remaining key is found and no removed key is."""
    rng = np.random.default_rng(3)
    keys = np.unique(rng.integers(-2 ** 63, 2 ** 63 - 1, 300, np.int64))
    slots, row_keys = np.full(400, kernels.EMPTY, np.uint32), keys.copy()
    out = np.empty(len(keys), np.int64)
    assert kernels.index_insert(slots, row_keys, keys, out, 0) == len(keys)
    gone = rng.permutation(keys)[:150]
    for part in np.array_split(gone, 5):
        assert kernels.index_remove(slots, row_keys, part) == len(part)
        kept = np.setdiff1d(keys, gone[:np.flatnonzero(gone == part[-1])[0] + 1])
        assert kernels.index_find(slots, row_keys, kept, np.empty(len(kept), np.int64)) == 0
        missing = np.empty(len(part), np.int64)
        assert kernels.index_find(slots, row_keys, part, missing) == len(part)
    assert kernels.index_remove(slots, row_keys, gone[:3]) == 0  # already gone: skipped
    assert int((slots != kernels.EMPTY).sum()) == len(keys) - len(gone)


def test_relink_points_a_key_at_its_new_row(backend):
    keys = np.array([10, 20, 30], np.int64)
    slots, row_keys = EMPTY8.copy(), np.zeros(4, np.int64)
    kernels.index_insert(slots, row_keys, keys, np.empty(3, np.int64), 0)
    row_keys[3] = 30  # the caller copied key 30 to row 3; its slot still names row 2
    kernels.index_relink(slots, row_keys, np.array([30]), np.array([3]))
    out = np.empty(3, np.int64)
    kernels.index_find(slots, row_keys, keys, out)
    assert out.tolist() == [0, 1, 3]
    with pytest.raises(KeyError, match="index_relink: a key is not in the index"):
        kernels.index_relink(slots, row_keys, np.array([99]), np.array([0]))


def test_rebuild_indexes_rows_in_place(backend):
    keys = np.array([5, -5, 2 ** 62], np.int64)
    slots = np.full(5, kernels.EMPTY, np.uint32)
    kernels.index_rebuild(slots, keys, 3)
    out = np.empty(3, np.int64)
    assert kernels.index_find(slots, keys, keys[::-1].copy(), out) == 0
    assert out.tolist() == [2, 1, 0]
    with pytest.raises(ValueError, match="index_rebuild: 5 rows do not fit"):
        kernels.index_rebuild(np.full(5, kernels.EMPTY, np.uint32), np.zeros(5, np.int64), 5)


# -- de-duplication and the finiteness check -------------------------------------------------
@pytest.mark.parametrize("ids", [
    np.array([], np.int64), np.array([7], np.int64), np.array([5, 5, 5, 5], np.int64),
    np.array([2 ** 63 - 1, -2 ** 63, 0, -1, 2 ** 63 - 1, 0], np.int64),
    np.random.default_rng(1).zipf(1.2, 20_000).astype(np.int64) * -7919,
], ids=["empty", "one", "all-equal", "extremes", "zipf"])
def test_unique_inverse_equals_numpy_unique(backend, ids):
    uniq, inverse = kernels.unique_inverse(ids)
    want, want_inverse = np.unique(ids, return_inverse=True)
    assert uniq.tolist() == want.tolist() and inverse.tolist() == want_inverse.tolist()
    first, first_inverse = kernels.unique_first(ids.reshape(-1, 1) if len(ids) else ids)
    assert sorted(first.tolist()) == want.tolist() and len(set(first.tolist())) == len(first)
    assert (first[first_inverse] == ids).all() and first_inverse.shape == ids.shape


def test_unique_first_keeps_the_order_of_first_occurrence():
    require_c_kernels()
    uniq, inverse = kernels.unique_first(np.array([9, -3, 9, 4, -3, 9], np.int64))
    assert uniq.tolist() == [9, -3, 4] and inverse.tolist() == [0, 1, 0, 2, 1, 0]


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, None])
@pytest.mark.parametrize("size", [1, 1023, 1024, 5000])
def test_all_finite_finds_nan_and_inf_anywhere(backend, bad, size):
    for at in sorted({0, size // 2, size - 1}):
        values = np.linspace(-3e38, 3e38, size, dtype=np.float32)
        if bad is not None:
            values[at] = bad
        assert kernels.all_finite(values) is (bad is None)
    assert kernels.all_finite(np.zeros(0, np.float32)) is True
    assert kernels.all_finite(np.array([[1, np.nan]], np.float64)) is False  # any dtype


# -- the backend is named ----------------------------------------------------------------------
def test_the_backend_is_described(backend):
    if backend == "c":
        assert kernels.describe() == "C kernels"
    else:
        assert kernels.describe() == ("numpy fallback (chosen with kernels.set_backend('numpy'); "
                                      "C kernels are built)")


FALLBACK = """
    import json, logging, sys, warnings
    sys.modules["fleetx.ps._kernels"] = None     # the extension cannot be imported
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s", stream=sys.stdout)
    from fleetx.ps import kernels
    log = logging.getLogger("fleetx.ps")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kernels.log_backend(log, "server 0")
        kernels.log_backend(log, "worker 0")
    print(json.dumps({"backend": kernels.backend(), "warnings": [str(w.message) for w in caught],
                      "categories": [w.category.__name__ for w in caught]}))
"""


def test_without_the_extension_the_fallback_is_logged_and_warned_once():
    res = run_python(FALLBACK)
    assert res.returncode == 0, res.stderr
    *logged, last = res.stdout.strip().splitlines()
    facts = json.loads(last)
    assert facts["backend"] == "numpy"
    assert len(logged) == 2 and all(line.startswith("WARNING ") for line in logged), logged
    assert logged[0].startswith("WARNING server 0: parameter-server kernels: numpy fallback "
                                "(2.5-8x slower than the C kernels, which are not built: ")
    assert "to fix, install a C compiler and the Python headers (`bash scripts/setup.sh`" \
        in logged[1] and logged[1].startswith("WARNING worker 0:")
    assert facts["categories"] == ["RuntimeWarning"]  # once per process, not per call
    assert facts["warnings"][0].startswith("fleetx.ps runs on its numpy fallback, 2.5-8x "
                                           "slower than its C kernels; to fix, install a C")


def test_set_backend_c_without_the_extension_says_how_to_fix():
    res = run_python("""
        import sys
        sys.modules["fleetx.ps._kernels"] = None
        from fleetx.ps import kernels
        try:
            kernels.set_backend("c")
        except ImportError as e:
            print(e)
        """)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("fleetx.ps._kernels is not built (")
    assert "to fix, install a C compiler and the Python headers" in res.stdout


def test_server_and_worker_logs_name_the_backend(backend, caplog):
    from fleetx.ps import KVClient, PSConfig, PSServer, RuleConfig, SparseTableSpec, Tables
    from fleetx.ps.api import InitConfig
    tables = Tables((SparseTableSpec("emb", 2, RuleConfig("sgd", lr=0.1), InitConfig()),), ())
    config = PSConfig(["127.0.0.1:0"], 1, timeout=20)
    with caplog.at_level(logging.INFO, logger="fleetx.ps"):
        server = PSServer(config, 0, tables).start()
        try:
            client = KVClient(PSConfig([server.endpoint], 1, timeout=20), 0, tables)
            client.start()
            client.stop()
        finally:
            server.stop()
    named = [r.getMessage() for r in caplog.records if "parameter-server kernels" in r.getMessage()]
    assert named == [f"{server.name}: parameter-server kernels: {kernels.describe()}",
                     f"worker 0: parameter-server kernels: {kernels.describe()}"]


def test_explain_names_the_backend_of_a_ps_job(backend):
    import torch
    from fleetx.fleet import Fleet
    from fleetx.role_maker import Role, UserDefinedRoleMaker
    from fleetx import DistributedStrategy
    f = Fleet()
    f.init(UserDefinedRoleMaker(current_id=0, role=Role.WORKER, worker_num=1,
                                server_endpoints=["127.0.0.1:1"]))
    model = f.distributed_model(torch.nn.Linear(2, 1))
    f.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), DistributedStrategy())
    assert f"  parameter-server kernels: {kernels.describe()}" in str(f.explain(file=sys.stderr))
