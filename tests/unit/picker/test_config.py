import subprocess
import sys
from pathlib import Path

import pytest

from picker.config import (
    ConfigError,
    config_warnings,
    load_settings,
    parse_settings,
    restart_required_changes,
)


def test_defaults_follow_the_seed() -> None:
    s = parse_settings({})
    pr, kv = s.prefix_routing, s.kv_cache_index
    assert (pr.enabled, pr.max_prefix_length, pr.load_factor_epsilon, pr.virtual_nodes) == (
        False,
        1024,
        0.25,
        150,
    )
    assert (kv.enabled, kv.backend, kv.max_entries, kv.entry_ttl_seconds) == (False, "memory", 100_000, 600)
    sc = kv.scoring
    assert (sc.overlap_weight, sc.load_weight, sc.health_weight, sc.min_overlap_threshold) == (
        0.6,
        0.3,
        0.1,
        0.3,
    )
    assert (sc.gpu_tier_weight, sc.storage_tier_weight) == (1.0, 0.6)
    assert kv.storage_offloading.treat_eviction_as_offload is True
    assert s.admin.host == "127.0.0.1"


@pytest.mark.parametrize(
    ("data", "path"),
    [
        ({"prefix_routing": {"virtual_nodes": 0}}, "prefix_routing.virtual_nodes"),
        ({"prefix_routing": {"load_factor_epsilon": 20}}, "prefix_routing.load_factor_epsilon"),
        ({"prefix_routing": {"typo_key": 1}}, "prefix_routing.typo_key"),
        ({"selection_strategy": "Fastest"}, "selection_strategy"),
        ({"kv_cache_index": {"max_entries": 5}}, "kv_cache_index.max_entries"),
        ({"kv_cache_index": {"scoring": {"load_weight": 0.5}}}, "kv_cache_index.scoring"),
        ({"pool": {"backends": [{"name": "ok", "address": "nohostport"}]}}, "pool.backends[0].address"),
        ({"pool": {"backends": [{"name": "bad name!", "address": "1.2.3.4:5"}]}}, "pool.backends[0].name"),
        (
            {"pool": {"backends": [{"name": "a", "address": "1.2.3.4:5"}, {"name": "a", "address": "1.2.3.4:6"}]}},
            "pool",
        ),
        ({"unknown_section": {}}, "unknown_section"),
        ({"flow_control": {"bands": {"10": {"saturation_limit": 4.5}}}}, "flow_control.bands.10.saturation_limit"),
        ({"pool": {"backends": [{"name": "g", "type": "gemini", "api_key_file": "/k"}]}}, "pool.backends[0].models"),
        (
            {
                "pool": {
                    "backends": [
                        {
                            "name": "g",
                            "type": "gemini",
                            "api_key_file": "/k",
                            "models": ["m"],
                            "base_url": "http://127.0.0.1:1",
                        }
                    ]
                }
            },
            "pool.backends[0]",
        ),
        ({"pool": {"backends": [{"name": "a", "type": "tpu", "address": "1.2.3.4:5"}]}}, "pool.backends[0].type"),
        (
            {
                "pool": {
                    "backends": [
                        {"name": f"g{i}", "type": "gemini", "api_key_file": "/k", "models": ["m"]} for i in range(2)
                    ]
                }
            },
            "pool",
        ),
        ({"gemini_context_cache": {"ttl": "30s"}}, "gemini_context_cache.ttl"),
        ({"gemini_context_cache": {"min_prefix_bytes": 100}}, "gemini_context_cache.min_prefix_bytes"),
    ],
)
def test_bad_keys_are_refused_with_their_path(data: dict, path: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_settings(data)
    assert path in [p for p, _ in exc.value.problems], exc.value.problems


def test_environment_overrides_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("prefix_routing:\n  enabled: true\n  virtual_nodes: 10\n")
    monkeypatch.setenv("KV_EPP_PREFIX_ROUTING__VIRTUAL_NODES", "20")
    s = load_settings(f)
    assert s.prefix_routing.enabled is True and s.prefix_routing.virtual_nodes == 20


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        load_settings(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [unclosed")
    with pytest.raises(ConfigError):
        load_settings(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42")
    with pytest.raises(ConfigError):
        load_settings(scalar)


def test_seed_warnings() -> None:
    w = dict(config_warnings(parse_settings({"selection_strategy": "PrefixAwareHash"})))
    assert "selection_strategy" in w
    w = dict(
        config_warnings(
            parse_settings(
                {
                    "prefix_routing": {"enabled": True},
                    "kv_cache_index": {"enabled": True, "scoring": {"gpu_tier_weight": 0.2}},
                }
            )
        )
    )
    assert "kv_cache_index.scoring.gpu_tier_weight" in w


@pytest.mark.parametrize(
    ("data", "path", "area"),
    [
        (
            {"kv_cache_index": {"storage_offloading": {"enabled": True}}},
            "kv_cache_index.storage_offloading.enabled",
            "(Tier 4 storage tiers)",
        ),
        (
            {"kv_cache_index": {"storage_offloading": {"treat_eviction_as_offload": False}}},
            "kv_cache_index.storage_offloading.treat_eviction_as_offload",
            "(Tier 4 storage tiers)",
        ),
    ],
)
def test_keys_that_do_nothing_yet_are_accepted_with_a_warning(data: dict, path: str, area: str) -> None:
    """Issue 7: these were accepted silently (or, for redis, offered and then refused)."""
    w = dict(config_warnings(parse_settings(data)))
    assert w[path].startswith("accepted, not implemented yet " + area), w


def test_the_redis_kv_index_is_no_longer_warned_about() -> None:
    """Issue 11: kv_cache_index.backend redis builds the RedisKvIndex on response_cache.redis's pool."""
    w = dict(config_warnings(parse_settings({"kv_cache_index": {"backend": "redis"}})))
    assert "kv_cache_index.backend" not in w


def test_defaults_give_no_not_implemented_warning() -> None:
    assert not [p for p, m in config_warnings(parse_settings({})) if "not implemented" in m]


def test_restart_required_sections() -> None:
    a = parse_settings({})
    b = parse_settings({"extproc": {"port": 1234}, "selection_strategy": "Random"})
    assert restart_required_changes(a, b) == ["extproc"]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "picker", *args], capture_output=True, text=True, timeout=60)


def test_cli_validate(tmp_path: Path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text("selection_strategy: PrefixAwareHash\n")
    r = run_cli("config", "validate", str(good))
    assert r.returncode == 0 and "warning: selection_strategy:" in r.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("prefix_routing:\n  virtual_nodes: -1\n")
    r = run_cli("config", "validate", str(bad))
    assert r.returncode == 2 and "error: prefix_routing.virtual_nodes:" in r.stderr


def test_reload_survives_files_that_are_not_config(tmp_path: Path) -> None:
    """Found in review: non-string YAML keys or non-UTF-8 bytes raised out of reload() and ended the watcher."""
    from picker.runtime.compose import build_app

    f = tmp_path / "c.yaml"
    f.write_text("prefix_routing:\n  enabled: true\n")
    app = build_app(load_settings(f), config_path=f)
    for bad in (b"1: x\n", b"\xff\xfe\x00garbage"):
        f.write_bytes(bad)
        applied, messages = app.reload()
        assert applied is False and messages
    assert app.settings.prefix_routing.enabled is True  # the old config stays


def test_an_embedding_timeout_past_envoys_message_timeout_is_warned_about() -> None:
    def warned(ms: int) -> bool:
        semantic = {"enabled": True, "backend": "http://e:80", "embedding_model": "m", "embedding_timeout_ms": ms}
        w = dict(config_warnings(parse_settings({"response_cache": {"enabled": True, "semantic": semantic}})))
        return "response_cache.semantic.embedding_timeout_ms" in w

    assert warned(8000) and not warned(2000)


def test_ipv6_addresses_are_canonical_so_the_served_endpoint_matches() -> None:
    s = parse_settings({"pool": {"backends": [{"name": "a", "address": "[0:0:0:0:0:0:0:1]:08000"}]}})
    assert s.pool.engines[0].address == "[::1]:8000"  # what Envoy reports as the endpoint that served
    with pytest.raises(ConfigError, match="duplicate backend addresses"):
        parse_settings(
            {"pool": {"backends": [{"name": "a", "address": "[::1]:80"}, {"name": "b", "address": "[0::1]:80"}]}}
        )


def test_gemini_backends_sit_beside_engines_and_beside_a_discovered_pool() -> None:
    gemini = {"name": "gemini", "type": "gemini", "api_key_file": "/run/key", "models": ["gemini-2.5-flash"]}
    s = parse_settings({"pool": {"backends": [{"name": "a", "address": "10.0.0.1:80"}, gemini]}})
    assert [b.name for b in s.pool.engines] == ["a"] and [b.name for b in s.pool.gemini] == ["gemini"]
    g = s.pool.gemini[0]
    assert (g.host, g.port, g.tls) == ("generativelanguage.googleapis.com", 443, True)
    d = parse_settings({"pool": {"backends": [gemini], "backends_file": {"path": "/tmp/b.yaml"}}})
    assert d.pool.discovered and not d.pool.engines
    local = {**gemini, "base_url": "http://127.0.0.1:8080", "allow_insecure": True}
    assert parse_settings({"pool": {"backends": [local]}}).pool.gemini[0].port == 8080
    assert parse_settings({"gemini_context_cache": {"ttl": "2m"}}).gemini_context_cache.ttl_seconds == 120.0
