"""Readiness that means something: started, not draining, no crashed task, the pool synced, and with Tier 4 every
live backend's feed caught up or stale; published to /readyz, the gRPC readiness services and a gauge when an
input changes (or a feed's grace ends), while ``kv-epp.accepting`` keeps its meaning.

Here the tests that start a server or bind a socket; the rest, in process:
tests/unit/picker/runtime/test_lifecycle_readiness.py."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from aiohttp.test_utils import TestClient, TestServer
from grpc_health.v1 import health_pb2, health_pb2_grpc

from picker.config import parse_settings
from picker.runtime.admin import build_admin_app
from picker.runtime.compose import build_app
from picker.runtime.lifecycle import PickerServer
from tests.support.builders import app_of
from tests.support.discovered_pool import POOL, TEMPLATE, FakeDiscovery, discovered_settings, snap
from tests.support.poll import async_wait_until

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
PLAINTEXT = {"host": "127.0.0.1", "port": 0, "health_port": None, "tls": {"mode": "plaintext"}}


# -- the feed consumer knows when it has caught up ------------------------------------------------------------


# -- readiness transitions -------------------------------------------------------------------------------


# -- publication -----------------------------------------------------------------------------------------


async def health_of(port: int, service: str) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        return int((await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)).status)


async def test_grpc_readiness_follows_the_pool_sync_accepting_does_not() -> None:
    discovery = FakeDiscovery()
    app = build_app(discovered_settings(extproc=PLAINTEXT, admin={"port": 0}), discovery=discovery)
    server = PickerServer(app)
    await server.start()
    try:
        port = server.extproc_port
        assert await health_of(port, "readiness") == NOT_SERVING
        assert await health_of(port, "inference-extension") == NOT_SERVING
        assert await health_of(port, "kv-epp.accepting") == SERVING  # Envoy keeps sending streams
        assert await health_of(port, "liveness") == SERVING
        await asyncio.wait_for(discovery.ready.wait(), 30)
        discovery.push(snap(("p-a", "10.0.0.1:8000")))

        async def serving() -> bool:
            return await health_of(port, "readiness") == SERVING

        await async_wait_until(serving, timeout=30, what="readiness SERVING after the first snapshot")
        assert app.metrics.ready._value.get() == 1
    finally:
        await server.stop()


async def test_the_grace_ends_the_wait_without_any_other_event() -> None:
    """A feed that never connects: readiness turns SERVING when its grace ends (a timer, not a poll)."""
    settings = parse_settings(
        {
            "prefix_routing": {"enabled": True},
            "pool": {**POOL, "engine_metrics": {"enabled": False}},
            "kv_cache_index": {
                "enabled": True,
                "event_source_template": TEMPLATE,
                "tokenizer": {"source": "none"},
                "checks": {"self_check": False, "ready_grace_seconds": 0.5},
            },
            "extproc": PLAINTEXT,
            "admin": {"port": 0},
        }
    )
    discovery = FakeDiscovery()
    app = build_app(settings, discovery=discovery)
    server = PickerServer(app)
    assert app.tier4 is not None
    server.background.append(app.tier4.run)
    await server.start()
    client = TestClient(TestServer(build_admin_app(app)))
    await client.start_server()
    try:
        await asyncio.wait_for(discovery.ready.wait(), 30)
        discovery.push(snap(("p-a", "10.0.0.1:8000")))
        pushed = time.monotonic()
        r = await client.get("/readyz")
        body = await r.json()
        assert r.status == 503 and body["feeds"] == {"p-a": "connecting"} and "p-a" in body["reason"]

        async def serving() -> bool:
            return await health_of(server.extproc_port, "readiness") == SERVING

        await async_wait_until(serving, timeout=30, what="readiness SERVING once the grace ended")
        assert time.monotonic() - pushed >= 0.5  # not before the grace
        r = await client.get("/readyz")
        body = await r.json()
        assert r.status == 200 and body["feeds"] == {"p-a": "stale"} and "kv_feeds" in body
    finally:
        await client.close()
        await server.stop()


@pytest.mark.parametrize("until", ["drain", "refusing"])
async def test_accepting_turns_off_at_the_drain_or_only_when_streams_are_refused(until: str) -> None:
    """A sidecar's Envoy has one picker: with accepting_until "refusing" its health check keeps it in the cluster
    through the propagation (the picker still admits streams then), instead of failing closed with 500s."""
    extproc = {**PLAINTEXT, "drain_propagation_seconds": 60, "accepting_until": until}
    app = app_of({"extproc": extproc, "admin": {"port": 0}})
    server = PickerServer(app)
    await server.start()
    try:
        port = server.extproc_port
        assert await health_of(port, "kv-epp.accepting") == SERVING
        drain = asyncio.create_task(server.drain_and_stop())

        async def not_ready() -> bool:
            return await health_of(port, "readiness") == NOT_SERVING

        await async_wait_until(not_ready, timeout=30, what="readiness off at the drain's start")
        assert server.servicer.admitting  # the propagation: streams are still admitted
        expected = NOT_SERVING if until == "drain" else SERVING
        assert await health_of(port, "kv-epp.accepting") == expected
        if until == "refusing":  # what the drain sets once its propagation ends: now Envoy's health check is told
            server._refusing = True
            await server._publish_readiness()
            assert await health_of(port, "kv-epp.accepting") == NOT_SERVING
        server._hurry.set()  # a second signal: skip the remaining waits
        await asyncio.wait_for(drain, 30)
    finally:
        await server.stop()


async def test_each_supervised_task_s_failure_series_exists_at_zero_from_its_start() -> None:
    """An alert on increase(...[10m]) > 0 must see the first crash: a series born at 1 shows no increase."""
    app = app_of({"extproc": PLAINTEXT, "admin": {"port": 0}})
    server = PickerServer(app)
    await server.start()
    try:
        value = app.metrics.registry.get_sample_value
        assert value("continuum_picker_background_task_failures_total", {"task": "readiness"}) == 0.0
    finally:
        await server.stop()
