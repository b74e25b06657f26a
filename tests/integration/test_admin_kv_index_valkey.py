"""/admin/kv-index/stats with ``kv_cache_index.backend: redis``: the ``redis`` object (where the shared index
connects, without the password; connected / fallback; the index's counters; the backends and entries Valkey holds)
against a real password-protected Valkey (the fixture's server, stopped by pid)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from picker.config import parse_settings
from picker.kv.redis_index import RedisKvIndex
from picker.kv.tier4 import Tier4
from picker.ops.metrics import PickerMetrics
from picker.runtime.app import PickerApp
from picker.runtime.compose import build_app
from picker.shared.tiers import StorageTier
from tests.support.admin_redis import require_password
from tests.support.valkey import ValkeyProcess, free_port, valkey_server  # noqa: F401  (the fixture)

TOKEN = "adm1n-t0ken"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PASSWORD = "Kv-1ndex-s3cret"


def make_app(url: str, backend: str = "redis") -> PickerApp:
    settings = parse_settings(
        {
            "pool": {"backends": [{"name": "a", "address": "10.0.0.1:80"}, {"name": "b", "address": "10.0.0.2:80"}]},
            "kv_cache_index": {"enabled": True, "backend": backend},
            "response_cache": {"backend": "redis", "redis": {"url": url, "command_timeout_ms": 2000, "pool_size": 3}},
            "admin": {"bearer_token": TOKEN},
        }
    )
    return build_app(settings, PickerMetrics())


def with_redis_index(app: PickerApp) -> RedisKvIndex:
    """Tier 4 on the Redis index over response_cache.redis (what the app builds once it passes that config)."""
    s = app.settings
    app.tier4 = Tier4(s.kv_cache_index, app.pool, PickerMetrics(), s.response_cache.redis)
    assert isinstance(app.tier4.index, RedisKvIndex)
    return app.tier4.index


@pytest.fixture
async def secured(valkey_server: ValkeyProcess) -> AsyncIterator[ValkeyProcess]:  # noqa: F811
    """The Valkey with ``requirepass`` set."""
    await require_password(valkey_server, PASSWORD)
    yield valkey_server


def url_of(server: ValkeyProcess, password: str = PASSWORD) -> str:
    return f"redis://:{password}@{server.host}:{server.port}/0"


async def stats_text(client: TestClient) -> str:
    r = await client.get("/admin/kv-index/stats", headers=AUTH)
    assert r.status == 200
    return await r.text()


@pytest.mark.valkey
async def test_redis_fields_and_the_keys_valkey_holds(secured: ValkeyProcess, admin: Any) -> None:
    app = make_app(url_of(secured))
    index = with_redis_index(app)
    client = await admin(app)
    writer = asyncio.get_running_loop().create_task(index.run())  # the index's writer task, cancelled below
    try:
        index.put("a", [1, 2, 3], StorageTier.GPU_HOT)
        index.put("b", [1, 2], StorageTier.GPU_HOT)
        await index.flush(timeout_s=30.0)
    finally:
        writer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await writer
    assert (await index.holds([1, 2, 3]))["a"].blocks == 3  # one read answered by Valkey
    text = await stats_text(client)
    assert PASSWORD not in text
    body = json.loads(text)
    assert body["enabled"] is True and body["config"]["backend"] == "redis"
    redis = body["redis"]
    assert redis["active"] is True and redis["connected"] is True and redis["fallback_active"] is False
    assert redis["url"] == f"redis://{secured.host}:{secured.port}/0" and redis["pool_size"] == 3
    assert redis["key_prefix"] == index.prefix and redis["lookups"] == 1 and redis["errors"] == 0
    assert redis["keys"] == {"backends": 2, "entries": 5, "per_backend": {"a": 3, "b": 2}}


@pytest.mark.valkey
async def test_a_wrong_password_is_the_local_fallback_and_neither_password_shows(
    secured: ValkeyProcess, admin: Any
) -> None:
    wrong = "Wr0ng-kv-s3cret"
    app = make_app(url_of(secured, wrong))
    index = with_redis_index(app)
    client = await admin(app)
    index.put("a", [1, 2, 3], StorageTier.GPU_HOT)
    assert (await index.holds([1, 2, 3]))["a"].blocks == 3  # Redis refused (auth): the local index answers
    text = await stats_text(client)
    assert wrong not in text and PASSWORD not in text
    redis = json.loads(text)["redis"]
    assert redis["connected"] is False and redis["fallback_active"] is True
    assert redis["fallbacks"] == 1 and redis["errors"] >= 1
    assert "keys" not in redis  # a down Redis is not asked


@pytest.mark.valkey
async def test_the_keys_are_an_error_not_a_500_when_valkey_goes_away(secured: ValkeyProcess, admin: Any) -> None:
    app = make_app(url_of(secured))
    index = with_redis_index(app)
    client = await admin(app)
    assert await index.holds([9]) == {}  # connected
    secured.stop()
    body = json.loads(await stats_text(client))
    # no writer task runs here and no read failed yet: the index still believes Redis up, so the admin asks it
    assert body["redis"]["connected"] is True and set(body["redis"]["keys"]) == {"error"}


async def test_the_in_memory_backend_has_no_redis_object(admin: Any) -> None:
    client = await admin(make_app(f"redis://:{PASSWORD}@127.0.0.1:{free_port()}/0", backend="memory"))
    body = json.loads(await stats_text(client))
    assert "redis" not in body and body["config"]["backend"] == "memory"


async def test_backend_redis_with_an_in_memory_index_says_so(admin: Any) -> None:
    """The app as built today gives Tier 4 no Redis config: the index is in memory, and the stats say it."""
    app = make_app(f"redis://:{PASSWORD}@127.0.0.1:{free_port()}/0")
    client = await admin(app)
    text = await stats_text(client)
    redis = json.loads(text)["redis"]
    if isinstance(app.tier4.index if app.tier4 else None, RedisKvIndex):  # the app now passes it
        assert redis["active"] is True
    else:
        assert redis["active"] is False and "in memory" in redis["reason"]
    assert PASSWORD not in text
