"""Readiness that means something: started, not draining, no crashed task, the pool synced, and with Tier 4 every
live backend's feed caught up or stale; published to /readyz, the gRPC readiness services and a gauge when an
input changes (or a feed's grace ends), while ``kv-epp.accepting`` keeps its meaning.

The tests that start a server or bind a socket: tests/integration/test_lifecycle_readiness_http.py."""

from __future__ import annotations

from typing import Any

import pytest

from picker.config import EventSourceConfig, parse_settings
from picker.kv.feed_consumer import KvFeedConsumer
from picker.kv.index import InMemoryKvIndex
from picker.runtime.compose import build_app
from tests.support.builders import app_of, static_pool
from tests.support.discovered_pool import FakeDiscovery, discovered_settings, snap


def consumer(name: str = "a") -> KvFeedConsumer:
    return KvFeedConsumer(
        EventSourceConfig(backend_name=name, endpoint=f"http://127.0.0.1:1/events/{name}"), InMemoryKvIndex()
    )


def hello(c: KvFeedConsumer, last_id: int, resumed: bool) -> None:
    c.apply_record(
        "hello", f'{{"model": "m", "key_block_size": 0, "last_id": {last_id}, "resumed": {str(resumed).lower()}}}', None
    )


# -- the feed consumer knows when it has caught up ------------------------------------------------------------


def test_a_resumed_feed_catches_up_at_the_hello_s_last_id() -> None:
    c = consumer()
    changes: list[str] = []
    c.on_change = changes.append
    c._set_connected(True)
    c.stats.last_event_id = 3  # resuming from 3; the listener is at 5
    hello(c, last_id=5, resumed=True)
    assert not c.stats.caught_up
    c.apply_record("put", '{"keys": ["1"], "tier": "gpu_hot"}', "4")
    assert not c.stats.caught_up
    c.apply_record("put", '{"keys": ["2"], "tier": "gpu_hot"}', "5")
    assert c.stats.caught_up and c.stats.ever_caught_up and changes == ["a"]
    c._set_connected(False)  # the connection ends: not caught up now, but it was
    assert not c.stats.caught_up and c.stats.ever_caught_up and changes == ["a", "a"]


def test_a_snapshot_feed_catches_up_once_the_snapshot_is_swapped_in() -> None:
    c = consumer()
    c._set_connected(True)
    hello(c, last_id=0, resumed=False)  # an empty feed still sends its (empty) snapshot
    assert not c.stats.caught_up
    c.apply_record("snapshot_begin", "{}", None)
    c.apply_record("put", '{"keys": ["1", "2"], "tier": "gpu_hot"}', None)
    assert not c.stats.caught_up
    c.apply_record("snapshot_end", "{}", "0")
    assert c.stats.caught_up and c.index.backend_entries() == {"a": 2}


def test_a_resume_with_nothing_to_replay_is_caught_up_at_the_hello() -> None:
    c = consumer()
    c._set_connected(True)
    c.stats.last_event_id = 9
    hello(c, last_id=9, resumed=True)
    assert c.stats.caught_up


def test_a_refused_feed_never_catches_up() -> None:
    c = KvFeedConsumer(
        EventSourceConfig(backend_name="a", endpoint="http://127.0.0.1:1/events/a"),
        InMemoryKvIndex(),
        key_block_size=16,
    )
    c._set_connected(True)
    with pytest.raises(Exception, match="key_block_size_mismatch"):
        c.apply_record("hello", '{"key_block_size": 32, "last_id": 0, "resumed": true}', None)
    assert not c.stats.caught_up


# -- readiness transitions -------------------------------------------------------------------------------


