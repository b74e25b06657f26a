"""The picker follows a discovered pool: config (sources, env, template), snapshot application (pool, ring,
metrics, recorder, placements, KV index, feeds), readiness gating routing only (an unready backend is on standby:
not routed to, its feed and index entries kept), static reloads beside it, and the discovery task.

The tests that start a server or bind a socket: tests/integration/test_lifecycle_http.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from picker.config import ConfigError, parse_settings, restart_required_changes
from picker.facts import RequestFacts
from picker.routing.endpoints import Decision, Endpoint
from picker.runtime.app import PickerApp
from picker.runtime.compose import build_app
from picker.shared.block_keys import chain_block_keys, root_key
from picker.shared.discovery import PoolSnapshot
from picker.shared.discovery.config import BackendsFileRef
from picker.shared.discovery.files import FileDiscovery, load_backends_file
from picker.shared.tiers import StorageTier
from tests.support.builders import app_of, static_pool
from tests.support.discovered_pool import POOL, TEMPLATE, discovered_settings, snap
from tests.support.poll import async_wait_until


def series(app: PickerApp, backend: str) -> list[str]:
    """Every exported sample that names ``backend``."""
    out = []
    for family in app.metrics.registry.collect():
        for s in family.samples:
            if s.labels.get("backend") == backend:
                out.append(s.name)
    return out


# -- config -------------------------------------------------------------------------------------------------


def test_inference_pool_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KV_EPP_POOL__INFERENCE_POOL__NAME", "vllm-llama")
    monkeypatch.setenv("KV_EPP_POOL__INFERENCE_POOL__NAMESPACE", "serving")
    s = parse_settings({"pool": {"health": {"window_size": 20}}})  # merged with the file's pool section
    assert s.pool.inference_pool is not None
    assert (s.pool.inference_pool.name, s.pool.inference_pool.namespace) == ("vllm-llama", "serving")
    assert s.pool.health.window_size == 20 and s.pool.source == "inference_pool" and s.pool.discovered


def test_the_pool_has_one_source() -> None:
    static = static_pool(1, port=80)
    for extra, key in (
        (POOL, "pool.inference_pool"),
        ({"backends_file": {"path": "/tmp/b.yaml"}}, "pool.backends_file"),
    ):
        with pytest.raises(ConfigError) as info:
            parse_settings({"pool": {**static, **extra}})
        assert [p for p, _ in info.value.problems] == [key]
    with pytest.raises(ConfigError) as info:
        parse_settings({"pool": {**POOL, "backends_file": {"path": "/tmp/b.yaml"}}})
    assert info.value.problems[0][0] == "pool.backends_file"
    assert parse_settings({"pool": {"backends_file": {"path": "/tmp/b.yaml"}}}).pool.source == "backends_file"


def test_feeds_match_the_pool_source() -> None:
    source = {"backend_name": "a", "endpoint": "http://127.0.0.1:1/events/a"}
    with pytest.raises(ConfigError) as info:
        parse_settings({"pool": POOL, "kv_cache_index": {"enabled": True, "event_sources": [source]}})
    assert info.value.problems[0][0] == "kv_cache_index.event_sources"
    static = static_pool(1, port=80)
    with pytest.raises(ConfigError) as info:
        parse_settings({"pool": static, "kv_cache_index": {"event_source_template": TEMPLATE}})
    assert info.value.problems[0][0] == "kv_cache_index.event_source_template"


@pytest.mark.parametrize(
    ("endpoint", "why"),
    [
        ("http://127.0.0.1:7817/events/all", "must contain {name}"),
        ("grpc://127.0.0.1:7818/{name}", "takes no {name}"),
        ("ftp://127.0.0.1/{name}", "endpoint must be an http"),
    ],
)
def test_a_bad_template_is_refused_with_its_path(endpoint: str, why: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_settings({"pool": POOL, "kv_cache_index": {"event_source_template": {"endpoint": endpoint}}})
    (path, msg), *_ = info.value.problems
    assert path == "kv_cache_index.event_source_template" and why in msg


def test_a_template_renders_each_backend() -> None:
    s = parse_settings({"pool": POOL, "kv_cache_index": {"event_source_template": TEMPLATE}})
    t = s.kv_cache_index.event_source_template
    assert t is not None
    src = t.for_backend("vllm-7d9f.rank1")
    assert (src.backend_name, src.endpoint) == ("vllm-7d9f.rank1", "http://127.0.0.1:1/events/vllm-7d9f.rank1")
    grpc = parse_settings({"pool": POOL, "kv_cache_index": {"event_source_template": {"endpoint": "grpc://h:7818"}}})
    g = grpc.kv_cache_index.event_source_template
    assert g is not None and g.for_backend("p").endpoint == "grpc://h:7818"


def test_the_pool_source_is_restart_required_the_rest_of_pool_is_not() -> None:
    a = parse_settings({"pool": POOL})
    b = parse_settings({"pool": {**POOL, "health": {"window_size": 9}}})
    c = parse_settings({"pool": {"inference_pool": {"name": "other", "namespace": "serving"}}})
    assert restart_required_changes(a, b) == []
    assert restart_required_changes(a, c) == ["pool.inference_pool"]


# -- applying snapshots ---------------------------------------------------------------------------------------


def test_the_pool_becomes_exactly_the_snapshot() -> None:
    app = build_app(discovered_settings())
    assert app.pool.names() == () and not app.pool_synced and not app.readiness().ready
    app.apply_snapshot(snap(("p-a", "10.0.0.1:8000"), ("p-b", "10.0.0.2:8000")))
    assert app.pool.addresses() == {"p-a": "10.0.0.1:8000", "p-b": "10.0.0.2:8000"}
    assert {ep.weight for ep in app.pool.endpoints} == {1}
    assert app.router.ring().names == ("p-a", "p-b")
    lease = app.pool.acquire(app.pool.endpoint("p-a"))  # type: ignore[arg-type]
    app.apply_snapshot(snap(("p-a", "10.0.0.1:8000"), ("p-c", "10.0.0.3:8000"), version="2"))
    assert app.pool.names() == ("p-a", "p-c") and app.router.ring().names == ("p-a", "p-c")
    assert app.pool.in_flight()["p-a"] == 1  # a backend that stays keeps its live counters
    lease.release()
    assert app.pool.in_flight()["p-a"] == 0
    assert app.pool_status() == {
        "source": "inference_pool",
        "synced": True,
        "backends": 2,
        "unready": [],
        "unready_count": 0,
        "version": "2",
    }
    assert app.metrics.pool_backends._value.get() == 2 and app.metrics.pool_synced._value.get() == 1


def test_a_gone_backend_is_forgotten_everywhere_at_once() -> None:
    app = build_app(discovered_settings())
    app.apply_snapshot(snap(("p-a", "10.0.0.1:8000"), ("p-b", "10.0.0.2:8000")))
    app.recorder.decided(Decision(Endpoint("p-b", "10.0.0.2:8000"), "PrefixAwareHash", "prefix_hash"), None)
    app.recorder.response("p-b", 200)
    app.refresh_gauges()
    placements = app.path.placements
    assert placements is not None
    placements.record("p-b", [1, 2, 3], 0.0)
    assert series(app, "p-b")
    app.apply_snapshot(snap(("p-a", "10.0.0.1:8000")))
    app.refresh_gauges()
    assert series(app, "p-b") == [] and series(app, "p-a")
    assert all("p-b" not in key for key in app.recorder.decisions) and len(placements) == 0


def test_a_rescheduled_pod_is_a_new_engine() -> None:
    """Same name, new address: its health and engine signals start afresh (its in-flight count stays)."""
    app = build_app(discovered_settings())
    app.apply_snapshot(snap(("p-a", "10.0.0.1:8000"), ("p-b", "10.0.0.2:8000")))
    for _ in range(10):
        app.pool.record_response("p-a", False)
    assert "p-a" not in {s.endpoint.name for s in app.pool.view().states}  # ejected
    app.apply_snapshot(snap(("p-a", "10.0.0.9:8000"), ("p-b", "10.0.0.2:8000")))
    assert app.pool.endpoint("p-a") == Endpoint("p-a", "10.0.0.9:8000", 1)
    assert "p-a" in {s.endpoint.name for s in app.pool.view().states}
    assert app.pool.name_for_address("10.0.0.9:8000") == "p-a" and app.pool.name_for_address("10.0.0.1:8000") is None


async def test_tier4_feeds_and_index_follow_the_pool() -> None:
    """New backends are subscribed (the template), gone ones retired with their index entries, a readdressed
    one loses its entries and its feed position (the next subscription asks for a snapshot)."""
    app = build_app(discovered_settings(kv=True))
    tier4 = app.tier4
    assert tier4 is not None and tier4.consumers.consumers == {}
    task = asyncio.create_task(tier4.consumers.run())
    try:
        app.apply_snapshot(snap(("p-a", "10.0.0.1:8000"), ("p-b", "10.0.0.2:8000"), ("p-c", "10.0.0.3:8000")))
        consumers = dict(tier4.consumers.consumers)
        assert sorted(consumers) == ["p-a", "p-b", "p-c"]
        assert consumers["p-b"].source.endpoint == "http://127.0.0.1:1/events/p-b"
        await async_wait_until(lambda: all(c._task is not None for c in consumers.values()), what="tasks started")
        for name in consumers:
            tier4.index.put(name, [10, 11], StorageTier.GPU_HOT)
        consumers["p-c"].stats.last_event_id = 42  # a resume position
        assert tier4.checks.state.keys() == {"p-a", "p-b", "p-c"}
        app.apply_snapshot(snap(("p-a", "10.0.0.1:8000"), ("p-c", "10.0.0.33:8000"), ("p-d", "10.0.0.4:8000")))
        # at once, in the same synchronous step
        assert sorted(tier4.consumers.consumers) == ["p-a", "p-c", "p-d"]
        assert consumers["p-b"].retired and tier4.index.backend_entries() == {"p-a": 2}
        assert "p-b" not in tier4.checks.state and "p-b" not in tier4.watch.served
        assert tier4.consumers.consumers["p-c"] is consumers["p-c"]  # kept, its position void:
        consumers["p-c"]._position()
        assert consumers["p-c"].stats.last_event_id is None
        old_task = consumers["p-b"]._task
        assert old_task is not None
        await async_wait_until(old_task.done, what="the retired consumer's task ended")
        assert old_task.cancelled()
        assert all(name != "continuum_kv_consumer_connected" for name in series(app, "p-b"))
        assert not task.done()  # a retired consumer's cancellation is not the group's failure
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_applying_a_thousand_backends_is_one_step_and_bounded() -> None:
    """1,000 backends in, then all but 10 gone: one consumer per live backend, no leftover state."""
    app = build_app(discovered_settings(kv=True))
    tier4 = app.tier4
    assert tier4 is not None
    many = [(f"pod-{i:04d}", f"10.1.{i // 250}.{i % 250 + 1}:8000") for i in range(1000)]
    app.apply_snapshot(snap(*many))
    assert len(app.pool.names()) == 1000 and len(tier4.consumers.consumers) == 1000
    assert len(app.router.ring().names) == 1000
    for name, _ in many[:50]:
        tier4.index.put(name, [1, 2], StorageTier.GPU_HOT)
    placements = app.path.placements
    assert placements is not None
    placements.record("pod-0000", [7, 8], 0.0)  # stays in the pool: its guesses stay
    placements.record("pod-0500", [9], 0.0)  # leaves: its guess goes (one pass for the 990 gone)
    app.apply_snapshot(snap(*many[:10]))
    assert len(app.pool.names()) == 10 and len(tier4.consumers.consumers) == 10
    assert set(tier4.index.backend_entries()) == {name for name, _ in many[:10]}
    assert set(tier4.checks.state) == {name for name, _ in many[:10]}
    assert len(placements) == 2  # pod-0000's two keys; pod-0500's one is gone


# -- readiness gates routing only -------------------------------------------------------------------------------


A, B, C = ("p-a", "10.0.0.1:8000"), ("p-b", "10.0.0.2:8000"), ("p-c", "10.0.0.3:8000")


def held_by(app: PickerApp, ids: list[int]) -> dict[str, int]:
    """Tier 4's answer for a completions prompt of token ids (block size 16 by default): backend → blocks."""
    assert app.tier4 is not None
    facts = RequestFacts(api="completions", model="m", prompt_token_ids=tuple(ids))
    return {name: h.blocks for name, h in asyncio.run(app.tier4.lookup(facts)).holds.items()}


