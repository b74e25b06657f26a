"""``StartupError`` is the picker's "cannot start" answer: ``kv-epp serve`` prints it as one ``error:`` line on
stderr, prints no ready line, and exits 2. The places that raise it (a busy port, refused TLS or exposure, an
unreadable admin token file) are tested where they are raised (test_lifecycle*.py, test_admin_token_file.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from picker.runtime import cli, compose
from picker.runtime.errors import StartupError


class RefusingServer:
    """Stands in for the built server: its start fails the way a busy port does."""

    def __init__(self, message: str) -> None:
        self.message = message

    async def start(self) -> None:
        raise StartupError(self.message)

    def install_signal_handlers(self) -> None:  # pragma: no cover - reached only if start succeeded
        raise AssertionError("a server that did not start must not be served")


def test_a_startup_error_is_one_error_line_and_exit_code_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "picker.yaml"
    config.write_text("pool: {backends: [{name: a, address: '10.0.0.1:80'}]}\n")
    monkeypatch.setenv("GRPC_VERBOSITY", "ERROR")  # serve sets it when unset: keep the test's environment
    message = "ext_proc 127.0.0.1:9002: Address already in use\n(is another picker running?)"
    monkeypatch.setattr(compose, "build_server", lambda settings, path=None: RefusingServer(message))
    assert cli.main(["serve", "--config", str(config)]) == 2
    out, err = capsys.readouterr()
    assert out == ""  # no ready line: a supervisor waiting for it sees the exit instead
    assert err == "error: ext_proc 127.0.0.1:9002: Address already in use (is another picker running?)\n"
