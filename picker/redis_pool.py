"""The one Redis/Valkey connection pool of a picker process, shared by the response cache's store and the Redis KV
index (``shared_redis``, ``close_shared_redis``), with one outage state per client (``redis_health``) and a fast
path through redis-py's blocking pool.
See docs/picker.md, "The shared Redis pool".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

from picker.config import RedisConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RedisEndpoint:
    """Where a ``RedisConfig`` connects, for logs and the admin JSON (no password)."""

    host: str
    port: int
    db: int
    tls: bool
    username: str | None
    has_password: bool

    def display(self) -> str:
        user = f"{self.username}@" if self.username else ""
        return f"{'rediss' if self.tls else 'redis'}://{user}{self.host}:{self.port}/{self.db}"


def effective_url(cfg: RedisConfig) -> str:
    """The URL redis-py connects with: ``tls: true`` turns ``redis://`` into ``rediss://``."""
    if cfg.tls and cfg.url.startswith("redis://"):
        return "rediss://" + cfg.url[len("redis://") :]
    return cfg.url


def redis_secrets(cfg: RedisConfig) -> tuple[str, ...]:
    """The URL's password, as written and percent-decoded (what an error text could echo)."""
    try:
        password = urlsplit(cfg.url).password
    except ValueError:
        return ()
    if not password:
        return ()
    return tuple({password, unquote(password)})


def redacted_url(cfg: RedisConfig) -> str:
    """The configured URL as written, every occurrence of its password replaced by ``***`` (for an error text)."""
    url = cfg.url
    for secret in sorted(redis_secrets(cfg), key=len, reverse=True):
        url = url.replace(secret, "***")
    return url


def redis_endpoint(cfg: RedisConfig) -> RedisEndpoint:
    """Parse the URL (``redis[s]://[user[:password]@]host[:port][/db]``); ValueError names what is wrong."""
    url = effective_url(cfg)
    parts = urlsplit(url)
    try:
        port = parts.port or 6379
    except ValueError as exc:
        raise ValueError(f"response_cache.redis.url: bad port in {redacted_url(cfg)!r} ({exc})") from None
    if not parts.hostname:
        raise ValueError(f"response_cache.redis.url: no host in {redacted_url(cfg)!r}")
    path = parts.path.strip("/")
    if path and not path.isdigit():
        raise ValueError(f"response_cache.redis.url: the path must be a database number, not {path!r}")
    return RedisEndpoint(
        host=parts.hostname,
        port=port,
        db=int(path) if path else 0,
        tls=parts.scheme == "rediss",
        username=unquote(parts.username) if parts.username else None,
        has_password=parts.password is not None,
    )


def build_redis(
    cfg: RedisConfig, *, socket_timeout_s: float | None = None, max_connections: int | None = None
) -> Redis:
    """A new client with its own pool of ``cfg.pool_size`` connections (prefer ``shared_redis``). The overrides
    are for a dedicated client (the shared load view's, whose XREAD blocks longer than a command may)."""
    redis_endpoint(cfg)  # refuse a URL redis-py would misread
    command_s = cfg.command_timeout_ms / 1000
    pool = FastBlockingPool.from_url(
        effective_url(cfg),
        max_connections=max_connections or cfg.pool_size,
        timeout=command_s,  # the wait for a free connection
        socket_connect_timeout=cfg.connect_timeout_ms / 1000,
        socket_timeout=socket_timeout_s if socket_timeout_s is not None else command_s,
        # one immediate retry on a connection error (a pooled connection a restarted Redis closed: redis-py
        # notices only when it uses it); never on a timeout; both tries within the store's command timeout
        retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
    )
    return Redis(connection_pool=pool)