def test_an_unready_backend_leaves_routing_only() -> None:
    """A Ready flap: out of the pool, the ring, every view and the feed readiness; its feed, checks and index
    entries stay (never offered to a decision); its live counters wait on standby; Ready again: all back."""
    app = build_app(discovered_settings(kv=True))
    tier4, placements = app.tier4, app.path.placements
    assert tier4 is not None and placements is not None
    app.apply_snapshot(snap(A, B, C))
    ids = list(range(64))  # four blocks
    keys = chain_block_keys(ids, 16, root_key("m", None, None), 4)
    for name, _ in (A, B):
        tier4.index.put(name, keys, StorageTier.GPU_HOT)
    placements.record("p-b", keys, 0.0)
    lease = app.pool.acquire(app.pool.endpoint("p-b"))  # type: ignore[arg-type]
    for _ in range(3):
        app.pool.record_response("p-b", False)  # its health window
    consumer = tier4.consumers.consumers["p-b"]
    assert held_by(app, ids) == {"p-a": 4, "p-b": 4}

    app.apply_snapshot(snap(A, B, C, version="2", unready=("p-b",)))
    assert app.pool.names() == ("p-a", "p-c") and app.router.ring().names == ("p-a", "p-c")
    assert {s.endpoint.name for s in app.pool.view().states} == {"p-a", "p-c"}
    assert app.pool.view(["10.0.0.2:8000"]).states == ()  # a subset hint naming it finds nothing to route to
    assert tier4.consumers.consumers["p-b"] is consumer and not consumer.retired  # the feed stays
    assert "p-b" in tier4.checks.state
    assert tier4.index.backend_entries() == {"p-a": 4, "p-b": 4}  # its entries stay ...
    assert held_by(app, ids) == {"p-a": 4}  # ... never offered to a decision
    assert len(placements) == 0  # this picker's guesses about it go (the index keeps the truth)
    feeds, _ = tier4.feed_readiness(app.pool.names())
    assert "p-b" not in feeds and "p-b" not in app.readiness().body["feeds"]  # type: ignore[operator]
    assert app.pool_status()["unready"] == ["p-b"] and app.pool_status()["unready_count"] == 1
    assert app.metrics.pool_backends._value.get() == 2
    lease.release()  # a request sent before the flap ends meanwhile: counted where it was
    app.refresh_gauges()
    assert app.metrics.backend_healthy.labels("p-b")._value.get() == 0  # not eligible
    assert series(app, "p-b")  # its series stay: it is still a backend of the pool

    lease2 = app.pool.acquire(app.pool.endpoint("p-a"))  # type: ignore[arg-type]
    app.apply_snapshot(snap(A, B, C, version="3"))  # Ready again
    assert app.pool.names() == ("p-a", "p-b", "p-c") and app.router.ring().names == ("p-a", "p-b", "p-c")
    assert held_by(app, ids) == {"p-a": 4, "p-b": 4}
    assert tier4.consumers.consumers["p-b"] is consumer
    assert app.pool.in_flight() == {"p-a": 1, "p-b": 0, "p-c": 0}
    assert app.pool.success_rate("p-b") == 0.0  # the same engine: its health window came back with it
    lease2.release()


