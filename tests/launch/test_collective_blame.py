"""A rank that stops calling collectives while rank 0 waits: after FLEETX_TIMEOUT, rank 0's error
and fleetrun's ABORT line name the rank that did not arrive (not rank 0, the one that waited),
and list it as at fault rather than as stopped. Real fleetrun, 2 processes, a real sleep."""
from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest

from test_fleetrun import fleetrun_cmd  # tests/launch is on sys.path (rootdir-less layout)

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
_TIMEOUT = 5


def _hang(tmp_path: Path, mode: str):
    started = time.monotonic()
    res = subprocess.run(fleetrun_cmd("--nproc_per_node", "2", SCRIPTS / "collective_hang.py",
                                      mode),
                         cwd=tmp_path, capture_output=True, text=True, timeout=240,
                         env={**__import__("os").environ, "FLEETX_TIMEOUT": str(_TIMEOUT)})
    return res, time.monotonic() - started, (tmp_path / "log" / "workerlog.0").read_text()


@pytest.mark.parametrize("mode, where", [
    ("sleep", "all_reduce"),   # rank 0 waits in DDP's gradient all-reduce (C++, no Python frame)
    # rank 0 waits in fleet.util.all_reduce: the same report through another path (slow stage)
    pytest.param("util", "all_reduce", marks=pytest.mark.slow),
])
def test_the_rank_that_did_not_arrive_is_named(tmp_path, mode, where):
    res, took, log0 = _hang(tmp_path, mode)
    assert res.returncode == 1, res.stderr[-3000:]
    abort = next(line for line in res.stderr.splitlines() if line.startswith("ABORT!!!"))
    assert re.match(rf"ABORT!!! Out of all 2 trainers, the trainer process with rank=\[1\] was at "
                    rf"fault: rank 1 did not arrive at {where} #\d+ on group 0 \(ranks \[0, 1\]\) "
                    rf"within {_TIMEOUT} s; it is alive \(reported \d+\.\d s ago\), its latest "
                    rf"call: .* \(reported by rank 0\)\. Please check its log\.$", abort), abort
    # rank 1 is shown as at fault, with its log; it is not among the merely stopped ones
    assert "rank 1 (local rank 1, pid " in res.stderr and "was at fault and was stopped" in \
        res.stderr
    assert "stopped the other process(es)" not in res.stderr
    # rank 0's own error says the same
    assert re.search(rf"fleetx: rank 1 did not arrive at {where} #\d+ on group 0", log0), log0
    if mode == "util":
        assert "CommError: fleet.util.all_reduce failed: rank 1 did not arrive" in log0
    # found after the timeout, not much later (start-up of two torch processes included)
    assert took < _TIMEOUT + 120
