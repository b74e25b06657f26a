"""The shared Redis pool without a server: how a URL is read (and refused), that the display form never carries the
password, the client's pool options, one client per setting per event loop, and the shared outage state."""

from __future__ import annotations

import asyncio
import gc

import pytest
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from picker.config import RedisConfig
from picker.redis_pool import (
    FastBlockingPool,
    RedisEndpoint,
    RedisHealth,
    SharedRedis,
    build_redis,
    effective_url,
    redis_endpoint,
    redis_health,
)


def cfg(url: str = "redis://127.0.0.1:6379", **extra: object) -> RedisConfig:
    return RedisConfig(url=url, **extra)


def test_tls_turns_redis_into_rediss_and_leaves_rediss_alone() -> None:
    assert effective_url(cfg("redis://h:1/2", tls=True)) == "rediss://h:1/2"
    assert effective_url(cfg("rediss://h:1/2", tls=True)) == "rediss://h:1/2"
    assert effective_url(cfg("redis://h:1/2")) == "redis://h:1/2"
    assert redis_endpoint(cfg("redis://h", tls=True)).tls and not redis_endpoint(cfg("redis://h")).tls


def test_the_url_parts_with_their_defaults() -> None:
    assert redis_endpoint(cfg("redis://cache.local")) == RedisEndpoint("cache.local", 6379, 0, False, None, False)
    assert redis_endpoint(cfg("rediss://alice:pw@10.1.2.3:6380/7")) == RedisEndpoint(
        "10.1.2.3", 6380, 7, True, "alice", True
    )
    assert redis_endpoint(cfg("redis://h/")).db == 0  # an empty path is database 0
    only_password = redis_endpoint(cfg("redis://:s3cret@h:1"))
    assert only_password.username is None and only_password.has_password
    assert redis_endpoint(cfg("redis://us%3Aer@h")).username == "us:er"  # percent-decoded


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("redis://h:abc", "bad port in 'redis://h:abc'"),
        ("redis://h:99999", "bad port in 'redis://h:99999'"),
        ("redis://:pw@/1", "no host in"),
        ("redis://h/x", "the path must be a database number, not 'x'"),
        ("redis://h/0/1", "the path must be a database number, not '0/1'"),
    ],
)
def test_a_url_redis_py_would_misread_is_refused_naming_the_problem(url: str, says: str) -> None:
    with pytest.raises(ValueError, match=r"^response_cache\.redis\.url: ") as err:
        redis_endpoint(cfg(url))
    assert says in str(err.value)
    with pytest.raises(ValueError):
        build_redis(cfg(url))  # no client is built from it either


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("redis://u:hunter2@h:abc", "bad port in 'redis://u:***@h:abc'"),
        ("redis://u:hunter2@h:99999", "bad port in 'redis://u:***@h:99999'"),
        ("redis://u:hunter2@/1", "no host in 'redis://u:***@/1'"),
        ("redis://:hunter%32@:1", "no host in 'redis://:***@:1'"),  # percent-encoded: redacted as written
    ],
)
def test_a_refused_url_is_echoed_without_its_password(url: str, says: str) -> None:
    with pytest.raises(ValueError) as err:
        redis_endpoint(cfg(url))
    assert says in str(err.value)
    assert "hunter" not in str(err.value)


def test_the_display_form_names_user_host_port_and_db_never_the_password() -> None:
    shown = redis_endpoint(cfg("redis://alice:hunter2@h:6390/4", tls=True)).display()
    assert shown == "rediss://alice@h:6390/4" and "hunter2" not in shown
    assert redis_endpoint(cfg("redis://:hunter2@h")).display() == "redis://h:6379/0"


async def test_the_client_pool_is_bounded_by_the_config_and_retries_only_connection_errors() -> None:
    client = build_redis(cfg("redis://u:pw@h:7/3", pool_size=5, command_timeout_ms=250, connect_timeout_ms=100))
    try:
        pool = client.connection_pool
        assert isinstance(pool, FastBlockingPool) and pool.fast  # the fast path recognises this redis-py
        assert pool.max_connections == 5 and pool.timeout == 0.25  # the wait for a free connection
        kw = pool.connection_kwargs
        assert (kw["host"], kw["port"], kw["db"], kw["username"], kw["password"]) == ("h", 7, 3, "u", "pw")
        assert (kw["socket_connect_timeout"], kw["socket_timeout"]) == (0.1, 0.25)
        retry = kw["retry"]
        assert retry._retries == 1 and tuple(retry._supported_errors) == (RedisConnectionError,)
    finally:
        await client.aclose(close_connection_pool=True)