def test_an_unready_backend_keeps_its_in_flight_count_on_standby() -> None:
    app = build_app(discovered_settings())
    app.apply_snapshot(snap(A, B))
    lease = app.pool.acquire(app.pool.endpoint("p-b"))  # type: ignore[arg-type]
    app.apply_snapshot(snap(A, B, version="2", unready=("p-b",)))
    assert app.pool.in_flight() == {"p-a": 0} and app.pool.standby_in_flight() == {"p-b": 1}
    app.refresh_gauges()
    assert app.metrics.prefix_routing_backend_distribution.labels("p-b")._value.get() == 1
    app.apply_snapshot(snap(A, B, version="3"))
    assert app.pool.in_flight() == {"p-a": 0, "p-b": 1}  # still running there: not an idle newcomer
    lease.release()
    assert app.pool.in_flight()["p-b"] == 0
    app.apply(discovered_settings(selection_strategy="RoundRobin"))  # a reload keeps members and standby
    app.apply_snapshot(snap(A, B, version="4", unready=("p-b",)))
    app.apply(discovered_settings(selection_strategy="PrefixAwareHash"))
    assert app.pool.names() == ("p-a",) and app.pool.standby() == {"p-b": "10.0.0.2:8000"}


def test_an_unready_backend_that_leaves_or_moves_is_dropped_at_once() -> None:
    app = build_app(discovered_settings(kv=True))
    tier4 = app.tier4
    assert tier4 is not None
    app.apply_snapshot(snap(A, B, C, unready=("p-b", "p-c")))
    for name in ("p-a", "p-b", "p-c"):
        tier4.index.put(name, [1, 2], StorageTier.GPU_HOT)
    consumers = dict(tier4.consumers.consumers)
    consumers["p-c"].stats.last_event_id = 7
    # p-b's pod is deleted (or terminating: not published), p-c is rescheduled to another IP while unready
    app.apply_snapshot(snap(A, ("p-c", "10.0.0.33:8000"), version="2", unready=("p-c",)))
    assert sorted(tier4.consumers.consumers) == ["p-a", "p-c"] and consumers["p-b"].retired
    assert tier4.index.backend_entries() == {"p-a": 2}  # p-b forgotten, p-c voided (another engine)
    consumers["p-c"]._position()
    assert consumers["p-c"].stats.last_event_id is None  # its feed asks for a snapshot
    assert "p-b" not in tier4.checks.state and series(app, "p-b") == []
    assert app.pool.standby() == {"p-c": "10.0.0.33:8000"} and app.pool.names() == ("p-a",)