def kv_static_settings(**checks: Any) -> Any:
    return parse_settings(
        {
            "prefix_routing": {"enabled": True},
            "pool": {"backends": [{"name": "a", "address": "10.0.0.1:80"}, {"name": "b", "address": "10.0.0.2:80"}]},
            "kv_cache_index": {
                "enabled": True,
                "event_sources": [
                    {"backend_name": "a", "endpoint": "http://127.0.0.1:1/events/a"},
                    {"backend_name": "b", "endpoint": "http://127.0.0.1:1/events/b"},
                    {"backend_name": "z", "endpoint": "http://127.0.0.1:1/events/z"},  # not in the pool
                ],
                "tokenizer": {"source": "none"},
                "checks": {"self_check": False, **checks},
            },
        }
    )


def test_a_static_pool_without_tier4_is_ready_once_started() -> None:
    app = app_of({"pool": static_pool(1, port=80)})
    r = app.readiness()
    assert not r.ready and r.body["reason"] == "starting"
    app.ready = True
    r = app.readiness()
    assert r.ready and r.body == {
        "status": "ready",
        "reason": None,
        "pool": {"source": "static", "synced": True, "backends": 1},
        "feeds": {},
    }
    app.task_failure = "background task x failed: boom"
    assert app.readiness().body["reason"] == "background task x failed: boom"
    app.draining = True
    assert app.readiness().body["reason"] == "draining"


def test_tier4_waits_for_every_live_feed_to_catch_up_or_go_stale() -> None:
    app = build_app(kv_static_settings(ready_grace_seconds=10))
    app.ready = True
    tier4 = app.tier4
    assert tier4 is not None
    a, b = tier4.consumers.consumers["a"], tier4.consumers.consumers["b"]
    t0 = a.added_at
    r = app.readiness(now=t0)
    assert not r.ready and r.body["feeds"] == {"a": "connecting", "b": "connecting"}  # z is not a live backend
    assert "2 KV feed(s)" in str(r.body["reason"]) and r.due == pytest.approx(t0 + 10, abs=1)
    a._set_connected(True)
    hello(a, last_id=0, resumed=True)
    r = app.readiness(now=t0)
    assert not r.ready and r.body["feeds"] == {"a": "caught_up", "b": "connecting"}
    tier4.checks.state["b"] = "stale"  # the feed checks' stale mark
    assert app.readiness(now=t0).ready
    tier4.checks.state["b"] = "connecting"
    r = app.readiness(now=b.added_at + 10)  # the grace is over
    assert r.ready and r.body["feeds"] == {"a": "caught_up", "b": "stale"} and r.due is None
    a._set_connected(False)  # a feed lost after it caught up does not take readiness away
    assert app.readiness(now=t0).body["feeds"] == {"a": "stale", "b": "connecting"}


def test_a_discovered_pool_is_not_ready_before_its_first_snapshot_then_waits_for_its_feeds_once() -> None:
    app = build_app(discovered_settings(kv=True))
    app.ready = True
    r = app.readiness()
    assert not r.ready and r.body["pool"] == {"source": "inference_pool", "synced": False, "backends": 0}
    app.apply_snapshot(snap(("p-a", "10.0.0.1:8000")))  # the first sync: its feeds are waited for
    r = app.readiness()
    assert not r.ready and r.body["feeds"] == {"p-a": "connecting"}
    app.apply_snapshot(snap())  # gone again: nothing to wait for
    assert app.readiness().ready
    # once serving, a pod that joins does not take readiness away while its feed connects (every picker replica
    # would otherwise leave its Service at each scale-out); /readyz still shows the feed connecting
    app.apply_snapshot(snap(("p-b", "10.0.0.2:8000")))
    r = app.readiness()
    assert r.ready and r.body["feeds"] == {"p-b": "connecting"} and r.body["reason"] is None


def test_the_not_synced_reason_names_the_discovery_s_last_error() -> None:
    discovery = FakeDiscovery()
    app = build_app(discovered_settings(), discovery=discovery)
    app.ready = True
    assert "last error" not in str(app.readiness().body["reason"])
    discovery.status = lambda: {"source": "fake", "synced": False, "last_error": "inferencepool ns/p not found"}
    assert str(app.readiness().body["reason"]).endswith("last error: inferencepool ns/p not found")


# -- publication -----------------------------------------------------------------------------------------
