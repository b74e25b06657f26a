"""GeminiContextCache: the seed's lifecycle (digest, hit, single-flight miss, negative cache, LRU with remote DELETE,
extend on hit, clear, stats) against a fake API held with asyncio.Events, on a hand-driven clock; GeminiApi's key
handling without a network."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from picker.config import GeminiBackendConfig, GeminiContextCacheConfig
from picker.gemini import context_cache as cc
from picker.gemini.context_cache import (
    DISABLED_RESPONSE,
    EXPIRY_MARGIN_S,
    ApiError,
    ApiTimeout,
    Created,
    CreateRefused,
    GeminiApi,
    GeminiCacheMetrics,
    GeminiContextCache,
    build_context_cache,
    digest,
    disabled_stats,
)

MIN = 1024  # min_prefix_bytes in these tests (the config's lowest)
TTL = 600.0  # "10m"
NEG_TTL = 60.0
KEY = "AIzaSy-test-key-0123456789abcdefghijklm"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeApi:
    """A GeminiApiLike: records calls; ``hold_creates``/``hold_extends`` keep calls in flight until released;
    ``create_error``/``extend_error``/``delete_error`` make them fail."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.creates: list[tuple[str, str, str, float, float]] = []
        self.extends: list[tuple[str, str, float]] = []
        self.deletes: list[tuple[str, str]] = []
        self.create_started = asyncio.Event()
        self.extend_started = asyncio.Event()
        self.release_creates = asyncio.Event()
        self.release_creates.set()
        self.release_extends = asyncio.Event()
        self.release_extends.set()
        self.create_error: BaseException | None = None
        self.extend_error: BaseException | None = None
        self.delete_error: BaseException | None = None
        self.closed = False
        self._n = 0

    def hold_creates(self) -> None:
        self.release_creates.clear()

    def hold_extends(self) -> None:
        self.release_extends.clear()

    async def create(
        self, backend: GeminiBackendConfig, model: str, system: str, ttl_s: float, timeout_s: float
    ) -> Created:
        self.creates.append((backend.name, model, system, ttl_s, timeout_s))
        self.create_started.set()
        await self.release_creates.wait()
        if self.create_error is not None:
            raise self.create_error
        self._n += 1
        return Created(f"cachedContents/c{self._n}", self.clock() + ttl_s)

    async def extend(self, backend: GeminiBackendConfig, name: str, ttl_s: float) -> float:
        self.extends.append((backend.name, name, ttl_s))
        self.extend_started.set()
        await self.release_extends.wait()
        if self.extend_error is not None:
            raise self.extend_error
        return self.clock() + ttl_s

    async def delete(self, backend: GeminiBackendConfig, name: str) -> None:
        self.deletes.append((backend.name, name))
        if self.delete_error is not None:
            raise self.delete_error

    async def close(self) -> None:
        self.closed = True


def backend(name: str = "gem", key_file: str = "/nonexistent/key") -> GeminiBackendConfig:
    return GeminiBackendConfig(
        name=name, type="gemini", base_url="http://127.0.0.1:9", api_key_file=key_file,
        models=("gemini-2.5-flash",), allow_insecure=True,
    )  # fmt: skip


def config(**kw: Any) -> GeminiContextCacheConfig:
    base: dict[str, Any] = {
        "enabled": True, "min_prefix_bytes": MIN, "ttl": "10m", "max_entries": 10, "negative_ttl_seconds": NEG_TTL,
    }  # fmt: skip
    return GeminiContextCacheConfig(**(base | kw))


def prompt(i: int = 0, size: int = MIN) -> str:
    head = f"system prompt {i}: "
    return head + "x" * (size - len(head))


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def api(clock: Clock) -> FakeApi:
    return FakeApi(clock)


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


def make(api: FakeApi, clock: Clock, registry: CollectorRegistry | None = None, **kw: Any) -> GeminiContextCache:
    cache = build_context_cache(config(**kw), api, clock=clock, registry=registry)
    assert cache is not None
    return cache


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def op_count(registry: CollectorRegistry, operation: str, outcome: str, backend: str = "gem") -> float | None:
    labels = {"backend": backend, "operation": operation, "outcome": outcome}
    return registry.get_sample_value("continuum_gemini_context_cache_operations_total", labels)