class FastBlockingPool(BlockingConnectionPool):
    """``BlockingConnectionPool`` with a fast path for the common case (docs/picker.md, "The shared Redis pool").
    Bound: the same ``max_connections``; a caller beyond it waits (redis-py's path) at most the pool's timeout."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fast = (
            isinstance(getattr(self, "_available_connections", None), list)
            and isinstance(getattr(self, "_in_use_connections", None), set)
            and hasattr(getattr(self, "_condition", None), "_waiters")
            and isinstance(getattr(self, "_in_maintenance", None), bool)
        )

    def _uncontended(self) -> bool:
        return self.fast and not self._condition._waiters and not self._in_maintenance

    async def get_connection(self, command_name: Any = None, *keys: Any, **options: Any) -> Any:
        if self._available_connections and self._uncontended():
            conn = self._available_connections.pop()
            self._in_use_connections.add(conn)
            try:
                await self.ensure_connection(conn)  # redis-py's check: reopened when dead or dirty
            except BaseException:
                await self.release(conn)
                raise
            return conn
        return await super().get_connection()

    async def release(self, connection: Any) -> None:
        if self._uncontended() and connection in self._in_use_connections:
            self._in_use_connections.remove(connection)
            if connection.should_reconnect():
                await connection.disconnect()
            self._available_connections.append(connection)
            return
        await super().release(connection)


def _pool_key(cfg: RedisConfig) -> tuple[str, int, int, int]:
    return (effective_url(cfg), cfg.pool_size, cfg.connect_timeout_ms, cfg.command_timeout_ms)


class SharedRedis:
    """Clients by connection settings and event loop (a ``redis.asyncio`` pool belongs to the loop it runs on).
    Bound: one client per distinct setting per loop; a process has one setting (``response_cache.redis`` is
    restart-required), tests a few."""

    def __init__(self) -> None:
        # the loop by weak reference: a closed test loop is not kept alive, and its id may then be reused
        self._clients: dict[tuple[int, tuple[str, int, int, int]], tuple[Callable[[], object], Redis]] = {}

    def client(self, cfg: RedisConfig) -> Redis:
        """The shared client for ``cfg`` on the running loop (created at the first call)."""
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        key = (id(loop), _pool_key(cfg))
        entry = self._clients.get(key)
        if entry is None or entry[0]() is not loop:
            owner: Callable[[], object] = weakref.ref(loop) if loop is not None else _none
            entry = self._clients[key] = (owner, build_redis(cfg))
        return entry[1]

    async def aclose(self) -> None:
        """Close every client of the running loop (their connections); forget those of other loops."""
        loop = asyncio.get_running_loop()
        clients, self._clients = self._clients, {}
        for owner, client in clients.values():
            if owner is _none or owner() is loop:
                with contextlib.suppress(Exception):
                    await client.aclose(close_connection_pool=True)


def _none() -> None:
    return None


class RedisHealth:
    """Whether one Redis (one client) is in an outage, as its users saw it. ``outage`` is called by a user that
    has just decided Redis is out (refused, reset, timed out, as its own policy says); ``answered`` by one whose
    PING or command succeeded. Users read ``down`` before a call on the request path and, while it is True,
    answer without Redis (their fallback). No I/O and no await: a flag, a reason and counters."""

    __slots__ = ("_listeners", "down", "outages", "reason", "reported_by", "since")

    def __init__(self) -> None:
        self.down = False
        self.reason: str | None = None
        self.reported_by: str | None = None
        self.since: float | None = None  # monotonic, the start of the current outage
        self.outages = 0
        # bound: the users of one client (the store, the index); weak, so a user (which holds the client, the
        # key of this state's entry) never keeps the client alive through its own listener
        self._listeners: list[weakref.WeakMethod[Callable[[], None]]] = []

    def on_answered(self, listener: Callable[[], None]) -> None:
        """Call the bound method ``listener`` (no I/O, no await: it wakes a task) each time an outage ends."""
        self._listeners = [w for w in self._listeners if w() is not None]
        self._listeners.append(weakref.WeakMethod(listener))

    def outage(self, who: str, reason: str) -> None:
        if self.down:
            return
        self.down, self.reason, self.reported_by, self.since = True, reason, who, time.monotonic()
        self.outages += 1
        log.info("event=redis_outage_shared reported_by=%s reason=%r", who, reason)

    def answered(self) -> None:
        if self.down:
            self.down = False
            log.info("event=redis_outage_over down_s=%.1f", time.monotonic() - (self.since or time.monotonic()))
            for ref in self._listeners:
                listener = ref()
                if listener is not None:
                    listener()

    def as_json(self) -> dict[str, object]:
        return {"down": self.down, "reported_by": self.reported_by if self.down else None, "outages": self.outages}


# bound: one entry per live client (weak keys: a closed, dropped client takes its entry with it)
_HEALTH: weakref.WeakKeyDictionary[Redis, RedisHealth] = weakref.WeakKeyDictionary()


def redis_health(client: Redis) -> RedisHealth:
    """The outage state shared by every user of ``client`` (created at the first call)."""
    health = _HEALTH.get(client)
    if health is None:
        health = _HEALTH[client] = RedisHealth()
    return health


SHARED = SharedRedis()


def shared_redis(cfg: RedisConfig) -> Redis:
    """The process's client (connection pool) for ``cfg``: the response cache and the Redis KV index call this."""
    return SHARED.client(cfg)


async def close_shared_redis() -> None:
    """Close the shared pools (at the picker's stop)."""
    await SHARED.aclose()
