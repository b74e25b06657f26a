"""The composition root wires the parts a config asks for, once: Tier 4 into the request path as its holds source
and an observer (and the path's placements into Tier 4's index), the response cache with the store its backend
names, the pool's discovery source, and the server's background tasks and stop hooks in the order they must
close. Nothing here starts a server or connects to Redis: the parts are built, not run."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from picker.cache.store import MemoryCacheStore, RedisCacheStore
from picker.config import parse_settings
from picker.kv.redis_index import RedisKvIndex
from picker.redis_pool import close_shared_redis
from picker.runtime import compose
from picker.runtime.compose import build_app, build_response_cache, build_server, pool_discovery, uses_redis
from picker.shared.discovery.files import FileDiscovery
from picker.shared.discovery.kubernetes import KubernetesPoolDiscovery

STATIC = {"backends": [{"name": "a", "address": "10.0.0.1:80"}, {"name": "b", "address": "10.0.0.2:80"}]}
KV = {
    "enabled": True,
    "event_sources": [{"backend_name": "a", "endpoint": "http://127.0.0.1:1/events/a"}],
    "tokenizer": {"source": "none"},
    "checks": {"self_check": False},
}
REDIS = {"url": "redis://10.255.0.1:6379/0"}  # never contacted: building a client does not connect


def settings(**cfg: Any) -> Any:
    return parse_settings({"pool": STATIC, **cfg})


@pytest.fixture
async def shared_pool() -> AsyncIterator[None]:
    """Tests that build Redis-backed parts close the process's shared (never connected) pool after them."""
    yield
    await close_shared_redis()


def test_without_tier4_the_path_has_no_holds_source_and_only_the_cache_observes_after_health() -> None:
    app = build_app(settings())
    assert app.tier4 is None and app.path.holds is None
    assert app.path.cache is app.response_cache
    assert app.path.observers[1:] == (app.response_cache,)  # the path's own health observer comes first


def test_tier4_is_the_paths_holds_source_and_observer_and_its_index_watches_the_placements() -> None:
    app = build_app(settings(kv_cache_index=KV))
    assert app.tier4 is not None and app.path.holds is app.tier4
    assert app.path.observers[1:] == (app.tier4.watch, app.response_cache)
    assert app.tier4.index.watcher is app.path.placements  # the feeds settle the placement guesses


def test_the_ring_is_built_with_the_pool_before_any_request() -> None:
    app = build_app(settings(selection_strategy="PrefixAwareHash", prefix_routing={"enabled": True}))
    assert sorted(app.pool.names()) == ["a", "b"]
    assert sorted(set(app.router.rings.ring.walk(12345, dict.fromkeys(("a", "b"), 0)))) == ["a", "b"]


def test_a_memory_response_cache_gets_its_capacity_and_the_semantic_index_its_bounds() -> None:
    s = settings(response_cache={"capacity": 77, "ttl": 120, "semantic": {"max_entries": 9, "threshold": 0.8}})
    cache = build_app(s).response_cache
    assert isinstance(cache.store, MemoryCacheStore) and cache.store.capacity == 77
    assert cache.index is not None and cache.embeddings is not None  # built always: semantic.enabled is hot
    assert (cache.index.max_entries, cache.index.threshold) == (9, 0.8)
    assert cache.index.ttl_seconds == 120  # no semantic.ttl: the response cache's


def test_the_semantic_index_keeps_its_own_ttl_when_set() -> None:
    s = settings(response_cache={"ttl": 120, "semantic": {"ttl": 30}})
    index = build_response_cache(s.response_cache, build_app(s).metrics).index
    assert index is not None and index.ttl_seconds == 30


@pytest.mark.usefixtures("shared_pool")
async def test_the_redis_cache_store_and_the_redis_kv_index_share_one_client() -> None:
    s = settings(
        response_cache={"backend": "redis", "redis": REDIS},
        kv_cache_index={**KV, "backend": "redis"},
    )
    app = build_app(s)
    assert isinstance(app.cache_store, RedisCacheStore)
    assert app.tier4 is not None and isinstance(app.tier4.index, RedisKvIndex)
    assert app.tier4.index.client is app.cache_store.client


