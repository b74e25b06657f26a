"""What the admin tests on a Redis-backed picker share: a Valkey that needs a password, and admin clients
closed with the app's Redis store and the process's shared pool."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp.test_utils import TestClient, TestServer
from redis.asyncio import Redis

from picker.cache.store import RedisCacheStore
from picker.redis_pool import close_shared_redis
from picker.runtime.admin import build_admin_app
from picker.runtime.app import PickerApp
from tests.support.valkey import ValkeyProcess


async def require_password(server: ValkeyProcess, password: str) -> None:
    """Set ``requirepass`` on ``server`` (its process is its fixture's, stopped by its pid)."""
    raw = Redis.from_url(server.url)
    try:
        await raw.config_set("requirepass", password)
    finally:
        await raw.aclose()


@pytest.fixture
async def admin() -> AsyncIterator[Callable[[PickerApp], Awaitable[TestClient]]]:
    """``await admin(app)`` -> a TestClient on the app's admin; closed with the app's store and the shared pool."""
    started: list[tuple[TestClient, PickerApp]] = []

    async def start(app: PickerApp) -> TestClient:
        client = TestClient(TestServer(build_admin_app(app)))
        await client.start_server()
        started.append((client, app))
        return client

    try:
        yield start
    finally:
        for client, app in started:
            await client.close()
            if isinstance(app.cache_store, RedisCacheStore):
                await app.cache_store.aclose()
        await close_shared_redis()