def test_unready_feeds_do_not_hold_readiness_back() -> None:
    app = build_app(discovered_settings(kv=True))
    app.ready = True
    app.apply_snapshot(snap(A, B, unready=("p-b",)))  # two new feeds, neither caught up
    r = app.readiness(now=0.0)
    assert not r.ready and r.body["feeds"] == {"p-a": "connecting"}
    app.apply_snapshot(snap(A, B, version="2", unready=("p-a", "p-b")))
    r = app.readiness()
    assert r.ready and r.body["feeds"] == {}, r.body


def test_a_change_of_only_the_ready_flag_is_a_new_snapshot(tmp_path: Path) -> None:
    """The file discovery's ``ready`` (default true), as a pod's Ready condition; a flip alone is published."""
    path = tmp_path / "backends.yaml"
    path.write_text(
        "backends:\n  - {name: e0, address: 10.0.0.1:8000}\n  - {name: e1, address: 10.0.0.2:8000, ready: false}\n"
    )
    e0, e1 = load_backends_file(path)
    assert (e0.ready, e1.ready) == (True, False)
    path.write_text("backends:\n  - {name: e0, address: 10.0.0.1:8000, ready: maybe}\n")
    with pytest.raises(ConfigError) as info:
        load_backends_file(path)
    assert info.value.problems[0][0] == "backends[0].ready"

    async def follow() -> list[PoolSnapshot]:
        published: list[PoolSnapshot] = []
        discovery = FileDiscovery(BackendsFileRef(path=str(path), poll_seconds=0.05))
        task = asyncio.create_task(discovery.run(published.append))
        try:
            path.write_text("backends:\n  - {name: e0, address: 10.0.0.1:8000}\n")
            await async_wait_until(lambda: len(published) == 1, timeout=30)
            tmp = tmp_path / "next.yaml"
            tmp.write_text("backends:\n  - {name: e0, address: 10.0.0.1:8000, ready: false}\n")
            tmp.replace(path)
            await async_wait_until(lambda: len(published) == 2, timeout=30)
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        return published

    first, second = asyncio.run(follow())
    assert first.ready_names() == ("e0",) and second.names() == ("e0",) and second.ready_names() == ()


