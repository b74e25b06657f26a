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
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.exceptions import ClusterError, MaxConnectionsError, RedisClusterException, RedisError, SlotNotCoveredError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from picker.config import RedisConfig, host_port, redis_mode_problems

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


# A client of any mode: ``Redis`` (single, sentinel) or ``RedisCluster`` (cluster). Both take the same commands
# the picker sends (single-key ones, single-slot transactions and scripts); see docs/picker.md, "Redis modes".
RedisClient = Redis | RedisCluster

# What a call to Redis may raise, whatever the mode: redis-py's errors, its cluster errors (RedisClusterException
# is not a RedisError: "slots not covered", a redirect loop), the socket's, and a timeout.
REDIS_FAILURES: tuple[type[BaseException], ...] = (RedisError, RedisClusterException, OSError, TimeoutError)


def failure_kind(exc: BaseException) -> str:
    """``timeout``, ``connection`` (both: an outage) or ``other`` (an error reply from a Redis that answers, or
    this client's own pool being full). A cluster without a primary for a slot (``CLUSTERDOWN``, a slot not
    covered, a failover in progress) is an outage, like a refused connection."""
    if isinstance(exc, RedisTimeoutError | TimeoutError):
        return "timeout"
    if isinstance(exc, MaxConnectionsError):  # every connection of the pool in use: not the server's outage
        return "other"
    if isinstance(exc, RedisConnectionError | ConnectionError | OSError | ClusterError):
        return "connection"
    if isinstance(exc, SlotNotCoveredError) or type(exc) is RedisClusterException:
        return "connection"  # the slot map could not be had (every startup node failed) or misses slots
    return "other"


def build_redis(
    cfg: RedisConfig, *, socket_timeout_s: float | None = None, max_connections: int | None = None
) -> RedisClient:
    """A new client of ``cfg.mode`` with its own connections (prefer ``shared_redis``): at most
    ``max_connections`` (default ``cfg.pool_size``; in cluster mode per node), each read waiting at most
    ``socket_timeout_s`` (default the command timeout). The overrides are for a dedicated client (the shared load
    view's, whose XREAD blocks longer than a command may). ValueError on a bad config (the key's path first)."""
    problems = redis_mode_problems(cfg)
    if problems:
        raise ValueError("; ".join(f"{path}: {why}" for path, why in problems))
    endpoint = redis_endpoint(cfg)  # refuse a URL redis-py would misread
    command_s = cfg.command_timeout_ms / 1000
    socket_s = command_s if socket_timeout_s is None else socket_timeout_s
    size = cfg.pool_size if max_connections is None else max_connections
    if cfg.mode == "cluster":
        return _build_cluster(cfg, endpoint, socket_s, size)
    if cfg.mode == "sentinel":
        return _build_sentinel(cfg, endpoint, socket_s, size)
    pool = FastBlockingPool.from_url(
        effective_url(cfg),
        max_connections=size,
        timeout=command_s,  # the wait for a free connection
        socket_connect_timeout=cfg.connect_timeout_ms / 1000,
        socket_timeout=socket_s,
        # one immediate retry on a connection error (a pooled connection a restarted Redis closed: redis-py
        # notices only when it uses it); never on a timeout; both tries within the store's command timeout
        retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
    )
    return Redis(connection_pool=pool)


# cluster mode: tries of a command after a connection error, a timeout or CLUSTERDOWN, each after a fresh slot
# map (CLUSTER SLOTS); MOVED and ASK are followed apart from these (redis-py's redirect budget). The callers
# bound the whole call by the command timeout (asyncio.timeout), so a failover costs a request at most that.
CLUSTER_RETRIES = 2
CLUSTER_BACKOFF_CAP_S = 0.05  # the pause between tries: 10 ms, 20 ms, at most this


