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
    assert env.get("MASTER_ADDR", env=e) is None and not env.is_set("MASTER_ADDR", env=e)
    assert env.get_int("WORLD_SIZE", env=e) is None
    assert env.snapshot(e) == {"RANK": " 3 ", "PADDLE_TRAINER_ENDPOINTS": "a:1, b:2,,"}


def test_errors_name_the_variable():
    with pytest.raises(env.EnvError, match="environment variable RANK='two' is not an integer"):
        env.get_int("RANK", env={"RANK": "two"})
    with pytest.raises(KeyError, match="NOT_A_VAR is not part of the fleetx environment contract"):
        env.get("NOT_A_VAR")


def test_a_time_limit_is_seconds_or_zero_for_none():
    assert env.get_limit("FLEETX_TIMEOUT", env={}) == 300.0
    assert env.get_limit("FLEETX_TIMEOUT", env={"FLEETX_TIMEOUT": "2.5"}) == 2.5
    assert env.get_limit("FLEETX_TIMEOUT", env={"FLEETX_TIMEOUT": "0"}) is None
    for bad in ("-1", "nan", "inf"):
        with pytest.raises(env.EnvError, match=rf"environment variable FLEETX_TIMEOUT='{bad}': "
                                               r"expected 0 \(no limit\) or a number of "
                                               r"seconds > 0"):
            env.get_limit("FLEETX_TIMEOUT", env={"FLEETX_TIMEOUT": bad})


def test_apply_writes_only_contract_variables():
    target = {}
    env.apply({"RANK": 1}, target)
    assert target == {"RANK": "1"}
    with pytest.raises(KeyError):
        env.apply({"BOGUS": "1"}, target)


def test_an_unset_variable_reads_as_its_declared_default():
    assert env.get_int("TORCHELASTIC_RESTART_COUNT", env={}) == 0
    assert env.get_float("FLEETX_TIMEOUT", env={}) == 300.0  # an int variable read as a number
    assert env.get("FLEETX_PS_TRANSPORT", env={" ": ""}) == "tcp"
    assert env.get("FLEETX_PS_TRANSPORT", env={"FLEETX_PS_TRANSPORT": " "}) == "tcp"
    assert env.get("FLEETX_TIMEOUT", env={}) == "300" and env.default("FLEETX_TIMEOUT") == 300
    assert env.get_float("FLEETX_PS_CHECKPOINT_INTERVAL", env={}) == 30.0
    assert env.get_list("PADDLE_PSERVERS_IP_PORT_LIST", env={}) == []


def test_a_reader_takes_no_default_of_its_own():
    with pytest.raises(TypeError):
        env.get_int("TORCHELASTIC_RESTART_COUNT", 0)  # noqa: the default is declared in env.py
    with pytest.raises(TypeError):
        env.get("MASTER_ADDR", "127.0.0.1")


def test_the_reader_must_fit_the_declared_type():
    with pytest.raises(TypeError, match="FLEETX_PS_TRANSPORT is declared as str in fleetx/env.py; "
                                        "read it with env.get"):
        env.get_int("FLEETX_PS_TRANSPORT", env={})
    with pytest.raises(TypeError, match="PADDLE_TRAINER_ENDPOINTS is declared as list"):
        env.get_float("PADDLE_TRAINER_ENDPOINTS", env={})
    with pytest.raises(TypeError, match="FLEETX_LOG_INTERVAL is declared as float"):
        env.get_int("FLEETX_LOG_INTERVAL", env={})
    with pytest.raises(KeyError, match="NOT_A_VAR is not part of the fleetx environment contract"):
        env.default("NOT_A_VAR")


def test_every_default_is_of_its_declared_type():
    for var in env.VARIABLES.values():
        assert var.kind in env.KINDS, var.name
        assert var.default is None or type(var.default) is var.kind, var.name
    with pytest.raises(TypeError, match="X: default '300' is not a int"):
        env.EnvVar("X", "m", "w", "r", kind=int, default="300")
    with pytest.raises(TypeError, match="X: kind <class 'bool'> is not one of"):
        env.EnvVar("X", "m", "w", "r", kind=bool)


def test_the_timeout_is_whole_seconds_above_0():
    assert env.timeout({}) == 300.0 and env.timeout({"FLEETX_TIMEOUT": "42"}) == 42.0
    with pytest.raises(env.EnvError, match="FLEETX_TIMEOUT=0 must be > 0 seconds"):
        env.timeout({"FLEETX_TIMEOUT": "0"})
    with pytest.raises(env.EnvError, match="FLEETX_TIMEOUT='2.5' is not an integer"):
        env.timeout({"FLEETX_TIMEOUT": "2.5"})


def test_the_doc_table_shows_each_type_and_default():
    rows = {line.split(" | ")[0]: line for line in env.markdown_table().splitlines()}
    assert rows["| `FLEETX_TIMEOUT`"].startswith("| `FLEETX_TIMEOUT` | int | `300` | ")
    assert rows["| `FLEETX_PS_TRANSPORT`"].startswith("| `FLEETX_PS_TRANSPORT` | text | `tcp` | ")
    assert rows["| `MASTER_ADDR`"].startswith("| `MASTER_ADDR` | text | — | ")
    assert rows["| `FLEETX_PS_JOB_ID`"].startswith("| `FLEETX_PS_JOB_ID` | text | empty | ")