def test_a_static_reload_keeps_working_and_cannot_switch_the_source() -> None:
    static = {"backends": [{"name": "a", "address": "10.0.0.1:80"}, {"name": "b", "address": "10.0.0.2:80"}]}
    app = app_of({"pool": static})
    assert app.pool_synced and app.pool_source == "static"
    messages = app.apply(parse_settings({"pool": {"backends": static["backends"][:1]}}))
    assert messages == [] and app.pool.names() == ("a",)
    # static -> discovered is restart-required: the static members stay, the pool's other keys apply
    messages = app.apply(parse_settings({"pool": {**POOL, "health": {"window_size": 7}}}))
    assert messages == ["pool.inference_pool: changed, restart required (not applied)"]
    assert app.pool.names() == ("a",) and app.settings.pool.inference_pool is None
    assert app.settings.pool.health.window_size == 7


def test_a_reload_while_discovered_keeps_the_discovered_members() -> None:
    app = build_app(discovered_settings())
    app.apply_snapshot(snap(("p-a", "10.0.0.1:8000")))
    app.apply(discovered_settings(selection_strategy="RoundRobin"))
    assert app.pool.names() == ("p-a",) and app.settings.selection_strategy == "RoundRobin"
    # discovered -> static: restart-required, the discovered members stay
    messages = app.apply(parse_settings({"pool": {"backends": [{"name": "x", "address": "10.9.9.9:80"}]}}))
    assert messages == ["pool.inference_pool: changed, restart required (not applied)"]
    assert app.pool.names() == ("p-a",) and app.settings.pool.discovered and app.settings.pool.backends == ()


