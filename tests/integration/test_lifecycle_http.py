"""The picker follows a discovered pool: config (sources, env, template), snapshot application (pool, ring,
metrics, recorder, placements, KV index, feeds), readiness gating routing only (an unready backend is on standby:
not routed to, its feed and index entries kept), static reloads beside it, and the discovery task.

Here the tests that start a server or bind a socket; the rest, in process:
tests/unit/picker/runtime/test_lifecycle.py."""

from __future__ import annotations

import asyncio

from aiohttp.test_utils import TestClient, TestServer

from picker.runtime.admin import build_admin_app
from picker.runtime.compose import build_app
from picker.runtime.lifecycle import PickerServer
from tests.support.discovered_pool import FakeDiscovery, discovered_settings, snap
from tests.support.poll import async_wait_until

# -- config -------------------------------------------------------------------------------------------------


# -- applying snapshots ---------------------------------------------------------------------------------------


# -- readiness gates routing only -------------------------------------------------------------------------------


# -- the discovery task --------------------------------------------------------------------------------------


async def test_discovery_runs_supervised_and_admin_shows_it() -> None:
    settings = discovered_settings(
        extproc={"host": "127.0.0.1", "port": 0, "health_port": None, "tls": {"mode": "plaintext"}},
        admin={"port": 0},
    )
    discovery = FakeDiscovery()
    app = build_app(settings, discovery=discovery)
    server = PickerServer(app)
    await server.start()
    client = TestClient(TestServer(build_admin_app(app)))
    await client.start_server()
    try:
        assert "pool-discovery" in server.supervisor.names
        await asyncio.wait_for(discovery.ready.wait(), 30)
        r = await client.get("/readyz")
        body = await r.json()
        assert r.status == 503 and body["pool"] == {"source": "inference_pool", "synced": False, "backends": 0}
        assert "pool not synced" in body["reason"]
        discovery.push(snap(("p-a", "10.0.0.1:8000")))
        r = await client.get("/readyz")
        assert r.status == 200 and (await r.json())["pool"]["synced"] is True
        pool = await (await client.get("/admin/pool")).json()
        assert pool["discovery"] == {"source": "fake", "synced": True}
        assert [b["backend"] for b in pool["backends"]] == ["p-a"] and pool["pool"]["synced"] is True
        app.metrics.discovery_event("watch_event")
        text = await (await client.get("/metrics")).text()
        for line in (
            'continuum_picker_discovery_events_total{event="watch_event"} 1.0',
            "continuum_picker_pool_backends 1.0",
            "continuum_picker_pool_synced 1.0",
        ):
            assert line in text
        await async_wait_until(lambda: app.metrics.ready._value.get() == 1, timeout=30, what="ready gauge")
    finally:
        await client.close()
        await server.stop()
