"""The kernel backends are visible and safe: index preconditions (an empty slots array crashed
the C probe, a full table made it spin forever with the GIL released), the backend named in
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


def full_slots(cap=4):
    """An index whose every slot holds a key (0 .. cap-1): the probe for any other key visits
    every slot and finds neither the key nor an empty slot."""
    slots = np.empty(2 * cap, np.int64)
    slots[0::2], slots[1::2] = np.arange(cap), np.arange(cap)
    return slots


# Every call below crashed (empty slots) or never returned (full table) before the checks.
CASES = {
    "find-empty-slots": "f(np.empty(0, np.int64), keys, out)",
    "insert-empty-slots": "i(np.empty(0, np.int64), np.empty(4, np.int64), keys, out, 0)",
    "find-full-table": "f(full, keys, out)",
    "insert-full-table": "i(full, np.empty(8, np.int64), keys, out, 0)",
}
EXPECTED = {
    "find-empty-slots": "index_find: slots must hold 2 * capacity int64 entries with the capacity "
                        "a power of two >= 1; got 0 entries",
    "insert-empty-slots": "index_insert: slots must hold 2 * capacity int64 entries with the "
                          "capacity a power of two >= 1; got 0 entries",
    "find-full-table": "index_find: the index is full (all 4 slots taken) and a key is absent; "
                       "grow the slots before inserting",
    "insert-full-table": "index_insert: the index is full (all 4 slots taken) and a key is "
                         "absent; grow the slots before inserting",
}


def _case_code(entry: str, backend: str, case: str) -> str:
    pick = ("from fleetx.ps import _kernels as k" if entry == "extension" else
            f"from fleetx.ps import kernels as k; k.set_backend({backend!r})")
    return f"""
        import numpy as np
        {pick}
        f, i = k.index_find, k.index_insert
        keys, out = np.array([99], np.int64), np.empty(1, np.int64)
        full = np.empty(8, np.int64); full[0::2] = full[1::2] = np.arange(4)
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
    out = np.empty(4, np.int64)
    assert kernels.index_find(full_slots(), np.array([3, 0, 2, 1]), out) == 0
    assert out.tolist() == [3, 0, 2, 1]


@pytest.mark.parametrize("args, error", [
    ((np.zeros(6, np.int64), np.zeros(1, np.int64), np.zeros(1, np.int64)),
     "index_find: slots must hold 2 \\* capacity int64 entries with the capacity a power of two "
     ">= 1; got 6 entries"),
    ((np.full(7, -1, np.int64), np.zeros(1, np.int64), np.zeros(1, np.int64)), "got 7 entries"),
    ((np.full(8, -1, np.int64), np.zeros(3, np.int64), np.zeros(2, np.int64)),
     "index_find: out holds 2 rows, fewer than the 3 keys"),
])
def test_find_preconditions_are_named(backend, args, error):
    with pytest.raises(ValueError, match=error):
        kernels.index_find(*args)


def test_wrong_dtypes_are_named(backend):
    with pytest.raises(TypeError, match="index_find: keys must be a contiguous 1-D int64 array; "
                                        "got int32 of shape \\(2,\\)"):
        kernels.index_find(np.full(8, -1, np.int64), np.zeros(2, np.int32), np.zeros(2, np.int64))


def test_insert_without_room_writes_nothing(backend):
    slots, row_keys = np.full(8, -1, np.int64), np.full(2, 7, np.int64)
    with pytest.raises(ValueError, match="index_insert: not enough room for 3 keys from row 0 "
                                         "\\(row_keys holds 2, the slots 4\\)"):
        kernels.index_insert(slots, row_keys, np.arange(3), np.empty(3, np.int64), 0)
    assert (slots == -1).all() and (row_keys == 7).all()


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
