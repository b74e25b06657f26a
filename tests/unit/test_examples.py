"""The example configs in examples/ stay valid (the README points users at them)."""

from pathlib import Path

from listener.config import load_listener_config
from picker.config import config_warnings, load_settings

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_picker_examples_are_valid_without_warnings() -> None:
    files = sorted(EXAMPLES.glob("picker*.yaml"))
    assert len(files) >= 2
    for f in files:
        assert config_warnings(load_settings(f)) == [], f


def test_listener_example_is_valid() -> None:
    cfg = load_listener_config(EXAMPLES / "listener.yaml")
    assert [s.backend_name for s in cfg.sources] == ["vllm-0", "vllm-1"]
