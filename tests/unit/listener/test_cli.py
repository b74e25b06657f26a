"""listener.cli: ``config validate`` and its alias ``check`` name every bad key's path and exit 2 (also through
``python -m listener.cli``), say so when given the picker's file, and ``--log-level`` goes before or after the
subcommand. ``run`` against real processes is in tests/integration/test_listener_lifecycle.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from listener import cli

GOOD = "sources:\n  - backend_name: e1\n    model: m\n    zmq_endpoint: tcp://127.0.0.1:5557\n"


def test_cli_refuses_bad_config_with_exit_2(tmp_path: Path) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text("sources:\n  - backend_name: vllm-0\n    model: m\n    zmq_endpoint: tcp://x:1\n    typo: 1\n")
    r = subprocess.run(
        [sys.executable, "-m", "listener.cli", "check", "--config", str(f)], capture_output=True, text=True
    )
    assert r.returncode == 2 and "sources[0].typo" in r.stderr


def test_cli_config_errors_name_the_path(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("sources:\n  - backend_name: 'bad name!'\n    model: m\n    zmq_endpoint: tcp://x:1\n    bogus: 1\n")
    r = subprocess.run(
        [sys.executable, "-m", "listener.cli", "check", "--config", str(bad)], capture_output=True, text=True
    )
    assert r.returncode == 2
    assert "sources[0].backend_name" in r.stderr and "sources[0].bogus" in r.stderr
    good = tmp_path / "good.yaml"
    good.write_text(GOOD)
    r = subprocess.run([sys.executable, "-m", "listener.cli", "check", "--config", str(good)], capture_output=True)
    assert r.returncode == 0


def test_config_validate_in_process(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(GOOD)
    assert cli.main(["config", "validate", str(good)]) == 0
    assert capsys.readouterr().out == f"ok: {good}\n"
    bad = tmp_path / "bad.yaml"
    bad.write_text("listen: nowhere\nlimits:\n  max_tracked_blocks: 0\n")
    assert cli.main(["--log-level", "DEBUG", "config", "validate", str(bad)]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert [line.split(": ")[:2] for line in errors] == [["error", "listen"], ["error", "limits.max_tracked_blocks"]]


def test_the_pickers_file_is_named_as_such(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    picker = tmp_path / "picker.yaml"
    picker.write_text(yaml.safe_dump({"selection_strategy": "RoundRobin", "pool": {"backends": []}}))
    assert cli.main(["check", "--config", str(picker)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "kv-epp" in line


def test_log_level_before_or_after_the_subcommand() -> None:
    parser = cli.build_parser()
    assert parser.parse_args(["--log-level", "DEBUG", "run", "--config", "f"]).log_level == "DEBUG"
    assert parser.parse_args(["run", "--config", "f", "--log-level", "WARNING"]).log_level == "WARNING"
    assert parser.parse_args(["run", "--config", "f"]).log_level == "INFO"
    with pytest.raises(SystemExit):
        parser.parse_args(["run"])  # --config is required


def test_run_with_a_bad_config_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("listen: nowhere\nlimits:\n  max_tracked_blocks: 0\n")
    assert cli.main(["run", "--config", str(bad)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: ") and "listen" in line and "limits.max_tracked_blocks" in line
