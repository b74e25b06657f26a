"""Tiers 2 and 3: the response cache and the stores it keeps entries in.

``CacheStore`` is what the response cache (and anything else that keeps bytes by key) needs from a store: the
in-memory one (LRU + TTL, the default) and the Redis/Valkey one (``redis.asyncio``, a pool shared with the Redis
KV index, automatic fallback to memory) implement it. Every method is bounded in time: a store never makes a
request wait longer than its command timeout; a failure is reported as ``CacheStoreError`` (the caller treats it
as a miss), never raised from the request path unhandled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from picker.config import ResponseCacheConfig


class CacheStoreError(Exception):
    """A store operation failed (Redis down, timed out, ...): a miss for the caller."""


@dataclass(frozen=True, slots=True)
class CacheStoreStats:
    """What /admin/response-cache/stats shows of the store."""

    backend: str  # "memory" | "redis"
    entries: int | None  # None when the store cannot count cheaply (Redis)
    hits: int
    misses: int
    errors: int
    fallback_active: bool = False
    connected: bool | None = None  # Redis: the last command or health check reached it; memory: None


class CacheStore(Protocol):
    """Bytes by key with a TTL. Keys are the caller's (the Redis store adds its ``key_prefix``)."""

    async def get(self, key: str) -> bytes | None: ...

    async def set(self, key: str, value: bytes, ttl_seconds: float) -> None: ...

    async def delete(self, key: str) -> None: ...

    async def clear(self) -> None: ...

    def stats(self) -> CacheStoreStats: ...

    @property
    def fallback_active(self) -> bool:
        """A Redis store is answering from its in-memory fallback (Redis unreachable); never for memory."""
        ...

    async def aclose(self) -> None:
        """Stop what the store runs in the background (the Redis store's health monitor); at stop."""
        ...

    def configure(self, cfg: ResponseCacheConfig) -> None:
        """Apply the hot-reloadable keys the store reads (memory: ``capacity``; Redis: none, its connection is
        restart-required)."""
        ...
