"""Markers by directory: every test under tests/integration is ``integration``, every test under
tests/e2e is ``e2e`` (so ``make unit`` can deselect them), every test under tests/engines is ``engines`` (real
vLLM: ``make test-engines``; ``make test`` leaves that directory out); ``envoy`` and ``valkey`` are set per test."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
BY_DIRECTORY = {HERE / "integration": "integration", HERE / "e2e": "e2e", HERE / "engines": "engines"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        path = Path(str(item.path)).resolve()
        for directory, marker in BY_DIRECTORY.items():
            if path.is_relative_to(directory):
                item.add_marker(getattr(pytest.mark, marker))
