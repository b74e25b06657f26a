"""A reload that changes restart-required keys of hot-reloadable sections: the running values stay in
``app.settings`` (what the admin endpoints describe), the section's other keys apply."""

from __future__ import annotations

from pathlib import Path

from picker.config import BackendConfig, PoolConfig, RedisConfig, ResponseCacheConfig, Settings
from picker.runtime.compose import build_app

RUNNING_REDIS = RedisConfig(url="redis://10.0.0.1:6379/0", key_prefix="run:")


def _settings(**rc: object) -> Settings:
    pool = PoolConfig(backends=(BackendConfig(name="sim-0", address="127.0.0.1:1"),))
    return Settings(pool=pool, response_cache=ResponseCacheConfig(**rc))  # type: ignore[arg-type]


def test_response_cache_backend_and_redis_keep_their_running_values() -> None:
    app = build_app(_settings(enabled=True, ttl=300, capacity=100, redis=RUNNING_REDIS))
    new = _settings(
        enabled=True, ttl=60, capacity=50, backend="redis",
        redis=RedisConfig(url="redis://10.0.0.2:6380/1", key_prefix="new:"),
    )  # fmt: skip
    messages = app.apply(new)
    assert "response_cache.backend: changed, restart required (not applied)" in messages
    assert "response_cache.redis: changed, restart required (not applied)" in messages
    rc = app.settings.response_cache
    assert (rc.backend, rc.redis) == ("memory", RUNNING_REDIS)  # what runs
    assert (rc.ttl, rc.capacity) == (60.0, 50)  # the section's hot keys applied
    assert app.apply(new) == messages  # still not applied: reported again


def test_the_pools_source_keeps_its_running_value(tmp_path: Path) -> None:
    app = build_app(_settings())
    listed = tmp_path / "backends.yaml"
    listed.write_text("backends: []\n")
    messages = app.apply(Settings(pool=PoolConfig(backends_file={"path": str(listed)})))  # type: ignore[arg-type]
    assert "pool.backends_file: changed, restart required (not applied)" in messages
    pool = app.settings.pool
    assert (pool.backends_file, pool.inference_pool, [b.name for b in pool.backends]) == (None, None, ["sim-0"])
    assert list(app.pool.names()) == ["sim-0"]
