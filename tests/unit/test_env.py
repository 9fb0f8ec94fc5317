"""The environment contract: typed readers with named errors, and the doc that lists it."""
from pathlib import Path

import pytest

from fleetx import env

DOC = Path(__file__).resolve().parents[2] / "docs" / "environment.md"


def test_doc_lists_every_variable():
    text = DOC.read_text()
    missing = [name for name in env.VARIABLES if f"`{name}`" not in text]
    assert not missing, f"docs/environment.md does not list {missing}"
    assert env.markdown_table() in text, "docs/environment.md is out of date with fleetx/env.py"


def test_readers():
    e = {"RANK": " 3 ", "PADDLE_TRAINER_ENDPOINTS": "a:1, b:2,,", "MASTER_ADDR": ""}
    assert env.get_int("RANK", env=e) == 3
    assert env.get_list("PADDLE_TRAINER_ENDPOINTS", env=e) == ["a:1", "b:2"]
    assert env.get("MASTER_ADDR", "x", env=e) == "x" and not env.is_set("MASTER_ADDR", env=e)
    assert env.get_int("WORLD_SIZE", 7, env=e) == 7
    assert env.snapshot(e) == {"RANK": " 3 ", "PADDLE_TRAINER_ENDPOINTS": "a:1, b:2,,"}


def test_errors_name_the_variable():
    with pytest.raises(env.EnvError, match="environment variable RANK='two' is not an integer"):
        env.get_int("RANK", env={"RANK": "two"})
    with pytest.raises(KeyError, match="NOT_A_VAR is not part of the fleetx environment contract"):
        env.get("NOT_A_VAR")


def test_a_time_limit_is_seconds_or_zero_for_none():
    assert env.get_limit("FLEETX_TIMEOUT", 300.0, {}) == 300.0
    assert env.get_limit("FLEETX_TIMEOUT", 300.0, {"FLEETX_TIMEOUT": "2.5"}) == 2.5
    assert env.get_limit("FLEETX_TIMEOUT", 300.0, {"FLEETX_TIMEOUT": "0"}) is None
    for bad in ("-1", "nan", "inf"):
        with pytest.raises(env.EnvError, match=rf"environment variable FLEETX_TIMEOUT='{bad}': "
                                               r"expected 0 \(no limit\) or a number of "
                                               r"seconds > 0"):
            env.get_limit("FLEETX_TIMEOUT", 300.0, {"FLEETX_TIMEOUT": bad})


def test_apply_writes_only_contract_variables():
    target = {}
    env.apply({"RANK": 1}, target)
    assert target == {"RANK": "1"}
    with pytest.raises(KeyError):
        env.apply({"BOGUS": "1"}, target)
