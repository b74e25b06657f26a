"""Ranked fallbacks (the pure core), the served endpoint (Envoy's ``-served`` report) charged by the health
observer, and ejection/readmission events."""

from __future__ import annotations

import json

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from picker.config import parse_settings
from picker.extproc.messages import SERVED_KEY, pick_response, served_endpoint
from picker.facts import RequestFacts
from picker.request.exchange import Exchange
from picker.request.path import Inbound
from picker.routing.chwbl_ring import ring_hash
from picker.routing.core import Prepared, Router
from picker.routing.endpoints import BackendHold, Endpoint, EndpointState, PoolView, StorageTier
from picker.runtime.app import PickerApp
from tests.support.builders import CHAT, app_of

EPS = [Endpoint(n, f"10.0.0.{i + 1}:80") for i, n in enumerate("abcde")]
BACKENDS = [{"name": e.name, "address": e.address} for e in EPS]


def router(strategy: str = "PrefixAwareHash", fallbacks: int = 2) -> Router:
    s = parse_settings(
        {"selection_strategy": strategy, "prefix_routing": {"enabled": True}, "pool": {"fallbacks": fallbacks}}
    )
    r = Router(s)
    r.set_pool_names(tuple(e.name for e in EPS))
    return r


def view(loads: dict[str, int] | None = None) -> PoolView:
    return PoolView(tuple(EndpointState(e, (loads or {}).get(e.name, 0)) for e in EPS))


def chat(system: str = "sys") -> RequestFacts:
    return RequestFacts(api="chat", model="m", system=system, first_message="hi")


@pytest.mark.parametrize("n", [0, 1, 2, 4, 8])
def test_fallbacks_are_bounded_distinct_and_never_the_pick(n: int) -> None:
    r = router(fallbacks=n)
    for i in range(30):
        f = chat(f"prompt {i}")
        d = r.decide(f, view(), Prepared(key=r.key_for(f)))
        assert d is not None
        names = [e.name for e in d.fallbacks]
        assert len(names) == min(n, len(EPS) - 1)
        assert len(set(names)) == len(names) and d.endpoint.name not in names
        assert d.destinations().split(",") == [d.endpoint.address, *(e.address for e in d.fallbacks)]


def test_ring_fallbacks_follow_the_ring_walk() -> None:
    r = router(fallbacks=3)
    f = chat("ring order")
    key = r.key_for(f)
    assert key is not None
    d = r.decide(f, view(), Prepared(key=key))
    assert d is not None and d.reason == "prefix_hash"
    walk = r.ring().walk(int.from_bytes(key[:8], "big"), {e.name: e for e in EPS})
    assert [d.endpoint.name, *(e.name for e in d.fallbacks)] == walk[:4]


def test_consistent_hash_fallbacks_follow_the_ring_walk_from_the_model() -> None:
    r = router("ConsistentHash", fallbacks=2)
    f = RequestFacts(api="chat", model="model-x")
    d = r.decide(f, view(), Prepared())
    assert d is not None
    walk = r.ring().walk(ring_hash(b"model-x"), {e.name: e for e in EPS})
    assert [d.endpoint.name, *(e.name for e in d.fallbacks)] == walk[:3]


def test_other_strategies_fall_back_to_least_in_flight() -> None:
    r = router("RoundRobin", fallbacks=2)
    d = r.decide(chat(), view({"a": 5, "b": 1, "c": 9, "d": 0, "e": 3}), Prepared())
    assert d is not None
    rest = sorted(
        (n for n in "abcde" if n != d.endpoint.name), key=lambda n: {"a": 5, "b": 1, "c": 9, "d": 0, "e": 3}[n]
    )
    assert [e.name for e in d.fallbacks] == rest[:2]


def test_kv_aware_fallbacks_follow_the_score_order() -> None:
    r = router(fallbacks=2)
    f = chat("kv order")
    holds = {
        "c": BackendHold(8, StorageTier.GPU_HOT),
        "a": BackendHold(6, StorageTier.GPU_HOT),
        "e": BackendHold(5, StorageTier.GPU_HOT),
    }
    d = r.decide(f, view(), Prepared(key=r.key_for(f), holds=holds))
    assert d is not None and d.reason == "kv_aware" and d.endpoint.name == "c"
    assert [e.name for e in d.fallbacks] == ["a", "e"]


def test_a_single_endpoint_has_no_fallbacks() -> None:
    r = router(fallbacks=2)
    d = r.decide(chat(), PoolView((EndpointState(EPS[0]),)), Prepared())
    assert d is not None and d.fallbacks == () and d.destinations() == EPS[0].address


def test_pick_response_carries_the_ranked_list_in_header_and_metadata() -> None:
    r = pick_response("10.0.0.1:80,10.0.0.2:80", None, on_body=False)
    hdr = r.request_headers.response.header_mutation.set_headers[0].header
    assert hdr.raw_value == b"10.0.0.1:80,10.0.0.2:80"
    lb = r.dynamic_metadata.fields["envoy.lb"].struct_value.fields
    assert lb["x-gateway-destination-endpoint"].string_value == "10.0.0.1:80,10.0.0.2:80"


def served(address: str | None) -> pb.ProcessingRequest:
    req = pb.ProcessingRequest(response_headers=pb.HttpHeaders())
    if address is not None:
        req.metadata_context.filter_metadata["envoy.lb"].fields[SERVED_KEY].string_value = address
    return req


