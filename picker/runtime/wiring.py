"""Builds a PickerServer from Settings: the pool, the router and, when enabled, Tier 4."""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

from picker.config import Settings
from picker.kv.tier4 import Tier4
from picker.ops.metrics import PickerMetrics
from picker.runtime.app import PickerApp
from picker.runtime.lifecycle import PickerServer


class _DisabledKvAdmin:
    """The seed's KV-index admin answers when Tier 4 is off."""

    def admin_routes(self) -> list[web.RouteDef]:
        async def off(_: web.Request) -> web.Response:
            return web.json_response({"enabled": False})

        async def clear(_: web.Request) -> web.Response:
            return web.json_response({"success": False, "error": "KV cache index is not enabled"})

        return [
            web.get("/admin/kv-index/stats", off),
            web.get("/admin/kv-index/backends", off),
            web.post("/admin/kv-index/clear", clear),
        ]


def build_server(settings: Settings, config_path: str | Path | None = None) -> PickerServer:
    metrics = PickerMetrics()
    if not settings.kv_cache_index.enabled:
        app = PickerApp(settings, metrics, config_path)
        return PickerServer(app, admin_extra=[_DisabledKvAdmin()])
    # Tier 4 reads the live pool (load, health, tokenizer endpoints): build the app first, then attach.
    app = PickerApp(settings, metrics, config_path)
    tier4 = Tier4(settings.kv_cache_index, app.pool, metrics)
    attach_tier4(app, tier4)
    server = PickerServer(app, admin_extra=[tier4])
    server.background.append(tier4.run)
    server.on_stop.append(tier4.close)
    return server


def attach_tier4(app: PickerApp, tier4: Tier4) -> None:
    """Make ``tier4`` the router's scorer and the app's block-key source (decision counters shared)."""
    app.router.scorer = tier4
    tier4.decisions = app.router.kv_decisions
    app.block_key_source = tier4.block_keys_for


__all__ = ["attach_tier4", "build_server"]