# -- the discovery task --------------------------------------------------------------------------------------


def test_discovery_event_names_are_bounded() -> None:
    app = build_app(discovered_settings())
    for i in range(100):
        app.metrics.discovery_event(f"e{i}")
    labels = {s.labels["event"] for f in app.metrics.registry.collect() for s in f.samples if "event" in s.labels}
    assert len(labels) <= app.metrics.MAX_DISCOVERY_EVENTS + 1 and "other" in labels


def test_an_answer_from_a_name_s_old_address_charges_nothing_to_its_new_engine() -> None:
    """A request in flight to a pod that was rescheduled under the same name (a StatefulSet) fails: its failure
    belongs to the old engine, not to the new one's fresh health window (which five such failures would eject)."""
    app = build_app(discovered_settings())
    app.apply_snapshot(snap(("p-a", "10.0.0.1:8000")))
    app.apply_snapshot(snap(("p-a", "10.0.0.9:8000")))  # same name, new address: a new engine
    for _ in range(10):
        app.pool.record_response("p-a", False, address="10.0.0.1:8000")
    (entry,) = app.pool.health_snapshot()
    assert entry["healthy"] and entry["address"] == "10.0.0.9:8000"
    for _ in range(10):
        app.pool.record_response("p-a", False, address="10.0.0.9:8000")
    assert not app.pool.health_snapshot()[0]["healthy"]  # its own failures do count


def test_a_watch_idle_timeout_below_the_bookmark_period_is_warned_about() -> None:
    from picker.config import config_warnings

    def warned(seconds: float) -> bool:
        pool = {"inference_pool": {"name": "p", "namespace": "ns", "watch_idle_timeout_seconds": seconds}}
        problems = config_warnings(parse_settings({"pool": pool}))
        return "pool.inference_pool.watch_idle_timeout_seconds" in [p for p, _ in problems]

    assert warned(5) and not warned(150)