class PickerRedisCluster(RedisCluster):
    """``RedisCluster`` with two guards (docs/picker.md, "Redis modes"):

    - at most ``concurrency`` commands at once: a caller beyond it waits, as single mode's blocking pool makes it
      (redis-py's cluster pool fails at once when a node's connections are all in use; the KV index lives on one
      node); the caller's own timeout bounds the wait;
    - an error of redis-py's own making (not a Redis error: an ASK to a node its slot map does not have yet raised
      AttributeError in redis-py 8.1) refreshes the slot map before the next command and is raised as a
      ``ClusterError``: an outage the callers fall back from, never an exception on the request path."""

    def __init__(self, *args: Any, concurrency: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._commands = asyncio.Semaphore(concurrency)  # bound to the loop of its first wait (the client's)

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        async with self._commands:
            try:
                return await super().execute_command(*args, **kwargs)
            except (RedisError, RedisClusterException, OSError, TimeoutError):
                raise
            except Exception as exc:
                self._initialize = True  # the next command asks the cluster for its slot map first
                raise ClusterError(f"redis-py failed on the cluster's answer: {exc!r}") from exc


def _build_cluster(cfg: RedisConfig, endpoint: RedisEndpoint, socket_s: float, size: int) -> RedisCluster:
    startup = [ClusterNode(host, port) for host, port in map(host_port, cfg.startup_nodes)]
    return PickerRedisCluster(
        concurrency=size,
        # the configured seeds stay the seeds: a cluster whose every node moved (pods recreated behind one Service
        # name) is found again through them, not through the addresses it had
        dynamic_startup_nodes=False,
        host=endpoint.host,
        port=endpoint.port,
        startup_nodes=startup or None,
        username=endpoint.username,
        password=_password(cfg),
        ssl=endpoint.tls,
        socket_timeout=socket_s,
        socket_connect_timeout=cfg.connect_timeout_ms / 1000,
        max_connections=size,  # per node; beyond it a command fails at once (MaxConnectionsError, not an outage)
        retry=Retry(ExponentialBackoff(cap=CLUSTER_BACKOFF_CAP_S, base=0.01), CLUSTER_RETRIES),
        require_full_coverage=True,  # a slot map with a hole is refused (retried) rather than used
    )


class BlockingSentinelPool(SentinelConnectionPool, BlockingConnectionPool):
    """redis-py's Sentinel pool (it asks the sentinels where the primary is at each new connection and drops its
    connections when the primary moved) with the blocking pool's bound: a caller beyond ``max_connections``
    waits for a free connection (at most ``timeout``) rather than failing at once."""


def _build_sentinel(cfg: RedisConfig, endpoint: RedisEndpoint, socket_s: float, size: int) -> Redis:
    connect_s = cfg.connect_timeout_ms / 1000
    command_s = cfg.command_timeout_ms / 1000
    sentinel = Sentinel(
        [host_port(s) for s in cfg.sentinels],
        min_other_sentinels=0,
        # the sentinels themselves: no credentials (the URL's are the data nodes'), the same timeouts
        sentinel_kwargs={"socket_timeout": command_s, "socket_connect_timeout": connect_s},
        socket_timeout=socket_s,
        socket_connect_timeout=connect_s,
        username=endpoint.username,
        password=_password(cfg),
        db=endpoint.db,
        ssl=endpoint.tls,
        retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
    )
    client: Redis = sentinel.master_for(
        cfg.sentinel_master,
        redis_class=Redis,
        connection_pool_class=BlockingSentinelPool,
        max_connections=size,
        timeout=command_s,  # the wait for a free connection
    )
    return client


def _password(cfg: RedisConfig) -> str | None:
    try:
        password = urlsplit(cfg.url).password
    except ValueError:
        return None
    return unquote(password) if password is not None else None


async def ping_redis(client: RedisClient) -> Any:
    """One PING that says whether the picker's Redis can be used: on a cluster, every primary's (a slot whose
    primary is down makes the cluster unusable here: ``cluster-require-full-coverage``, and the KV index's one
    slot may be any of them)."""
    if isinstance(client, RedisCluster):
        return await client.ping(target_nodes=RedisCluster.PRIMARIES)
    return await client.ping()


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


PoolKey = tuple[str, int, int, int, str, tuple[str, ...], str, tuple[str, ...]]


def _pool_key(cfg: RedisConfig) -> PoolKey:
    return (
        effective_url(cfg),
        cfg.pool_size,
        cfg.connect_timeout_ms,
        cfg.command_timeout_ms,
        cfg.mode,
        tuple(cfg.sentinels),
        cfg.sentinel_master,
        tuple(cfg.startup_nodes),
    )


class SharedRedis:
    """Clients by connection settings and event loop (a ``redis.asyncio`` pool belongs to the loop it runs on).
    Bound: one client per distinct setting per loop; a process has one setting (``response_cache.redis`` is
    restart-required), tests a few."""

    def __init__(self) -> None:
        # the loop by weak reference: a closed test loop is not kept alive, and its id may then be reused
        self._clients: dict[tuple[int, PoolKey], tuple[Callable[[], object], RedisClient]] = {}

    def client(self, cfg: RedisConfig) -> RedisClient:
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
                    if isinstance(client, RedisCluster):
                        await client.aclose()
                    else:
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
_HEALTH: weakref.WeakKeyDictionary[RedisClient, RedisHealth] = weakref.WeakKeyDictionary()


def redis_health(client: RedisClient) -> RedisHealth:
    """The outage state shared by every user of ``client`` (created at the first call)."""
    health = _HEALTH.get(client)
    if health is None:
        health = _HEALTH[client] = RedisHealth()
    return health


SHARED = SharedRedis()


def shared_redis(cfg: RedisConfig) -> RedisClient:
    """The process's client (connection pool) for ``cfg``: the response cache and the Redis KV index call this."""
    return SHARED.client(cfg)


async def close_shared_redis() -> None:
    """Close the shared pools (at the picker's stop)."""
    await SHARED.aclose()
