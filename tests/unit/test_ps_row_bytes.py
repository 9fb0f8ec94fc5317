"""The bytes per row that docs/ps_tables.md §4 quotes (its table, parsed here) are what the
memory report (``fleet.table_stats()``) says a table holds, at dim 16, for each rule and each
kind of accessor, at both ends of the index's load (0.6 and 0.8)."""
import re
from pathlib import Path

import numpy as np
import pytest

from fleetx.ps.api import AccessorConfig, InitConfig, RuleConfig, ShowClickEntry, SparseTableSpec
from fleetx.ps.rules import make_rule
from fleetx.ps.shard import table_report
from fleetx.ps.table import SparseTable
from fleetx.ps_torch.table_ops import merge_reports

DOC = Path(__file__).resolve().parents[2] / "docs" / "ps_tables.md"
RULES = {"SGD": "sgd", "Adagrad": "adagrad", "Adam": "adam"}
KINDS = {"no accessor": {}, "with eviction": {"accessor": AccessorConfig()},
         "with show/click": {"entry": ShowClickEntry()}}


def documented() -> dict:
    """{(rule, column): (low, high) or value} from the table of §4."""
    text = DOC.read_text()
    section = text[text.index("## 4. Bytes of server memory per row"):]
    lines = [ln for ln in section.splitlines() if ln.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    out = {}
    for ln in lines[2:]:
        cells = [c.strip() for c in ln.strip("|").split("|")]
        for col, cell in zip(header[1:], cells[1:]):
            nums = [float(x) for x in re.findall(r"[\d.]+", cell)]
            out[RULES[cells[0]], col] = tuple(nums)
    return out


def report(table) -> dict:
    return merge_reports([{"server": 0, "tables": {"t": table_report(table)}}])["tables"]["t"]


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("rule", list(RULES.values()))
def test_the_documented_bytes_per_row_are_what_table_stats_reports(rule, kind):
    doc = documented()
    spec = SparseTableSpec("t", 16, RuleConfig(rule), InitConfig("constant"), **KINDS[kind])
    t = SparseTable(spec, make_rule(spec.rule), capacity=16)
    t.pull(np.arange(60_000))  # one growth of the index to load 0.6: the most slots per row
    rep = report(t)
    assert (rep["row_bytes"],) == doc[rule, "raw (values)"]
    low, high = doc[rule, f"B/row, {kind}"] if kind == "no accessor" else doc[rule, kind]
    assert round(rep["bytes_per_row"], 1) == high
    assert doc[rule, "+ key + slots"] == (13, round(8 + 4 / 0.6, 1))
    t.pull(np.arange(60_000, 80_000))  # load 0.8, the last before the index grows: the fewest
    assert round(report(t)["bytes_per_row"], 1) == low
    t.changes.start(len(t))  # a saved table: one byte per row more
    assert round(report(t)["bytes_per_row"], 1) == low + 1
