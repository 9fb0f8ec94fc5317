"""JSON and YAML strategy files: every error names the file and the line (and the column for a
malformed file), with the valid choices, as prototxt errors do; a failed load changes nothing."""
from __future__ import annotations

import pytest

from fleetx.strategy.distributed_strategy import DistributedStrategy


def load(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    s = DistributedStrategy()
    s.nccl_comm_num = 3
    loader = s.load_from_json if name.endswith(".json") else s.load_from_yaml
    with pytest.raises((TypeError, ValueError)) as err:
        loader(path)
    assert s.nccl_comm_num == 3  # all or nothing
    return type(err.value), str(err.value).replace(str(tmp_path) + "/", "")


def test_json_unknown_config_key_names_file_line_and_choices(tmp_path):
    kind, msg = load(tmp_path, "s.json", '{\n  "nccl_comm_num": 2,\n  "amp_configs": {\n'
                                        '    "incr_ratio": 3.0,\n    "decr_rate": 0.5\n  }\n}\n')
    assert kind is ValueError
    assert msg.startswith("s.json:5: unknown amp_configs key 'decr_rate' (did you mean "
                          "'decr_ratio'?); known: custom_black_list, ")


def test_json_unknown_field_names_file_and_line(tmp_path):
    kind, msg = load(tmp_path, "s.json", '{\n  "amp": true,\n  "ampp": true\n}\n')
    assert kind is TypeError
    assert msg.startswith("s.json:3: unknown DistributedStrategy attribute 'ampp' (did you mean "
                          "'amp'?); known: a_sync, ")


def test_json_bad_value_names_its_line(tmp_path):
    _, msg = load(tmp_path, "s.json", '{"amp": true,\n "lamb_configs": {"lamb_weight_decay": -1}}')
    assert msg == "s.json:2: lamb_configs['lamb_weight_decay'] must be >= 0, got -1.0"


def test_malformed_json_names_line_and_column(tmp_path):
    kind, msg = load(tmp_path, "s.json", '{\n  "amp": true,\n  "dgc": tru\n}\n')
    assert kind is ValueError
    assert msg == "s.json:3:10: not valid JSON: Expecting value"


def test_yaml_errors_name_file_and_line(tmp_path):
    pytest.importorskip("yaml")
    _, msg = load(tmp_path, "s.yaml", "amp: true\namp_configs:\n  incr_ratio: '2'\n")
    assert msg == "s.yaml:3: amp_configs['incr_ratio'] must be a float, got str '2'"
    kind, msg = load(tmp_path, "t.yaml", "amp: true\ngradient_merge_configs:\n  k_step: 2\n")
    assert kind is ValueError and msg.startswith(
        "t.yaml:3: unknown gradient_merge_configs key 'k_step' (did you mean 'k_steps'?)")
    kind, msg = load(tmp_path, "u.yaml", "amp: true\nrecomptue: true\n")
    assert kind is TypeError and msg.startswith(
        "u.yaml:2: unknown DistributedStrategy attribute 'recomptue' (did you mean 'recompute'?)")


def test_malformed_yaml_names_line_and_column(tmp_path):
    pytest.importorskip("yaml")
    kind, msg = load(tmp_path, "s.yaml", "amp: [1,\n  2\n")
    assert kind is ValueError
    assert msg.startswith("s.yaml:3:1: not valid YAML: expected ',' or ']'")


def test_a_file_that_is_not_a_mapping(tmp_path):
    kind, msg = load(tmp_path, "s.json", "[1, 2]")
    assert kind is TypeError and msg == "s.json: a strategy file holds a mapping of fields, got list"
