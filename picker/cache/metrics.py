"""Tier 3's metrics, the seed's names: ``continuum_cache_fallback_active``, ``continuum_cache_redis_latency_seconds``
and ``continuum_cache_redis_errors_total``.

Create one ``CacheStoreMetrics`` per registry (the picker's, or a test's own). Labels come from fixed sets
(``OPERATIONS`` x ``ERROR_KINDS``), every series exported from the start (errors at 0, so an alert on their rate
sees the first one); the request path uses pre-bound children, no label lookup.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

OPERATIONS = ("get", "set", "delete", "clear", "ping")
# connection: refused, reset, no connection from the pool; timeout: the command timeout passed; other: the rest
ERROR_KINDS = ("connection", "timeout", "other")
# 50 us (a GET on a local Valkey) to 5 s (above any command timeout a config would set on the request path)
REDIS_LATENCY_BUCKETS = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
)  # fmt: skip


class CacheStoreMetrics:
    """The Redis store's metrics against one registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.fallback_active = Gauge(
            "continuum_cache_fallback_active",
            "1 while the Redis cache store serves from its in-memory fallback (Redis failed; a health check "
            "retries it), 0 on Redis",
            registry=r,
        )
        self.redis_latency = Histogram(
            "continuum_cache_redis_latency_seconds",
            "Time the cache store spent on one Redis command, by operation (get, set, delete, clear: one SCAN or "
            "UNLINK batch, ping: the health check), failed commands included (a timeout counts its full wait)",
            ["operation"],
            buckets=REDIS_LATENCY_BUCKETS,
            registry=r,
        )
        self.redis_errors = Counter(
            "continuum_cache_redis_errors",
            "Failed Redis commands of the cache store, by operation and kind (connection, timeout, other)",
            ["operation", "kind"],
            registry=r,
        )
        self.latency = {op: self.redis_latency.labels(op) for op in OPERATIONS}
        self.errors = {(op, kind): self.redis_errors.labels(op, kind) for op in OPERATIONS for kind in ERROR_KINDS}
        self.fallback_active.set(0)
