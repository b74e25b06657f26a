"""Regression (issue 7): hostile config files and malformed KV_EPP_* values gave a traceback.

Each must give "error: <path>: <message>" on stderr and exit 2, from `kv-epp serve`, `kv-epp config
validate`, `kv-listener check` and `kv-listener run` alike (they share read_yaml_mapping).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from listener.cli import main as listener_main
from picker.runtime.cli import main as picker_main
from picker.shared.config_files import ConfigError, read_yaml_mapping

HOSTILE: dict[str, bytes] = {
    "non_utf8": b"prefix_routing:\n  enabled: true\n\xff\xfe\x00garbage\n",
    "deep_flow": b"a: " + b"[" * 5000 + b"]" * 5000 + b"\n",
    "deep_block": b"a:\n" + b"".join(b"  " * (i + 1) + b"k:\n" for i in range(5000)),
    "integer_key": b"1: x\n",
    "nested_integer_key": b"prefix_routing:\n  2: x\n",
    "duplicate_key": b"prefix_routing:\n  enabled: true\n  virtual_nodes: 10\n  enabled: false\n",
    "duplicate_section": b"pool: {}\nadmin: {}\npool: {}\n",
    "control_character": b'selection_strategy: "\x01"\n',
}


@pytest.fixture(params=sorted(HOSTILE))
def hostile_file(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    f = tmp_path / f"{request.param}.yaml"
    f.write_bytes(HOSTILE[request.param])
    return f


def assert_one_clean_error(err: str, path: str) -> None:
    """`error: <path>: <message>` first (serve may prefix the config file's name), no traceback."""
    lines = err.strip().splitlines()
    assert lines and lines[0].startswith("error: ") and f" {path}: " in lines[0], err
    assert "Traceback" not in err


def test_read_yaml_mapping_refuses_hostile_files(hostile_file: Path) -> None:
    with pytest.raises(ConfigError) as exc:
        read_yaml_mapping(hostile_file)
    ((path, message),) = exc.value.problems
    assert path == str(hostile_file) and message


@pytest.mark.parametrize("command", ["validate", "serve"])
def test_picker_cli_refuses_hostile_files_with_exit_2(
    command: str, hostile_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = (
        ["config", "validate", str(hostile_file)] if command == "validate" else ["serve", "--config", str(hostile_file)]
    )
    assert picker_main(argv) == 2
    assert_one_clean_error(capsys.readouterr().err, str(hostile_file))


@pytest.mark.parametrize("command", ["check", "run"])
def test_listener_cli_refuses_hostile_files_with_exit_2(
    command: str, hostile_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert listener_main([command, "--config", str(hostile_file)]) == 2
    assert_one_clean_error(capsys.readouterr().err, str(hostile_file))


def test_duplicate_keys_name_the_key_and_both_lines(tmp_path: Path) -> None:
    f = tmp_path / "dup.yaml"
    f.write_bytes(HOSTILE["duplicate_key"])
    with pytest.raises(ConfigError) as exc:
        read_yaml_mapping(f)
    message = exc.value.problems[0][1]
    assert "duplicate key 'enabled'" in message and "first on line 2" in message and "line 4" in message


def test_yaml_merge_keys_may_be_overridden(tmp_path: Path) -> None:
    """`<<: *anchor` then an explicit key is an override, not a duplicate."""
    f = tmp_path / "merge.yaml"
    f.write_text("base: &b {enabled: true, virtual_nodes: 10}\nprefix_routing:\n  <<: *b\n  enabled: false\n")
    assert read_yaml_mapping(f)["prefix_routing"] == {"enabled": False, "virtual_nodes": 10}


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("KV_EPP_POOL__BACKENDS", "notjson"),
        ("KV_EPP_PREFIX_ROUTING", "{"),
        ("KV_EPP_POOL__HEALTH", "[1"),
        ("KV_EPP_PREFIX_ROUTING", "[" * 5000 + "]" * 5000),
    ],
)
@pytest.mark.parametrize("command", ["validate", "serve"])
def test_malformed_environment_value_names_the_variable(
    command: str,
    name: str,
    value: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    f = tmp_path / "ok.yaml"
    f.write_text("selection_strategy: RoundRobin\n")
    monkeypatch.setenv(name, value)
    argv = ["config", "validate", str(f)] if command == "validate" else ["serve", "--config", str(f)]
    assert picker_main(argv) == 2
    assert_one_clean_error(capsys.readouterr().err, name)


def test_real_entry_point_prints_no_traceback(tmp_path: Path) -> None:
    """The console script as a process: one line on stderr, exit 2 (no logging set-up noise either)."""
    f = tmp_path / "dup.yaml"
    f.write_bytes(HOSTILE["duplicate_key"])
    r = subprocess.run(
        [sys.executable, "-m", "picker", "serve", "--config", str(f)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2
    assert r.stderr.startswith("error: ") and "duplicate key 'enabled'" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_alias_bomb_is_refused(tmp_path: Path) -> None:
    """A "billion laughs" file: twelve lines, 10**11 leaves for anything that walks the loaded data."""
    lines = ['a0: &a0 ["lol"]'] + [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 12)]
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError) as info:
        read_yaml_mapping(bomb)
    assert "more than 100 aliases" in str(info.value)
    few = tmp_path / "few.yaml"
    few.write_text("d: &d {enabled: true}\nprefix_routing:\n  <<: *d\n")
    assert read_yaml_mapping(few)["prefix_routing"] == {"enabled": True}