async def fill(cache: GeminiContextCache, b: GeminiBackendConfig, indices: range) -> None:
    for i in indices:
        assert cache.lookup(b, "gemini-2.5-flash", prompt(i)).result == "miss"
    await cache.wait_idle()


# -- digest and eligibility -----------------------------------------------------------------------------------------
def test_digest_hashes_model_separator_and_the_whole_prompt() -> None:
    system = "é" * 30_000  # well past any prefix truncation
    want = hashlib.sha256(b"m\x00" + system.encode()).hexdigest()
    assert digest("m", system) == want
    assert digest("m", system + "!") != want  # the very last byte counts
    assert digest("m2", system) != want
    assert digest("ab", "c") != digest("a", "bc")  # the separator keeps fields apart
    assert GeminiContextCache.digest("m", system) == want


async def test_ineligible_without_or_under_the_threshold(api: FakeApi, clock: Clock) -> None:
    cache = make(api, clock)
    b = backend()
    assert cache.lookup(b, "m", None).result == "ineligible"
    assert cache.lookup(b, "m", "").result == "ineligible"
    assert cache.lookup(b, "m", "x" * (MIN - 1)).result == "ineligible"
    # the threshold is UTF-8 bytes, not characters: 512 two-byte characters are 1024 bytes
    assert cache.lookup(b, "m", "é" * (MIN // 2 - 1)).result == "ineligible"
    assert cache.lookup(b, "m", "é" * (MIN // 2)).result == "miss"
    await cache.wait_idle()
    assert len(api.creates) == 1
    assert cache.stats()["ineligible"] == 4
    await cache.close()


# -- miss, single-flight, hit -----------------------------------------------------------------------------------------
async def test_ten_concurrent_misses_start_one_create_then_hit(
    api: FakeApi, clock: Clock, registry: CollectorRegistry
) -> None:
    cache = make(api, clock, registry)
    b = backend()
    api.hold_creates()
    results = [cache.lookup(b, "gemini-2.5-flash", prompt()).result for _ in range(10)]
    assert results == ["miss"] * 10
    await api.create_started.wait()
    assert cache.in_flight == 1 and cache.stats()["in_flight"] == 1
    assert sample(registry, "continuum_gemini_context_cache_in_flight") == 1
    assert cache.lookup(b, "gemini-2.5-flash", prompt()).result == "miss"  # still in flight: no second create
    api.release_creates.set()
    await cache.wait_idle()
    assert len(api.creates) == 1
    name, model, system, ttl_s, timeout_s = api.creates[0]
    assert (name, model, system, ttl_s, timeout_s) == ("gem", "gemini-2.5-flash", prompt(), TTL, 5.0)
    hit = cache.lookup(b, "gemini-2.5-flash", prompt())
    assert (hit.result, hit.cached_content) == ("hit", "cachedContents/c1")
    s = cache.stats()
    assert (s["hit"], s["miss"], s["creates"], s["entries"], s["in_flight"]) == (1, 11, 1, 1, 0)
    assert sample(registry, "continuum_gemini_context_cache_requests_total", backend="gem", result="hit") == 1
    assert sample(registry, "continuum_gemini_context_cache_requests_total", backend="gem", result="miss") == 11
    assert op_count(registry, "create", "ok") == 1
    assert sample(registry, "continuum_gemini_context_cache_entries") == 1
    assert sample(registry, "continuum_gemini_context_cache_in_flight") == 0
    await cache.close()


async def test_a_forgotten_resource_makes_the_next_request_a_miss_without_a_delete(api: FakeApi, clock: Clock) -> None:
    cache = make(api, clock)
    b = backend()
    cache.lookup(b, "gemini-2.5-flash", prompt())
    await cache.wait_idle()
    hit = cache.lookup(b, "gemini-2.5-flash", prompt())
    assert hit.result == "hit" and hit.cached_content is not None
    assert not cache.forget("another-backend", hit.cached_content)
    assert cache.forget(b.name, hit.cached_content)
    assert cache.stats()["entries"] == 0 and cache.stats()["forgotten"] == 1
    assert cache.lookup(b, "gemini-2.5-flash", prompt()).result == "miss"
    await cache.wait_idle()
    assert api.deletes == []  # gone on Google's side already
    await cache.close()


async def test_same_prompt_on_another_model_or_backend_is_another_entry(api: FakeApi, clock: Clock) -> None:
    cache = make(api, clock)
    await fill(cache, backend("a"), range(1))
    assert cache.lookup(backend("a"), "gemini-2.5-flash", prompt(0)).result == "hit"
    assert cache.lookup(backend("b"), "gemini-2.5-flash", prompt(0)).result == "miss"
    assert cache.lookup(backend("a"), "gemini-2.5-pro", prompt(0)).result == "miss"
    await cache.wait_idle()
    assert len(api.creates) == 3
    assert set(cache.stats()["backends"]) == {"a", "b"}
    await cache.close()


async def test_an_entry_stops_answering_a_margin_before_it_expires(api: FakeApi, clock: Clock) -> None:
    cache = make(api, clock)
    b = backend()
    await fill(cache, b, range(1))
    clock.now += TTL - EXPIRY_MARGIN_S - 0.01
    assert cache.lookup(b, "gemini-2.5-flash", prompt()).result == "hit"
    clock.now += 0.02  # within the margin: a request could reach Google after the resource died
    assert cache.lookup(b, "gemini-2.5-flash", prompt()).result == "miss"
    await cache.wait_idle()
    assert len(api.creates) == 2  # re-created
    assert api.deletes == []  # expired server-side anyway: nothing to delete
    assert cache.lookup(b, "gemini-2.5-flash", prompt()).cached_content == "cachedContents/c2"
    await cache.close()


# -- refusals and failures ------------------------------------------------------------------------------------------
async def test_a_refused_create_is_negative_cached_then_retried(
    api: FakeApi, clock: Clock, registry: CollectorRegistry
) -> None:
    cache = make(api, clock, registry)
    b = backend()
    api.create_error = CreateRefused("create on backend gem: HTTP 400: Cached content is too small", status=400)
    await fill(cache, b, range(1))
    for _ in range(5):
        assert cache.lookup(b, "gemini-2.5-flash", prompt()).result == "negative"
    clock.now += NEG_TTL - 0.01
    assert cache.lookup(b, "gemini-2.5-flash", prompt()).result == "negative"
    await cache.wait_idle()
    assert len(api.creates) == 1  # not retried within negative_ttl_seconds
    s = cache.stats()
    assert (s["negative_entries"], s["negative"], s["create_failures"], s["create_refused"]) == (1, 6, 1, 1)
    assert sample(registry, "continuum_gemini_context_cache_negative_entries") == 1
    assert op_count(registry, "create", "refused") == 1
    clock.now += 0.02
    api.create_error = None
    assert cache.lookup(b, "gemini-2.5-flash", prompt()).result == "miss"  # the negative entry expired: retried
    await cache.wait_idle()
    assert len(api.creates) == 2
    assert cache.lookup(b, "gemini-2.5-flash", prompt()).result == "hit"
    assert cache.stats()["negative_entries"] == 0
    await cache.close()


@pytest.mark.parametrize(
    ("error", "outcome"),
    [(ApiError("create on backend gem: HTTP 500: internal", status=500), "error"),
     (ApiTimeout("create on backend gem: no answer within 5s"), "timeout"),
     (TimeoutError(), "timeout")],
)  # fmt: skip
async def test_a_failed_or_timed_out_create_is_not_negative_cached(
    api: FakeApi, clock: Clock, registry: CollectorRegistry, error: BaseException, outcome: str
) -> None:
    cache = make(api, clock, registry)
    b = backend()
    api.create_error = error
    await fill(cache, b, range(1))
    assert cache.lookup(b, "gemini-2.5-flash", prompt()).result == "miss"  # the next miss retries at once
    await cache.wait_idle()
    assert len(api.creates) == 2
    s = cache.stats()
    assert (s["negative_entries"], s["create_failures"], s["create_refused"], s["entries"]) == (0, 2, 0, 0)
    assert op_count(registry, "create", outcome) == 2
    await cache.close()


async def test_a_bug_in_a_task_is_logged_and_counted(
    api: FakeApi, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    cache = make(api, clock)
    api.create_error = RuntimeError("surprise")
    with caplog.at_level(logging.ERROR, logger="kv_epp.gemini_context_cache"):
        await fill(cache, backend(), range(1))
    assert cache.task_failures == 1 and cache.stats()["create_failures"] == 1
    assert "event=gemini_cache_task_failed task=create" in caplog.text and "surprise" in caplog.text
    assert cache.in_flight == 0  # the single-flight slot is free again
    await cache.close()


async def test_creates_in_flight_are_bounded(api: FakeApi, clock: Clock) -> None:
    cache = make(api, clock, max_entries=10)
    b = backend()
    api.hold_creates()
    for i in range(12):
        assert cache.lookup(b, "gemini-2.5-flash", prompt(i)).result == "miss"
    assert cache.in_flight == 10
    assert cache.stats()["creates_skipped"] == 2
    api.release_creates.set()
    await cache.wait_idle()
    assert len(api.creates) == 10
    await cache.close()


async def test_creates_in_flight_are_bounded_in_prompt_characters(
    api: FakeApi, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cc, "MAX_CREATE_CHARS_IN_FLIGHT", 3 * MIN)
    cache = make(api, clock)
    b = backend()
    api.hold_creates()
    for i in range(4):
        assert cache.lookup(b, "gemini-2.5-flash", prompt(i)).result == "miss"
    assert cache.in_flight == 3 and cache.stats()["creates_skipped"] == 1
    api.release_creates.set()
    await cache.wait_idle()
    assert cache.lookup(b, "gemini-2.5-flash", prompt(3)).result == "miss"  # room again
    await cache.wait_idle()
    assert len(api.creates) == 4
    await cache.close()


# -- bounds ---------------------------------------------------------------------------------------------------------
async def test_lru_eviction_at_max_entries_deletes_the_evicted_resource(
    api: FakeApi, clock: Clock, registry: CollectorRegistry
) -> None:
    cache = make(api, clock, registry, max_entries=10)
    b = backend()
    for i in range(10):
        clock.now += 1
        await fill(cache, b, range(i, i + 1))
    assert len(cache) == 10
    clock.now += 1
    assert cache.lookup(b, "gemini-2.5-flash", prompt(0)).result == "hit"  # 0 is used again: 1 is now the LRU
    clock.now += 1
    await fill(cache, b, range(10, 11))
    assert len(cache) == 10
    assert api.deletes == [("gem", "cachedContents/c2")]  # prompt(1)'s resource
    assert cache.lookup(b, "gemini-2.5-flash", prompt(0)).result == "hit"
    assert cache.lookup(b, "gemini-2.5-flash", prompt(10)).result == "hit"
    s = cache.stats()
    assert (s["evictions"], s["deletes"], s["entries"]) == (1, 1, 10)
    assert sample(registry, "continuum_gemini_context_cache_evictions_total") == 1
    assert op_count(registry, "delete", "ok") == 1
    await cache.close()


async def test_a_failed_delete_is_counted_never_raised(api: FakeApi, clock: Clock) -> None:
    cache = make(api, clock, max_entries=10)
    api.delete_error = ApiError("delete on backend gem: HTTP 503: unavailable", status=503)
    await fill(cache, backend(), range(10))
    await fill(cache, backend(), range(10, 11))
    assert len(api.deletes) == 1
    s = cache.stats()
    assert (s["evictions"], s["deletes"], s["delete_failures"], s["entries"]) == (1, 0, 1, 10)
    await cache.close()


async def test_negative_entries_share_the_bound_and_expired_ones_go_first(api: FakeApi, clock: Clock) -> None:
    cache = make(api, clock, max_entries=10)
    b = backend()
    api.create_error = CreateRefused("too small", status=400)
    await fill(cache, b, range(3))
    api.create_error = None
    clock.now += 1
    await fill(cache, b, range(3, 10))
    s = cache.stats()
    assert (s["entries"], s["negative_entries"]) == (7, 3)
    clock.now += NEG_TTL  # the negative entries expired; the resources did not
    await fill(cache, b, range(10, 11))
    s = cache.stats()
    assert (s["entries"], s["negative_entries"], s["evictions"]) == (8, 2, 0)  # an expired negative went
    assert api.deletes == []
    assert all(cache.lookup(b, "gemini-2.5-flash", prompt(i)).result == "hit" for i in range(3, 11))
    await cache.close()


async def test_without_expired_entries_the_least_recently_used_of_either_kind_goes(api: FakeApi, clock: Clock) -> None:
    cache = make(api, clock, max_entries=10)
    b = backend()
    api.create_error = CreateRefused("too small", status=400)
    await fill(cache, b, range(1))  # the oldest: a negative entry (not expired)
    api.create_error = None
    clock.now += 1
    await fill(cache, b, range(1, 10))
    clock.now += 1
    await fill(cache, b, range(10, 11))
    s = cache.stats()
    assert (s["entries"], s["negative_entries"], s["evictions"]) == (10, 0, 1)
    assert api.deletes == []  # a negative entry has no resource
    clock.now += 1
    await fill(cache, b, range(11, 12))  # now the LRU is prompt(1)'s resource
    assert api.deletes == [("gem", "cachedContents/c1")]
    await cache.close()


async def test_expired_entries_go_before_the_lru_and_are_not_deleted(api: FakeApi, clock: Clock) -> None:
    cache = make(api, clock, max_entries=10, extend_on_hit=True)
    b = backend()
    await fill(cache, b, range(1))  # c1: its TTL runs out first
    clock.now += 300
    await fill(cache, b, range(1, 10))
    clock.now += 299  # c1 is within the margin of its end; the others have 301 s left
    await fill(cache, b, range(10, 11))
    assert api.deletes == []  # c1 dropped as expired, not evicted
    s = cache.stats()
    assert (s["entries"], s["evictions"]) == (10, 0)
    assert all(cache.lookup(b, "gemini-2.5-flash", prompt(i)).result == "hit" for i in range(1, 11))
    await cache.close()


# -- extend on hit --------------------------------------------------------------------------------------------------
async def test_extend_on_hit_in_the_last_fifth_of_the_ttl_once(api: FakeApi, clock: Clock) -> None:
    cache = make(api, clock, extend_on_hit=True)
    b = backend()
    await fill(cache, b, range(1))
    created_at = clock.now
    clock.now = created_at + TTL * 0.8 - 1  # 20% + 1 s left
    assert cache.lookup(b, "gemini-2.5-flash", prompt()).result == "hit"
    await cache.wait_idle()
    assert api.extends == []
    clock.now = created_at + TTL * 0.8  # exactly 20% left
    api.hold_extends()
    for _ in range(5):
        assert cache.lookup(b, "gemini-2.5-flash", prompt()).result == "hit"
    await api.extend_started.wait()
    api.release_extends.set()
    await cache.wait_idle()
    assert api.extends == [("gem", "cachedContents/c1", TTL)]  # single-flight
    for _ in range(5):
        assert cache.lookup(b, "gemini-2.5-flash", prompt()).result == "hit"
    await cache.wait_idle()
    assert len(api.extends) == 1  # extended: a full TTL ahead again
    clock.now = created_at + TTL * 0.8 + TTL - 10  # past the original end, within the extended one
    assert cache.lookup(b, "gemini-2.5-flash", prompt()).result == "hit"
    await cache.wait_idle()
    assert len(api.extends) == 2  # the next period's extension
    assert cache.stats()["extends"] == 2
    await cache.close()


async def test_extend_off_by_default_and_a_failed_extend_is_not_retried_each_hit(api: FakeApi, clock: Clock) -> None:
    off = make(api, clock)
    b = backend()
    await fill(off, b, range(1))
    clock.now += TTL * 0.9
    assert off.lookup(b, "gemini-2.5-flash", prompt()).result == "hit"
    await off.wait_idle()
    assert api.extends == []
    await off.close()

    api2 = FakeApi(clock)
    on = make(api2, clock, extend_on_hit=True)
    await fill(on, b, range(1))
    clock.now += TTL * 0.9
    api2.extend_error = ApiError("extend on backend gem: HTTP 500: x", status=500)
    for _ in range(3):
        assert on.lookup(b, "gemini-2.5-flash", prompt()).result == "hit"
        await on.wait_idle()
    assert len(api2.extends) == 1
    assert on.stats()["extend_failures"] == 1
    await on.close()


async def test_an_extend_answered_404_drops_the_entry(api: FakeApi, clock: Clock) -> None:
    cache = make(api, clock, extend_on_hit=True)
    b = backend()
    await fill(cache, b, range(1))
    clock.now += TTL * 0.9
    api.extend_error = ApiError("extend on backend gem: HTTP 404: not found", status=404)
    assert cache.lookup(b, "gemini-2.5-flash", prompt()).result == "hit"
    await cache.wait_idle()
    assert cache.lookup(b, "gemini-2.5-flash", prompt()).result == "miss"  # gone server-side: re-created
    await cache.close()


# -- clear, stats, usage, lifecycle ---------------------------------------------------------------------------------
async def test_clear_counts_and_deletes_every_tracked_resource(
    api: FakeApi, clock: Clock, registry: CollectorRegistry
) -> None:
    cache = make(api, clock, registry)
    b = backend()
    await fill(cache, b, range(4))
    api.create_error = CreateRefused("too small", status=400)
    await fill(cache, b, range(4, 6))
    api.create_error = None
    assert cache.stats()["negative_entries"] == 2
    assert cache.clear_response() == {"success": True, "cleared_entries": 4}
    await cache.wait_idle()
    assert sorted(n for _, n in api.deletes) == [f"cachedContents/c{i}" for i in range(1, 5)]
    s = cache.stats()
    assert (s["entries"], s["negative_entries"], s["backends"]["gem"]["entries"]) == (0, 0, 0)
    assert sample(registry, "continuum_gemini_context_cache_entries") == 0
    assert cache.lookup(b, "gemini-2.5-flash", prompt(4)).result == "miss"  # the negative entry went too
    await cache.wait_idle()
    assert cache.clear() == 1
    await cache.close()


async def test_a_create_in_flight_during_clear_is_deleted_not_stored(api: FakeApi, clock: Clock) -> None:
    cache = make(api, clock)
    b = backend()
    api.hold_creates()
    cache.lookup(b, "gemini-2.5-flash", prompt())
    await api.create_started.wait()
    assert cache.clear() == 0
    api.release_creates.set()
    await cache.wait_idle()
    assert api.deletes == [("gem", "cachedContents/c1")]
    assert len(cache) == 0
    await cache.close()


async def test_stats_have_the_seeds_fields(api: FakeApi, clock: Clock) -> None:
    cache = make(api, clock, extend_on_hit=True)
    b = backend()
    await fill(cache, b, range(1))
    cache.lookup(b, "gemini-2.5-flash", prompt())
    cache.lookup(b, "gemini-2.5-flash", "short")
    cache.record_usage("gem", 1500)
    cache.record_usage("gem", 0)
    cache.record_usage("gem", -3)  # ignored
    s = cache.stats()
    for key in (
        "enabled", "config", "entries", "negative_entries", "in_flight", "backends",
        "hit", "miss", "ineligible", "negative", "creates", "create_failures", "evictions", "cached_tokens",
    ):  # fmt: skip
        assert key in s, key
    assert s["enabled"] is True
    assert s["config"] == {
        "min_prefix_bytes": MIN, "ttl": "10m", "ttl_seconds": TTL, "extend_on_hit": True, "max_entries": 10,
        "create_timeout_ms": 5000, "negative_ttl_seconds": int(NEG_TTL), "prefer_native_api": False,
    }  # fmt: skip
    assert (s["hit"], s["miss"], s["ineligible"], s["creates"], s["cached_tokens"]) == (1, 1, 1, 1, 1500)
    per = s["backends"]["gem"]
    assert (per["entries"], per["hit"], per["miss"], per["ineligible"], per["cached_tokens"]) == (1, 1, 1, 1, 1500)
    await cache.close()


async def test_cached_tokens_metric(api: FakeApi, clock: Clock, registry: CollectorRegistry) -> None:
    cache = make(api, clock, registry)
    cache.record_usage("gem", 700)
    cache.record_usage("gem", 300)
    assert sample(registry, "continuum_gemini_context_cache_cached_tokens_total", backend="gem") == 1000
    await cache.close()


async def test_close_cancels_tasks_and_closes_the_api(api: FakeApi, clock: Clock) -> None:
    cache = make(api, clock)
    api.hold_creates()
    cache.lookup(backend(), "gemini-2.5-flash", prompt())
    await api.create_started.wait()
    before = set(asyncio.all_tasks())
    await cache.close()
    assert api.closed
    assert cache.in_flight == 0
    assert not any(t.get_name().startswith("gemini-context-cache") for t in asyncio.all_tasks())
    assert len(asyncio.all_tasks()) < len(before)
    assert cache.lookup(backend(), "gemini-2.5-flash", prompt(1)).result == "miss"  # closed: nothing starts
    assert cache.in_flight == 0 and len(api.creates) == 1


async def test_disabled_builds_nothing(api: FakeApi, clock: Clock, registry: CollectorRegistry) -> None:
    tasks = set(asyncio.all_tasks())
    cfg = GeminiContextCacheConfig()
    assert cfg.enabled is False  # the default
    assert build_context_cache(cfg, api, clock=clock, registry=registry) is None
    assert build_context_cache(cfg) is None  # no API client built either
    assert set(asyncio.all_tasks()) == tasks
    assert not [m for m in registry.collect() if m.name.startswith("continuum_gemini")]
    assert api.creates == [] and not api.closed
    with pytest.raises(ValueError, match="enabled is false"):
        GeminiContextCache(cfg, api)
    assert DISABLED_RESPONSE == {"success": False, "error": "Gemini context cache is not enabled"}
    assert disabled_stats(cfg)["enabled"] is False
    assert cc.DISABLED.result == "disabled" and cc.DISABLED.cached_content is None


def test_metrics_series_exist_at_zero_for_a_backend(registry: CollectorRegistry) -> None:
    m = GeminiCacheMetrics(registry)
    m.backend("gem")
    for result in ("hit", "miss", "ineligible", "negative"):
        assert sample(registry, "continuum_gemini_context_cache_requests_total", backend="gem", result=result) == 0
    for op in ("create", "extend", "delete"):
        for outcome in ("ok", "refused", "error", "timeout"):
            assert op_count(registry, op, outcome) == 0


# -- the API key ----------------------------------------------------------------------------------------------------
def key_file(tmp_path: Path, text: str = f"  {KEY}\n") -> Path:
    p = tmp_path / "api-key"
    p.write_text(text)
    return p


async def test_key_file_errors_name_the_path_never_the_key(tmp_path: Path) -> None:
    api = GeminiApi()
    missing = tmp_path / "missing"
    with pytest.raises(ApiError, match=f"api_key_file {missing}: cannot read it"):
        await api.create(backend(key_file=str(missing)), "gemini-2.5-flash", prompt(), TTL, 1.0)
    empty = key_file(tmp_path, " \n")
    with pytest.raises(ApiError, match="empty"):
        await api.delete(backend(key_file=str(empty)), "cachedContents/c1")
    two_lines = key_file(tmp_path, f"{KEY}\n{KEY}\n")
    with pytest.raises(ApiError, match="control") as info:
        await api.delete(backend(key_file=str(two_lines)), "cachedContents/c1")
    assert KEY not in str(info.value)
    await api.close()


def test_key_is_stripped_cached_and_re_read_when_the_file_changes(tmp_path: Path) -> None:
    keys = cc._KeyFiles()
    p = key_file(tmp_path)
    b = backend(key_file=str(p))
    assert keys.key(b) == KEY
    assert keys.key(b) == KEY
    p.write_text("other-key-of-another-length\n")
    st = p.stat()
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert keys.key(b) == "other-key-of-another-length"


class _Raising:
    """A session whose request fails with a message quoting the key (as a careless library might)."""

    def request(self, method: str, url: str, **kw: Any) -> Any:
        raise ValueError(f"bad header x-goog-api-key: {kw['headers']['x-goog-api-key']}")

    async def close(self) -> None:
        pass


async def test_the_key_never_reaches_an_exception_or_a_log(
    tmp_path: Path, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    api = GeminiApi(clock=clock)
    api._session = _Raising()  # type: ignore[assignment]
    b = backend(key_file=str(key_file(tmp_path)))
    with pytest.raises(ApiError) as info:
        await api.create(b, "gemini-2.5-flash", prompt(), TTL, 1.0)
    assert KEY not in str(info.value) and KEY not in repr(info.value) and "[redacted]" in str(info.value)
    assert info.value.__suppress_context__

    cache = build_context_cache(config(), api, clock=clock)
    assert cache is not None
    with caplog.at_level(logging.DEBUG):
        cache.lookup(b, "gemini-2.5-flash", prompt())
        await cache.wait_idle()
        cache._delete_later(b, cache._stats("gem"), "cachedContents/c1")
        await cache.wait_idle()
    assert cache.stats()["create_failures"] == 1 and cache.stats()["delete_failures"] == 1
    assert "event=gemini_cache_create_failed" in caplog.text
    assert KEY not in caplog.text
    await cache.close()
