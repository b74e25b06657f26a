"""Regression (issue 7): after a hot reload removed a backend, /metrics kept exporting its series.

Here the tests that start a server or bind a socket; the rest, in process:
tests/unit/picker/ops/test_metrics.py."""

from __future__ import annotations

from aiohttp.test_utils import TestClient, TestServer

from picker.config import parse_settings
from picker.routing.endpoints import Decision, Endpoint
from picker.runtime.admin import build_admin_app
from picker.runtime.app import PickerApp
from picker.runtime.compose import build_app
from tests.support.metric_series import exercise

A = {"name": "a", "address": "10.0.0.1:80"}
B = {"name": "b", "address": "10.0.0.2:80"}
SOURCES = [
    {"backend_name": "a", "endpoint": "http://127.0.0.1:1/events/a"},
    {"backend_name": "b", "endpoint": "http://127.0.0.1:1/events/b"},
]


def settings(*backends: dict, **extra: object):
    return parse_settings({"pool": {"backends": list(backends)}, "kv_cache_index": {"event_sources": SOURCES}, **extra})


async def metrics_text(app: PickerApp) -> str:
    client = TestClient(TestServer(build_admin_app(app)))
    await client.start_server()
    try:
        return await (await client.get("/metrics")).text()
    finally:
        await client.close()


async def test_reload_removing_a_backend_removes_its_series() -> None:
    app = build_app(settings(A, B))
    for name in ("a", "b"):
        exercise(app.metrics, name, app.recorder)
    before = await metrics_text(app)
    for series in (
        'continuum_picker_backend_healthy{backend="b"}',
        'continuum_prefix_routing_backend_distribution{backend="b"}',
        'continuum_picker_decisions_total{backend="b",strategy="RoundRobin"}',
        'continuum_picker_backend_responses_total{backend="b",status_class="2xx"}',
    ):
        assert series in before

    app.apply(settings(A))

    after = await metrics_text(app)
    for family in (
        "continuum_picker_backend_healthy",
        "continuum_prefix_routing_backend_distribution",
        "continuum_picker_decisions_total",
        "continuum_picker_backend_responses_total",
    ):
        lines = "\n".join(line for line in after.splitlines() if line.startswith(family + "{"))
        assert 'backend="b"' not in lines and 'backend="a"' in lines, family
    # b's feed consumer still runs until a restart (kv_cache_index is restart-required): its feed series stay
    assert 'continuum_kv_consumer_connected{backend="b"} 1.0' in after


async def test_a_new_decision_after_forgetting_recreates_the_series() -> None:
    """The child() cache is cleared too: a cached child of a removed series would count into nothing."""
    app = build_app(settings(A, B))
    exercise(app.metrics, "b", app.recorder)
    app.apply(settings(A))
    app.apply(settings(A, B))
    app.recorder.decided(Decision(Endpoint("b", "b:1"), "RoundRobin", "round_robin"), None)
    assert 'continuum_picker_decisions_total{backend="b",strategy="RoundRobin"} 1.0' in await metrics_text(app)
