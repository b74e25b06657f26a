"""CacheStoreMetrics: the seed's series names, every (operation, kind) error series exported at 0 from the start,
pre-bound children that feed the labelled series, and one instance per registry."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from picker.cache.metrics import ERROR_KINDS, OPERATIONS, CacheStoreMetrics


def sample(m: CacheStoreMetrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, labels)


def test_every_series_is_exported_at_zero_from_the_start() -> None:
    m = CacheStoreMetrics()
    assert sample(m, "continuum_cache_fallback_active") == 0
    for op in OPERATIONS:
        assert sample(m, "continuum_cache_redis_latency_seconds_count", operation=op) == 0
        for kind in ERROR_KINDS:
            assert sample(m, "continuum_cache_redis_errors_total", operation=op, kind=kind) == 0
    text = generate_latest(m.registry).decode()
    assert text.count("continuum_cache_redis_errors_total{") == len(OPERATIONS) * len(ERROR_KINDS)


def test_the_pre_bound_children_feed_their_own_labelled_series() -> None:
    m = CacheStoreMetrics()
    m.errors[("set", "timeout")].inc()
    m.errors[("set", "timeout")].inc()
    m.latency["ping"].observe(0.002)
    assert sample(m, "continuum_cache_redis_errors_total", operation="set", kind="timeout") == 2
    assert sample(m, "continuum_cache_redis_errors_total", operation="get", kind="timeout") == 0
    assert sample(m, "continuum_cache_redis_latency_seconds_count", operation="ping") == 1
    assert sample(m, "continuum_cache_redis_latency_seconds_sum", operation="ping") == pytest.approx(0.002)
    assert sample(m, "continuum_cache_redis_latency_seconds_count", operation="get") == 0
    m.fallback_active.set(1)
    assert sample(m, "continuum_cache_fallback_active") == 1


def test_the_latency_buckets_span_a_local_get_to_a_command_timeout() -> None:
    m = CacheStoreMetrics()
    m.latency["get"].observe(0.00004)  # a GET on a local Valkey
    m.latency["get"].observe(7.0)  # beyond any command timeout
    bucket = "continuum_cache_redis_latency_seconds_bucket"
    assert sample(m, bucket, operation="get", le="5e-05") == 1
    assert sample(m, bucket, operation="get", le="5.0") == 1
    assert sample(m, bucket, operation="get", le="+Inf") == 2


def test_each_instance_has_its_own_registry_unless_given_one() -> None:
    a, b = CacheStoreMetrics(), CacheStoreMetrics()
    assert a.registry is not b.registry
    a.errors[("get", "other")].inc()
    assert sample(b, "continuum_cache_redis_errors_total", operation="get", kind="other") == 0
    shared = CollectorRegistry()
    assert CacheStoreMetrics(shared).registry is shared
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        CacheStoreMetrics(shared)  # one per registry
