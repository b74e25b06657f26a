"""`kv-epp config schema`: the JSON Schema generated from `Settings` (for a Helm values.schema.json)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from picker.config import settings_json_schema
from picker.runtime.cli import main as picker_main

jsonschema = pytest.importorskip("jsonschema")

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
PICKER_EXAMPLES = sorted(p for p in EXAMPLES.glob("picker*.yaml"))


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    return settings_json_schema()


def test_cli_prints_a_valid_draft7_schema(capsys: pytest.CaptureFixture[str]) -> None:
    assert picker_main(["config", "schema"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == settings_json_schema()
    assert printed["$schema"] == "http://json-schema.org/draft-07/schema#"
    jsonschema.Draft7Validator.check_schema(printed)


def test_schema_carries_the_defaults_of_settings(schema: dict[str, Any]) -> None:
    pr = schema["definitions"]["PrefixRoutingConfig"]["properties"]
    assert pr["virtual_nodes"]["default"] == 150 and pr["load_factor_epsilon"]["maximum"] == 10.0
    assert schema["properties"]["selection_strategy"]["default"] == "RoundRobin"


@pytest.mark.parametrize("example", PICKER_EXAMPLES, ids=lambda p: p.name)
def test_schema_accepts_the_example_configs(schema: dict[str, Any], example: Path) -> None:
    jsonschema.Draft7Validator(schema).validate(yaml.safe_load(example.read_text()))


def test_there_are_picker_examples() -> None:
    assert len(PICKER_EXAMPLES) >= 2


@pytest.mark.parametrize(
    "bad",
    [
        {"prefix_routing": {"virtual_nodes": 0}},
        {"prefix_routing": {"typo_key": 1}},
        {"selection_strategy": "Fastest"},
        {"unknown_section": {}},
        {"pool": {"backends": [{"name": "bad name!", "address": "1.2.3.4:5"}]}},
        {"pool": {"backends": [{"address": "1.2.3.4:5"}]}},
        {"kv_cache_index": {"backend": "etcd"}},
        {"admin": {"port": "ninety"}},
    ],
)
def test_schema_refuses_bad_configs(schema: dict[str, Any], bad: dict[str, Any]) -> None:
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(schema).validate(bad)