@pytest.mark.parametrize(
    ("cfg", "expected"),
    [
        ({}, False),
        ({"response_cache": {"backend": "redis"}}, True),
        ({"kv_cache_index": {**KV, "backend": "redis"}}, True),
        ({"kv_cache_index": {**KV, "enabled": False, "backend": "redis"}}, False),  # Tier 4 off: no index at all
        ({"kv_cache_index": KV}, False),
    ],
)
def test_uses_redis_when_the_cache_store_or_an_enabled_kv_index_is_on_redis(
    cfg: dict[str, Any], expected: bool
) -> None:
    assert uses_redis(settings(**cfg)) is expected


def test_the_pools_discovery_source_follows_its_config(tmp_path: Path) -> None:
    assert pool_discovery(settings().pool) is None
    listed = parse_settings({"pool": {"backends_file": {"path": str(tmp_path / "b.yaml")}}}).pool
    assert isinstance(pool_discovery(listed), FileDiscovery)
    followed = parse_settings({"pool": {"inference_pool": {"name": "vllm", "namespace": "serving"}}}).pool
    discovery = pool_discovery(followed)
    assert isinstance(discovery, KubernetesPoolDiscovery)
    assert discovery.source == "inference_pool serving/vllm" and not discovery.synced


@pytest.mark.usefixtures("shared_pool")
async def test_the_server_closes_redis_writers_first_and_the_shared_pool_last() -> None:
    s = settings(response_cache={"backend": "redis", "redis": REDIS}, kv_cache_index={**KV, "backend": "redis"})
    server = build_server(s)
    app = server.app
    assert app.tier4 is not None
    names = [getattr(hook, "__qualname__", repr(hook)) for hook in server.on_stop]
    tier4_close = names.index(app.tier4.close.__qualname__)
    flush = names.index("build_server.<locals>.flush_response_cache")
    store_close = names.index(app.cache_store.aclose.__qualname__)
    assert tier4_close < flush < store_close < len(names) - 1
    assert server.on_stop[-1] is close_shared_redis
    assert app.tier4.run in server.background


async def test_a_server_without_redis_never_closes_the_shared_pool_and_runs_no_tier4() -> None:
    server = build_server(settings())
    assert close_shared_redis not in server.on_stop
    # named as the supervisor names them: the owner's class and the method (a base class's run is its subclass's)
    names = [
        f"{type(owner).__name__}.{task.__name__}" if (owner := getattr(task, "__self__", None)) is not None
        else getattr(task, "__qualname__", "")
        for task in server.background
    ]  # fmt: skip
    assert names == [
        "LoopLag.run",
        "EngineSignalScraper.run",
        "EngineModelPoller.run",
    ]


async def test_a_discovered_pool_gets_its_discovery_and_an_error_counter_from_the_start() -> None:
    server = build_server(parse_settings({"pool": {"inference_pool": {"name": "vllm", "namespace": "serving"}}}))
    assert isinstance(server.app.discovery, KubernetesPoolDiscovery)
    registry = server.app.metrics.registry
    assert registry.get_sample_value("continuum_picker_discovery_events_total", {"event": "error"}) == 0.0
    static = build_server(settings())
    assert static.app.discovery is None
    assert (
        static.app.metrics.registry.get_sample_value("continuum_picker_discovery_events_total", {"event": "error"})
        is None
    )


async def test_a_response_cache_flush_that_hangs_is_cut_at_its_bound_and_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    server = build_server(settings())
    never = asyncio.Event()

    async def hang() -> None:
        await never.wait()

    monkeypatch.setattr(server.app.response_cache, "flush", hang)
    monkeypatch.setattr(compose, "RESPONSE_CACHE_FLUSH_SECONDS", 0)  # the bound is reached at once: no waiting
    (hook,) = [h for h in server.on_stop if getattr(h, "__name__", "") == "flush_response_cache"]
    with caplog.at_level(logging.WARNING, logger="kv_epp.wiring"):
        await hook()  # returns: a stop is never held up by the store
    assert "event=response_cache_flush_timeout" in caplog.text