async def test_the_fast_path_gives_a_connection_back_when_its_check_fails() -> None:
    client = build_redis(cfg(pool_size=2))
    pool = client.connection_pool
    assert isinstance(pool, FastBlockingPool)
    conn = pool.make_connection()  # not connected: no server is touched
    pool._available_connections.append(conn)

    async def refused(c: object) -> None:
        raise RedisConnectionError("refused")

    pool.ensure_connection = refused  # type: ignore[method-assign]
    with pytest.raises(RedisConnectionError):
        await pool.get_connection()
    assert pool._available_connections == [conn] and not pool._in_use_connections
    await client.aclose(close_connection_pool=True)


async def test_one_client_per_setting_on_a_loop_and_closing_forgets_them() -> None:
    shared = SharedRedis()
    a = shared.client(cfg(pool_size=4))
    assert shared.client(cfg(pool_size=4)) is a
    assert shared.client(cfg(pool_size=4, key_prefix="other:")) is a  # not a connection setting
    assert shared.client(cfg(pool_size=8)) is not a
    assert shared.client(cfg(pool_size=4, tls=True)) is not a
    assert shared.client(cfg(pool_size=4, command_timeout_ms=999)) is not a
    await shared.aclose()
    assert shared.client(cfg(pool_size=4)) is not a  # a closed client is never handed out again
    await shared.aclose()


def test_each_event_loop_gets_its_own_client() -> None:
    shared = SharedRedis()

    async def get() -> Redis:
        return shared.client(cfg())

    loop1, loop2 = asyncio.new_event_loop(), asyncio.new_event_loop()
    try:
        first = loop1.run_until_complete(get())
        assert loop1.run_until_complete(get()) is first
        assert loop2.run_until_complete(get()) is not first
        assert shared.client(cfg()) is not first  # outside any loop: yet another
        assert shared.client(cfg()) is shared.client(cfg())
        loop2.run_until_complete(shared.aclose())  # closes loop2's, forgets every other
        assert loop1.run_until_complete(get()) is not first
    finally:
        loop1.close()
        loop2.close()


class User:
    def __init__(self) -> None:
        self.woken = 0

    def wake(self) -> None:
        self.woken += 1


def test_an_outage_is_reported_once_and_its_end_wakes_the_listeners() -> None:
    h = RedisHealth()
    store, index = User(), User()
    h.on_answered(store.wake)
    h.on_answered(index.wake)
    h.answered()  # not down: nobody is woken
    assert (store.woken, index.woken) == (0, 0)
    h.outage("store", "timeout")
    h.outage("index", "refused")  # already down: the first report stands
    assert h.down and (h.reported_by, h.reason, h.outages) == ("store", "timeout", 1)
    assert h.as_json() == {"down": True, "reported_by": "store", "outages": 1}
    h.answered()
    assert (store.woken, index.woken) == (1, 1) and h.as_json() == {"down": False, "reported_by": None, "outages": 1}
    h.outage("index", "reset")
    assert h.outages == 2 and h.reported_by == "index"


def test_a_listener_does_not_keep_its_user_alive() -> None:
    h = RedisHealth()
    gone, kept = User(), User()
    h.on_answered(gone.wake)
    del gone
    gc.collect()
    h.on_answered(kept.wake)  # registering prunes the dead one
    assert len(h._listeners) == 1
    h.outage("store", "timeout")
    h.answered()
    assert kept.woken == 1


async def test_every_user_of_a_client_shares_its_outage_state() -> None:
    a, b = build_redis(cfg()), build_redis(cfg())
    try:
        assert redis_health(a) is redis_health(a)
        assert redis_health(a) is not redis_health(b)
        redis_health(a).outage("store", "timeout")
        assert redis_health(a).down and not redis_health(b).down
    finally:
        await a.aclose(close_connection_pool=True)
        await b.aclose(close_connection_pool=True)


# --- modes (docs/picker.md, "Redis modes: single, Sentinel, Cluster")


@pytest.mark.parametrize(
    ("data", "path"),
    [
        ({"mode": "sentinel"}, "response_cache.redis.sentinels"),  # required with mode sentinel
        ({"sentinels": ["h:26379"]}, "response_cache.redis.sentinels"),  # only read with mode sentinel
        ({"startup_nodes": ["h:7000"]}, "response_cache.redis.startup_nodes"),  # only read with mode cluster
        ({"mode": "cluster", "url": "redis://h:7000/2"}, "response_cache.redis.url"),  # db 0 only
        ({"mode": "sentinel", "sentinels": ["h"]}, "response_cache.redis.sentinels"),  # not host:port (the value named)
        ({"mode": "cluster", "startup_nodes": ["h:99999"]}, "response_cache.redis.startup_nodes"),
        ({"mode": "replicated"}, "response_cache.redis.mode"),
    ],
)
def test_a_bad_mode_config_is_refused_with_the_path_of_the_bad_key(data: dict[str, object], path: str) -> None:
    from picker.config import ConfigError, parse_settings

    with pytest.raises(ConfigError) as exc:
        parse_settings({"response_cache": {"redis": data}})
    assert path in str(exc.value), str(exc.value)


