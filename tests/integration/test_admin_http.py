"""Admin HTTP in-process: auth, readiness, metric names, the seed's JSON shapes."""

from __future__ import annotations

from aiohttp.test_utils import TestClient, TestServer

from picker.facts import RequestFacts
from picker.runtime.admin import build_admin_app
from picker.runtime.app import PickerApp
from tests.support.builders import app_of


def make_app(**extra) -> PickerApp:
    return app_of(
        {
            "selection_strategy": "PrefixAwareHash",
            "prefix_routing": {"enabled": True},
            "pool": {"backends": [{"name": "a", "address": "10.0.0.1:80"}, {"name": "b", "address": "10.0.0.2:80"}]},
            **extra,
        }
    )


async def client_for(app: PickerApp) -> TestClient:
    client = TestClient(TestServer(build_admin_app(app)))
    await client.start_server()
    return client


async def test_bearer_token_guards_admin_only() -> None:
    app = make_app(admin={"bearer_token": "s3cret"})
    client = await client_for(app)
    try:
        assert (await client.get("/admin/prefix-routing/stats")).status == 401
        assert (await client.get("/admin/prefix-routing/stats", headers={"Authorization": "Bearer nope"})).status == 401
        ok = await client.get("/admin/prefix-routing/stats", headers={"Authorization": "Bearer s3cret"})
        assert ok.status == 200
        assert (await client.get("/metrics")).status == 200  # scraping needs no token
        assert (await client.get("/healthz")).status == 200
    finally:
        await client.close()


async def test_readiness_follows_lifecycle() -> None:
    app = make_app()
    client = await client_for(app)
    try:
        assert (await client.get("/readyz")).status == 503
        app.ready = True
        assert (await client.get("/readyz")).status == 200
        app.draining = True
        r = await client.get("/readyz")
        body = await r.json()
        assert r.status == 503 and body["status"] == "not_ready" and body["reason"] == "draining"
    finally:
        await client.close()


async def test_prefix_routing_stats_shape_and_metrics() -> None:
    app = make_app()
    for i in range(5):
        facts = RequestFacts(api="chat", model="m", system=f"s{i % 2}")
        prepared = await app.path.prepare(facts)
        d = app.path.decide(facts, prepared, None)
        assert d is not None
        app.path.commit(facts, d, prepared)  # takes the in-flight slot and counts the decision
    client = await client_for(app)
    try:
        body = await (await client.get("/admin/prefix-routing/stats")).json()
        assert set(body) == {"enabled", "config", "routing_decisions", "backend_distribution", "unique_prefixes"}
        assert body["routing_decisions"]["total"] == 5 and body["unique_prefixes"] == 2
        assert body["routing_decisions"]["overflow_rate"] == f"{body['routing_decisions']['overflow'] / 5:.4f}"
        assert sum(d["in_flight_requests"] for d in body["backend_distribution"]) == 5
        text = await (await client.get("/metrics")).text()
        assert "continuum_prefix_routing_requests_total" in text
        assert 'continuum_prefix_routing_backend_distribution{backend="a"}' in text
        kv = await (await client.get("/admin/kv-index/stats")).json()
        assert kv == {"enabled": False}
        clear = await (await client.post("/admin/kv-index/clear", headers={"Content-Type": "application/json"})).json()
        assert clear["success"] is False
    finally:
        await client.close()
