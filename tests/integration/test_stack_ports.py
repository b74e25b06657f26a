"""``benchmarks.stack.start_picker`` when a port it chose is taken before the picker binds it (another process
took it in between, the race ``free_port`` cannot close): the picker starts again on new ports; a port the
caller gave is not replaced."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks import stack


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


def test_a_chosen_port_taken_meanwhile_is_chosen_again(
    taken_port: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = stack.free_port
    handed = iter([real(), taken_port])  # the first picker's extproc port, then its admin port: taken

    def free_port() -> int:
        return next(handed, None) or real()

    monkeypatch.setattr(stack, "free_port", free_port)
    config = {"pool": {"backends": [{"name": "b0", "address": "127.0.0.1:9"}]}}
    picker = stack.start_picker(config, tmp_path)
    try:
        assert picker.admin_port != taken_port
    finally:
        picker.stop()
    with pytest.raises(RuntimeError, match="Address already in use"):
        stack.start_picker({**config, "admin": {"port": taken_port}}, tmp_path, name="given")
