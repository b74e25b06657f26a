"""Builds a PickerServer from Settings: the pool, the router and, when enabled, the Tier 4 parts."""

from __future__ import annotations

from pathlib import Path

from picker.app import PickerApp
from picker.config import Settings
from picker.server import PickerServer


def build_server(settings: Settings, config_path: str | Path | None = None) -> PickerServer:
    app = PickerApp(settings, config_path=config_path)
    return PickerServer(app)