def test_served_endpoint_is_read_from_envoy_lb_metadata() -> None:
    assert served_endpoint(served("10.0.0.2:80")) == "10.0.0.2:80"
    assert served_endpoint(served(None)) is None
    assert served_endpoint(pb.ProcessingRequest()) is None


# -- the health observer charges the endpoint that served -------------------------------------------


def make_app(**pool: object) -> PickerApp:
    cfg = {"window_size": 10, "min_samples": 3, "unhealthy_below": 0.5, "cooldown_seconds": 60}
    return app_of(
        {
            "selection_strategy": "PrefixAwareHash",
            "prefix_routing": {"enabled": True},
            "pool": {"backends": BACKENDS, "health": cfg, **pool},
        }
    )


def body(system: str) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "system", "content": system}]}).encode()


async def route(app: PickerApp, system: str = "s") -> Exchange:
    ex = await app.path.route(Inbound(CHAT, {":method": "POST"}, body(system)))
    assert isinstance(ex, Exchange) and len(ex.decision.fallbacks) == 2
    return ex


def stats(app: PickerApp) -> dict[str, dict[str, object]]:
    return {str(b["backend"]): b for b in app.pool.health_snapshot()}


async def test_a_failover_charges_the_pick_and_credits_the_endpoint_that_served() -> None:
    app = make_app()
    ex = await route(app)
    pick, second = ex.decision.endpoint, ex.decision.fallbacks[0]
    ex.response_headers(200, second.address)  # the pick refused or timed out; Envoy retried on the next
    assert app.pool.in_flight()[pick.name] == 0 and app.pool.in_flight()[second.name] == 1  # the slot moved
    ex.end(completed=True)
    assert not any(app.pool.in_flight().values())
    s = stats(app)
    assert s[pick.name]["failures"] == 1 and s[pick.name]["successes"] == 0
    assert s[second.name]["successes"] == 1 and s[second.name]["failures"] == 0


async def test_the_third_listed_endpoint_serving_charges_both_before_it() -> None:
    app = make_app()
    ex = await route(app)
    d = ex.decision
    ex.response_headers(504, d.fallbacks[1].address)  # Envoy's 504 after the last try timed out
    s = stats(app)
    assert s[d.endpoint.name]["failures"] == 1 and s[d.fallbacks[0].name]["failures"] == 1
    assert s[d.fallbacks[1].name]["failures"] == 1


async def test_no_served_report_charges_the_pick() -> None:
    app = make_app()
    ex = await route(app)
    ex.response_headers(200, None)
    assert stats(app)[ex.decision.endpoint.name]["successes"] == 1


async def test_a_served_endpoint_outside_the_list_charges_only_itself() -> None:
    app = make_app()
    ex = await route(app)
    listed = {ex.decision.endpoint.address, *(e.address for e in ex.decision.fallbacks)}
    other = next(e for e in EPS if e.address not in listed)
    ex.response_headers(200, other.address)
    s = stats(app)
    assert s[other.name]["successes"] == 1
    assert sum(int(str(v["failures"])) for v in s.values()) == 0


async def test_ejection_and_readmission_are_logged_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    app = make_app()
    app.pool._clock = lambda: now[0]
    victim = None
    caplog.set_level("INFO", logger="kv_epp.pool")
    for _ in range(3):
        ex = await route(app, "same prefix")
        victim = ex.decision.endpoint
        ex.response_headers(200, ex.decision.fallbacks[0].address)
        ex.end(completed=True)
        if not stats(app)[victim.name]["healthy"]:
            break
    assert victim is not None and stats(app)[victim.name]["healthy"] is False
    labels = {"backend": victim.name, "reason": "error_rate"}
    assert app.metrics.registry.get_sample_value("continuum_picker_backend_ejections_total", labels) == 1
    assert f"event=endpoint_ejected backend={victim.name}" in caplog.text
    now[0] += 61
    app.pool.view()
    assert (
        app.metrics.registry.get_sample_value("continuum_picker_backend_readmissions_total", {"backend": victim.name})
        == 1
    )
    assert f"event=endpoint_readmitted backend={victim.name}" in caplog.text


def test_consecutive_failures_eject_after_a_long_healthy_history() -> None:
    app = make_app(health={"window_size": 50, "min_samples": 5, "unhealthy_below": 0.5, "consecutive_failures": 4})
    for _ in range(50):
        app.pool.record_response("a", True)
    for _ in range(3):
        app.pool.record_response("a", False)
    assert stats(app)["a"]["healthy"] is True
    app.pool.record_response("a", False)
    assert stats(app)["a"]["healthy"] is False
    labels = {"backend": "a", "reason": "consecutive_failures"}
    assert app.metrics.registry.get_sample_value("continuum_picker_backend_ejections_total", labels) == 1


def test_memoised_ring_walk_matches_the_full_walk() -> None:
    import random

    from picker.routing.chwbl_ring import HashRing

    rng = random.Random(7)
    names = [f"e{i}" for i in range(12)]
    ring = HashRing(names, 20)
    for _ in range(500):
        eligible = {n: 1 for n in names if rng.random() < 0.6}
        point = rng.getrandbits(64)
        skip = rng.choice(names)
        limit = rng.randint(0, 9)
        full = [n for n in ring.walk(point, eligible) if n != skip][:limit]
        assert ring.walk(point, eligible, limit=limit, skip=skip) == full
