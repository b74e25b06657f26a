"""/admin/response-cache/* on the in-memory store (aiohttp TestClient, the admin token), and the accounting of
a cache hit: ``continuum_picker_requests_total{outcome="cache_hit"}`` and, through a real gRPC ext_proc stream,
``continuum_picker_route_seconds{outcome="cache_hit"}``.

Here the tests that start a server or bind a socket; the rest, in process:
tests/unit/picker/runtime/test_admin_routes.py."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from picker.cache.entry import CacheEntry
from picker.cache.state import SemanticPending
from picker.cache.store import MemoryCacheStore
from picker.extproc.messages import FULL_DUPLEX
from picker.facts import Answer
from picker.ops.metrics import ROUTE_OUTCOMES
from picker.request.exchange import Exchange
from picker.runtime.admin import build_admin_app
from picker.runtime.app import PickerApp
from tests.support.builders import route
from tests.support.cache_admin import TOKEN, make_app
from tests.support.extproc_grpc import exchange, request_body, request_headers, serve  # noqa: F401  (fixture)

AUTH = {"Authorization": f"Bearer {TOKEN}"}
JSON = {**AUTH, "Content-Type": "application/json"}


@pytest.fixture
async def client_of() -> AsyncIterator[Any]:
    clients: list[TestClient] = []

    async def start(app: PickerApp) -> TestClient:
        client = TestClient(TestServer(build_admin_app(app)))
        await client.start_server()
        clients.append(client)
        return client

    try:
        yield start
    finally:
        for c in clients:
            await c.close()


def chat(content: str = "hi", **fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": content}], "temperature": 0, **fields}


async def store_one(app: PickerApp, content: str) -> str:
    """An eligible miss routed and its response stored (as the observer sees it in full mode); its key."""
    ex = await route(app, chat(content))
    assert isinstance(ex, Exchange) and ex.cache.key is not None
    ex.cache.headers = ((":status", "200"), ("content-type", "application/json"))
    ex.response_headers(200)
    ex.response_body(b'{"choices":[{"message":{"content":"' + content.encode() + b'"},"finish_reason":"stop"}]}', True)
    await app.response_cache.flush()
    return ex.cache.key


async def store_with_semantic_copy(app: PickerApp, content: str, sem_key: str) -> str:
    """An eligible miss whose semantic path missed (its pending semantic entry set as the stage sets it): the
    response is stored under the exact key and under ``sem_key``, whose vector is indexed."""
    ex = await route(app, chat(content))
    assert isinstance(ex, Exchange) and ex.cache.key is not None
    ex.cache.semantic = SemanticPending("partition", (1.0, 0.0), sem_key)
    ex.cache.headers = ((":status", "200"), ("content-type", "application/json"))
    ex.response_headers(200)
    ex.response_body(b'{"choices":[{"message":{"content":"x"},"finish_reason":"stop"}]}', True)
    await app.response_cache.flush()
    return ex.cache.key


async def test_stats_follow_the_seed_shape_and_count_lookups(client_of: Any) -> None:
    app = make_app(ttl="30m", capacity=50)
    client = await client_of(app)
    empty = await (await client.get("/admin/response-cache/stats", headers=AUTH)).json()
    assert empty["requests"] == {"hit": 0, "miss": 0, "skip": 0, "total": 0} and empty["hit_rate"] == "0.0000"
    await store_one(app, "one")  # miss
    await store_one(app, "two")  # miss
    assert isinstance(await route(app, chat("one")), Answer)  # hit
    assert isinstance(await route(app, chat("one")), Answer)  # hit
    assert isinstance(await route(app, chat("hot", temperature=0.7)), Exchange)  # skip (BYPASS)
    r = await client.get("/admin/response-cache/stats", headers=AUTH)
    assert r.status == 200
    body = await r.json()
    assert {"enabled", "backend_type", "entries", "capacity", "requests", "hit_rate", "evictions", "size_bytes",
            "config"} <= set(body)  # fmt: skip
    assert body["enabled"] is True and body["backend_type"] == "memory" and body["entries"] == 2
    assert body["capacity"] == 50
    assert body["requests"] == {"hit": 2, "miss": 2, "skip": 1, "total": 5}
    assert body["hit_rate"] == "0.5000"  # hits over lookups (hit + miss)
    store = app.response_cache.store
    assert isinstance(store, MemoryCacheStore)
    assert body["size_bytes"] == store.size_bytes > 0 and body["evictions"] == 0
    assert body["config"] == {
        "backend": "memory", "ttl": "30m", "capacity": 50, "max_response_size": 1 << 20,
        "max_stream_buffer_size": 10 << 20,
    }  # fmt: skip
    assert body["store"]["stored"] == 2 and "redis" not in body


async def test_evictions_are_the_stores(client_of: Any) -> None:
    app = make_app(capacity=1)
    client = await client_of(app)
    await store_one(app, "one")
    await store_one(app, "two")  # evicts "one"
    body = await (await client.get("/admin/response-cache/stats", headers=AUTH)).json()
    assert body["entries"] == 1 and body["evictions"] == 1


async def test_a_disabled_cache_answers_json_not_404(client_of: Any) -> None:
    app = make_app(enabled=False)
    client = await client_of(app)
    r = await client.get("/admin/response-cache/stats", headers=AUTH)
    assert r.status == 200 and (await r.json())["enabled"] is False
    r = await client.post("/admin/response-cache/invalidate", headers=JSON, json={"clear_all": True})
    assert r.status == 200 and (await r.json())["success"] is True
    r = await client.post("/admin/response-cache/clear", headers=JSON, json={})
    assert r.status == 200 and (await r.json())["success"] is True


async def test_invalidate_clear_all_as_the_seed(client_of: Any) -> None:
    app = make_app()
    client = await client_of(app)
    await store_one(app, "one")
    await store_one(app, "two")
    r = await client.post("/admin/response-cache/invalidate", headers=JSON, json={"clear_all": True})
    assert r.status == 200
    assert await r.json() == {"success": True, "action": "clear_all", "entries_before_clear": 2, "cleared_entries": 2}
    assert len(app.response_cache.store) == 0  # type: ignore[arg-type]
    miss = await route(app, chat("one"))
    assert isinstance(miss, Exchange) and miss.x_cache == "MISS"


async def test_invalidate_one_key(client_of: Any) -> None:
    app = make_app()
    client = await client_of(app)
    key = await store_one(app, "one")
    await store_one(app, "two")
    r = await client.post("/admin/response-cache/invalidate", headers=JSON, json={"key": key})
    assert await r.json() == {"success": True, "action": "key", "key": key, "cleared_entries": 1}
    again = await client.post("/admin/response-cache/invalidate", headers=JSON, json={"key": key})
    assert (await again.json())["cleared_entries"] == 0
    assert isinstance(await route(app, chat("one")), Exchange)  # gone
    assert isinstance(await route(app, chat("two")), Answer)  # kept


async def test_clear_empties_the_store(client_of: Any) -> None:
    app = make_app()
    client = await client_of(app)
    await store_one(app, "one")
    r = await client.post("/admin/response-cache/clear", headers=JSON, json={})
    assert await r.json() == {"success": True, "action": "clear", "entries_before_clear": 1, "cleared_entries": 1}
    assert (await (await client.get("/admin/response-cache/stats", headers=AUTH)).json())["entries"] == 0


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"clear_all": False}, "clear_all: must be true"),
        ({"clear_all": "yes"}, "clear_all: must be true"),
        ({"model": "m"}, "unknown field(s) model"),
        ({}, "exactly one of clear_all and key"),
        ({"clear_all": True, "key": "0" * 64}, "exactly one of clear_all and key"),
        ({"key": "ABC"}, "key: must be an entry's key"),
        ({"key": "A" * 64}, "key: must be an entry's key"),
        ([1, 2], "the body must be"),
    ],
)
async def test_bad_invalidate_bodies_are_refused_and_clear_nothing(client_of: Any, body: Any, needle: str) -> None:
    app = make_app()
    client = await client_of(app)
    await store_one(app, "one")
    r = await client.post("/admin/response-cache/invalidate", headers=JSON, json=body)
    assert r.status == 400
    answer = await r.json()
    assert answer["success"] is False and needle in answer["error"], answer
    assert len(app.response_cache.store) == 1  # type: ignore[arg-type]


async def test_not_json_is_refused(client_of: Any) -> None:
    client = await client_of(make_app())
    r = await client.post("/admin/response-cache/invalidate", headers=JSON, data=b"{nope")
    assert r.status == 400 and "not JSON" in (await r.json())["error"]


async def test_the_admin_token_and_the_cross_site_rules_guard_every_route(client_of: Any) -> None:
    app = make_app()
    client = await client_of(app)
    await store_one(app, "one")
    assert (await client.get("/admin/response-cache/stats")).status == 401
    bad = {"Authorization": "Bearer wrong", "Content-Type": "application/json"}
    for path in ("/admin/response-cache/invalidate", "/admin/response-cache/clear"):
        assert (await client.post(path, json={"clear_all": True})).status == 401
        assert (await client.post(path, headers=bad, json={"clear_all": True})).status == 401
        form = await client.post(path, headers={**AUTH, "Content-Type": "text/plain"}, data='{"clear_all": true}')
        assert form.status == 403  # a cross-site "simple request" cannot clear the cache
        other = await client.post(path, headers={**JSON, "Origin": "http://evil.example"}, json={"clear_all": True})
        assert other.status == 403
    assert len(app.response_cache.store) == 1  # type: ignore[arg-type]


async def test_a_hit_over_ext_proc_observes_one_cache_hit_route_sample(serve: Any) -> None:  # noqa: F811
    app = make_app()
    await store_one(app, "over grpc")
    stub = await serve(app)
    body = json.dumps(chat("over grpc")).encode()
    out = await exchange(stub, request_headers(body_mode=FULL_DUPLEX), request_body(body))
    assert out[0].HasField("immediate_response") and out[0].immediate_response.status.code == 200
    headers = {h.header.key: h.header.raw_value for h in out[0].immediate_response.headers.set_headers}
    assert headers.get("x-cache") == b"HIT"
    reg = app.metrics.registry
    samples = {o: reg.get_sample_value("continuum_picker_route_seconds_count", {"outcome": o}) for o in ROUTE_OUTCOMES}
    assert samples["cache_hit"] == 1.0 and samples["routed"] == 0.0  # the miss went through the path, not gRPC
    assert samples["answered"] is None  # a hit is no longer the anonymous "answered"


async def test_semantic_part_of_the_stats_and_clear_all_empties_its_index(client_of: Any) -> None:
    app = make_app()
    client = await client_of(app)
    index = app.response_cache.index
    assert index is not None
    assert index.add("partition", (1.0, 0.0), "sem:one") and len(index) == 1
    body = await (await client.get("/admin/response-cache/stats", headers=AUTH)).json()
    sem = body["semantic"]
    assert sem["enabled"] is False and sem["threshold"] == 0.92 and sem["max_entries"] == 1000
    assert sem["requests"] == {"hit": 0, "miss": 0, "error": 0, "skip": 0, "total": 0}
    assert sem["index"]["entries"] == 1 and sem["index"]["partitions"] == 1
    r = await client.post("/admin/response-cache/invalidate", headers=JSON, json={"clear_all": True})
    assert (await r.json())["success"] is True and len(index) == 0


async def test_invalidating_a_key_removes_its_semantic_copy_and_vector(client_of: Any) -> None:
    app = make_app()
    client = await client_of(app)
    index, store = app.response_cache.index, app.response_cache.store
    assert index is not None and isinstance(store, MemoryCacheStore)
    sem_one, sem_two = "sem:" + "1" * 64, "sem:" + "2" * 64
    key = await store_with_semantic_copy(app, "one", sem_one)
    await store_with_semantic_copy(app, "two", sem_two)
    assert len(store) == 4 and len(index) == 2
    exact = await route(app, chat("two"))  # the exact entry's link to its copy is never sent
    assert isinstance(exact, Answer) and dict(exact.headers) == {"content-type": "application/json", "x-cache": "HIT"}
    assert index.lookup("partition", (1.0, 0.0)) is not None
    r = await client.post("/admin/response-cache/invalidate", headers=JSON, json={"key": key})
    assert await r.json() == {"success": True, "action": "key", "key": key, "cleared_entries": 2}
    assert await store.get(sem_one) is None and len(index) == 1  # the copy and its vector are gone too
    hit = await app.response_cache.store.get(sem_two)
    assert hit is not None and dict(CacheEntry.decode(hit).answer().headers).keys() == {"content-type", "x-cache"}
    r = await client.post("/admin/response-cache/invalidate", headers=JSON, json={"key": sem_two})  # a sem: key
    assert await r.json() == {"success": True, "action": "key", "key": sem_two, "cleared_entries": 1}
    assert await store.get(sem_two) is None and len(index) == 0
    assert len(store) == 2 and await store.get("tomb:" + key) is not None  # "two"'s exact entry and one's tombstone
    bad = await client.post("/admin/response-cache/invalidate", headers=JSON, json={"key": "sem:xyz"})
    assert bad.status == 400