def test_good_mode_configs_are_accepted() -> None:
    from picker.config import parse_settings

    s = parse_settings(
        {"response_cache": {"redis": {"mode": "cluster", "url": "redis://h:7000", "startup_nodes": ["h2:7001"]}}}
    )
    assert s.response_cache.redis.mode == "cluster" and s.response_cache.redis.startup_nodes == ["h2:7001"]
    s = parse_settings({"response_cache": {"redis": {"mode": "sentinel", "sentinels": ["[::1]:26379", "s:26379"]}}})
    assert s.response_cache.redis.sentinel_master == "mymaster"
    assert parse_settings({}).response_cache.redis.mode == "single"


def test_build_redis_refuses_a_bad_mode_config_built_without_the_loader() -> None:
    with pytest.raises(ValueError, match=r"response_cache\.redis\.sentinels"):
        build_redis(cfg(mode="sentinel"))


async def test_single_mode_overrides_socket_timeout_and_max_connections() -> None:
    client = build_redis(cfg(pool_size=8, command_timeout_ms=250), socket_timeout_s=5.0, max_connections=2)
    try:
        pool = client.connection_pool
        assert isinstance(pool, FastBlockingPool) and pool.max_connections == 2
        assert pool.connection_kwargs["socket_timeout"] == 5.0 and pool.timeout == 0.25
    finally:
        await client.aclose(close_connection_pool=True)


async def test_cluster_mode_builds_a_cluster_client_from_the_url_and_the_startup_nodes() -> None:
    from redis.asyncio.cluster import RedisCluster

    from picker.redis_pool import CLUSTER_RETRIES

    client = build_redis(
        cfg("redis://u:pw@h1:7000", mode="cluster", startup_nodes=["h2:7001"], pool_size=4, command_timeout_ms=300)
    )
    try:
        assert isinstance(client, RedisCluster)  # no connection is opened before the first command
        assert {n.name for n in client.startup_nodes} == {"h1:7000", "h2:7001"}
        kw = client.connection_kwargs
        assert (kw["username"], kw["password"], kw["max_connections"], kw["socket_timeout"]) == ("u", "pw", 4, 0.3)
        assert client.retry.get_retries() == CLUSTER_RETRIES
    finally:
        await client.aclose()


async def test_sentinel_mode_builds_a_blocking_sentinel_pool_with_the_urls_credentials() -> None:
    from picker.redis_pool import BlockingSentinelPool

    client = build_redis(
        cfg("rediss://u:p%40ss@ignored:1/2", mode="sentinel", sentinels=["s1:26379", "s2:26380"], pool_size=3),
        max_connections=2,
    )
    try:
        pool = client.connection_pool
        assert isinstance(pool, BlockingSentinelPool) and pool.max_connections == 2
        assert pool.service_name == "mymaster"
        kw = pool.connection_kwargs
        assert (kw["username"], kw["password"], kw["db"]) == ("u", "p@ss", 2)
        assert "SSL" in pool.connection_class.__name__
        assert [(c.connection_pool.connection_kwargs["host"]) for c in pool.sentinel_manager.sentinels] == ["s1", "s2"]
    finally:
        await client.aclose(close_connection_pool=True)


def test_failure_kinds_cluster_errors_are_outages_a_full_pool_is_not() -> None:
    from redis.exceptions import (
        ClusterDownError,
        MaxConnectionsError,
        RedisClusterException,
        ResponseError,
        SlotNotCoveredError,
    )
    from redis.exceptions import TimeoutError as RedisTimeoutError

    from picker.redis_pool import failure_kind

    assert failure_kind(ClusterDownError("CLUSTERDOWN")) == "connection"
    assert failure_kind(SlotNotCoveredError("no slot")) == "connection"
    assert failure_kind(RedisClusterException("Redis Cluster cannot be connected")) == "connection"
    assert failure_kind(RedisConnectionError("refused")) == "connection"
    assert failure_kind(RedisTimeoutError()) == "timeout" and failure_kind(TimeoutError()) == "timeout"
    assert failure_kind(MaxConnectionsError()) == "other"
    assert failure_kind(ResponseError("OOM")) == "other"
