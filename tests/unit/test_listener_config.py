import subprocess
import sys
from pathlib import Path

import pytest

from listener.config import ListenerConfigError, load_listener_config, parse_listener_config

SOURCE = {"backend_name": "vllm-0", "model": "m", "zmq_endpoint": "tcp://127.0.0.1:5557"}


@pytest.mark.parametrize(
    ("data", "path"),
    [
        ({"sources": [{**SOURCE, "backend_name": "bad name"}]}, "sources[0].backend_name"),
        ({"sources": [{**SOURCE, "bogus": 1}]}, "sources[0].bogus"),
        ({"sources": [{**SOURCE, "engine": "tgi"}]}, "sources[0].engine"),
        ({"sources": [{**SOURCE, "zmq_endpoint": None}]}, "sources[0]"),
        ({"sources": [{**SOURCE, "engine": "trtllm"}]}, "sources[0]"),
        ({"limits": {"max_tracked_blocks": 0}}, "limits.max_tracked_blocks"),
    ],
)
def test_bad_keys_name_their_path(data: dict, path: str) -> None:
    with pytest.raises(ListenerConfigError) as exc:
        parse_listener_config(data)
    assert path in [p for p, _ in exc.value.problems], exc.value.problems


def test_unreadable_and_non_mapping_files(tmp_path: Path) -> None:
    with pytest.raises(ListenerConfigError):
        load_listener_config(tmp_path / "missing.yaml")
    f = tmp_path / "list.yaml"
    f.write_text("- a\n- b\n")
    with pytest.raises(ListenerConfigError) as exc:
        load_listener_config(f)
    assert exc.value.problems[0][0] == "<root>"


def test_cli_refuses_bad_config_with_exit_2(tmp_path: Path) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text("sources:\n  - backend_name: vllm-0\n    model: m\n    zmq_endpoint: tcp://x:1\n    typo: 1\n")
    r = subprocess.run(
        [sys.executable, "-m", "listener.cli", "check", "--config", str(f)], capture_output=True, text=True
    )
    assert r.returncode == 2 and "sources[0].typo" in r.stderr
