"""P/D disaggregation in the request path (docs/pd.md): roles, the decision after the decode pick, the prefill
endpoint's lease, the 503 or the decode-only fallback, the counts under llm-d's names and ours, the header on the
wire and the transfer cost's fit."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from picker.config import ConfigError, parse_settings
from picker.extproc.messages import pick_response
from picker.facts import Answer, RequestFacts
from picker.kv.stage import KvLookup
from picker.request.disagg import TransferFit
from picker.request.exchange import Exchange
from picker.request.path import Inbound
from picker.routing.disagg import PREFILLER_HEADER
from picker.routing.endpoints import BackendHold, Disagg, StorageTier
from picker.runtime.app import PickerApp
from picker.shared.discovery.kube_objects import parse_pod
from picker.shared.discovery.model import role_of
from tests.support.builders import CHAT, FixedHolds, app_of

POOL = [
    {"name": "d1", "address": "10.0.0.1:8000", "role": "decode"},
    {"name": "d2", "address": "10.0.0.2:8000", "role": "decode"},
    {"name": "p1", "address": "10.0.0.3:8000", "role": "prefill"},
]


def make_app(holds: dict[str, BackendHold], prompt_tokens: int, pool: list[dict[str, Any]] = POOL, **pd: Any):
    app = app_of(
        {
            "selection_strategy": "LeastRequest",
            "prefix_routing": {"enabled": True},
            "kv_cache_index": {"enabled": True},
            "pool": {"backends": pool, "fallbacks": 1},
            "disaggregation": {"enabled": True, "min_uncached_tokens": 256} | pd,
        }
    )
    app.path.holds = FixedHolds(holds, prompt_tokens)
    app.path.configure(app.settings)
    return app


def body(stream: bool = False) -> bytes:
    return json.dumps({"model": "m", "stream": stream, "messages": [{"role": "user", "content": "q" * 40}]}).encode()


def counted(app: PickerApp, name: str, labels: dict[str, str]) -> float | None:
    return app.metrics.registry.get_sample_value(name, labels)


async def route(app: PickerApp, stream: bool = False) -> Exchange | Answer:
    return await app.path.route(Inbound(CHAT, {":method": "POST"}, body(stream)))


async def test_a_long_uncached_prompt_is_prefilled_on_a_prefill_endpoint() -> None:
    app = make_app({}, prompt_tokens=2000)
    ex = await route(app)
    assert isinstance(ex, Exchange)
    d = ex.decision.disagg
    assert ex.decision.endpoint.name in ("d1", "d2")  # a prefill endpoint never takes the whole request
    assert d is not None and d.decision_type == "prefill-decode" and d.prefill is not None
    assert d.prefill.name == "p1" and d.uncached_tokens == 2000 and d.prefill_tokens == 2000
    assert d.local_ms is not None and d.remote_ms is not None  # the cost model was asked
    assert all(e.name != "p1" for e in ex.decision.fallbacks)  # retries stay on decode endpoints
    # the prefill endpoint carries the prefill until the first byte; the decode endpoint only the request
    loads = {s["backend"]: s for s in app.pool.health_snapshot()}
    assert loads["p1"]["in_flight_requests"] == 1 and loads["p1"]["pending_prefill_tokens"] == 2000
    assert loads[ex.decision.endpoint.name]["pending_prefill_tokens"] == 0
    ex.response_headers(200)
    assert app.pool.in_flight()["p1"] == 0
    ex.end(completed=True)
    assert app.pool.in_flight() == {"d1": 0, "d2": 0, "p1": 0}
    labels = {"decision_type": "prefill-decode", "reason": "cost"}
    assert counted(app, "continuum_picker_disagg_decisions_total", labels) == 1
    llmd = {"plugin_name": "disagg-profile-handler", "plugin_type": "disagg-profile-handler", "model_name": "m"}
    assert counted(app, "llm_d_epp_disagg_decision_total", llmd | {"decision_type": "prefill-decode"}) == 1
    old = {"model_name": "m", "decision_type": "prefill-decode"}
    assert counted(app, "llm_d_inference_scheduler_disagg_decision_total", old) == 1


async def test_the_uncached_tokens_are_counted_on_the_chosen_decode_endpoint() -> None:
    """d1 holds 1,900 of the 2,000 tokens: the 100 left are under the threshold, so no prefill leg."""
    app = make_app({"d1": BackendHold(1900 // 16, StorageTier.GPU_HOT)}, prompt_tokens=2000)
    ex = await route(app)
    assert isinstance(ex, Exchange) and ex.decision.endpoint.name == "d1"
    d = ex.decision.disagg
    assert d is not None and d.decision_type == "decode-only" and d.reason == "below_threshold"
    assert d.prefill is None and d.uncached_tokens == 2000 - 1900 // 16 * 16
    assert counted(app, "continuum_picker_disagg_decisions_total", {"decision_type": "decode-only",
                   "reason": "below_threshold"}) == 1  # fmt: skip
    ex.end(completed=True)


async def test_min_prompt_tokens_keeps_short_prompts_local() -> None:
    app = make_app({}, prompt_tokens=2000, min_prompt_tokens=4000)
    ex = await route(app)
    assert isinstance(ex, Exchange) and ex.decision.disagg is not None
    assert ex.decision.disagg.reason == "below_threshold"


async def test_the_cost_model_keeps_the_prefill_local_when_the_prefill_endpoint_is_backed_up() -> None:
    app = make_app({}, prompt_tokens=2000, decide="cost", max_ttft_ratio=1.0)
    p1 = app.pool.endpoint("p1")
    assert p1 is not None
    backlog = [app.pool.acquire(p1, 20_000) for _ in range(4)]  # 80,000 tokens queued to prefill there
    ex = await route(app)
    assert isinstance(ex, Exchange) and ex.decision.disagg is not None
    d = ex.decision.disagg
    assert d.decision_type == "decode-only" and d.reason == "cheaper_local" and d.prefill is None
    assert d.local_ms is not None and d.remote_ms is not None and d.remote_ms > d.local_ms
    # llm-d's rule alone disaggregates the same request
    app2 = make_app({}, prompt_tokens=2000, decide="threshold")
    p = app2.pool.endpoint("p1")
    assert p is not None
    more = [app2.pool.acquire(p, 20_000) for _ in range(4)]
    ex2 = await route(app2)
    assert isinstance(ex2, Exchange) and ex2.decision.disagg is not None
    assert ex2.decision.disagg.reason == "threshold" and ex2.decision.disagg.decision_type == "prefill-decode"
    for lease in (*backlog, *more):
        lease.release()


async def test_no_prefill_endpoint_is_a_503_with_its_reason_unless_decode_only() -> None:
    pool = [b for b in POOL if b["role"] != "prefill"]
    app = make_app({}, prompt_tokens=2000, pool=pool)
    out = await route(app)
    assert isinstance(out, Answer) and out.status == 503
    assert json.loads(out.body)["error"]["code"] == "no_prefill_endpoint"
    assert app.pool.in_flight() == {"d1": 0, "d2": 0}  # nothing taken
    rejected = {"decision_type": "rejected", "reason": "no_prefill_endpoint"}
    assert counted(app, "continuum_picker_disagg_decisions_total", rejected) == 1
    assert counted(app, "continuum_picker_requests_total", {"outcome": "no_backend"}) == 1
    llmd = {"plugin_name": "disagg-profile-handler", "plugin_type": "disagg-profile-handler", "model_name": "m"}
    assert counted(app, "llm_d_epp_disagg_decision_total", llmd | {"decision_type": "decode-only"}) is None
    labels = {"decision_type": "decode-only", "reason": "no_prefill_endpoint"}

    relaxed = make_app({}, prompt_tokens=2000, pool=pool, fallback="decode_only")
    ex = await route(relaxed)
    assert isinstance(ex, Exchange) and ex.decision.disagg is not None
    assert ex.decision.disagg.reason == "no_prefill_endpoint" and ex.decision.disagg.prefill is None
    assert counted(relaxed, "continuum_picker_disagg_decisions_total", labels) == 1  # never silent
    assert counted(relaxed, "llm_d_epp_disagg_decision_total", llmd | {"decision_type": "decode-only"}) == 1
    ex.end(completed=True)


async def test_an_ejected_prefill_endpoint_is_not_chosen() -> None:
    app = make_app({}, prompt_tokens=2000, fallback="reject")
    for _ in range(50):
        app.pool.record_response("p1", ok=False)
    out = await route(app)
    assert isinstance(out, Answer) and out.status == 503


async def test_prefill_endpoints_take_no_whole_request_even_with_disaggregation_off() -> None:
    app = app_of({"selection_strategy": "RoundRobin", "pool": {"backends": POOL}})
    picked = set()
    for _ in range(6):
        ex = await route(app)
        assert isinstance(ex, Exchange) and ex.decision.disagg is None
        picked.add(ex.decision.endpoint.name)
        ex.end(completed=True)
    assert picked == {"d1", "d2"}


async def test_unlabelled_endpoints_are_never_prefill_targets() -> None:
    """As llm-d: no role (no label, no ``role`` key) takes whole requests and is never named to prefill, so turning
    disaggregation on over a pool without roles refuses long prompts loudly instead of pretending to split them."""
    pool = [{"name": "x", "address": "10.0.0.1:8000"}, {"name": "y", "address": "10.0.0.2:8000"}]
    app = make_app({}, prompt_tokens=3000, pool=pool)
    out = await route(app)
    assert isinstance(out, Answer) and out.status == 503


async def test_a_both_endpoint_may_decode_or_prefill_but_never_for_itself() -> None:
    pool = [{"name": n, "address": f"10.0.0.{i}:8000", "role": "both"} for i, n in enumerate(("x", "y"), 1)]
    app = make_app({}, prompt_tokens=3000, pool=pool)
    ex = await route(app)
    assert isinstance(ex, Exchange) and ex.decision.disagg is not None and ex.decision.disagg.prefill is not None
    assert ex.decision.disagg.prefill.name != ex.decision.endpoint.name
    ex.end(completed=True)


def test_the_pick_sets_the_prefill_header_or_removes_a_client_copy() -> None:
    r = pick_response("10.0.0.1:8000", None, on_body=False, prefiller="10.0.0.3:8000")
    m = r.request_headers.response.header_mutation
    assert [(h.header.key, h.header.raw_value) for h in m.set_headers] == [
        ("x-gateway-destination-endpoint", b"10.0.0.1:8000"), (PREFILLER_HEADER, b"10.0.0.3:8000"),
    ]  # fmt: skip
    assert PREFILLER_HEADER not in m.remove_headers
    for on_body in (False, True):
        r = pick_response("10.0.0.1:8000", None, on_body=on_body)
        m = (r.request_body if on_body else r.request_headers).response.header_mutation
        assert list(m.remove_headers) == [PREFILLER_HEADER]
        assert all(h.header.key != PREFILLER_HEADER for h in m.set_headers)


async def test_a_streamed_p_d_request_teaches_the_transfer_cost() -> None:
    app = make_app({}, prompt_tokens=2000)
    ex = await route(app, stream=True)
    assert isinstance(ex, Exchange) and ex.decision.disagg is not None and ex.decision.disagg.prefill is not None
    fit = app.path.disagg.fit
    assert fit.samples == 0
    ex.response_headers(200)
    ex.response_body(b'data: {"choices": []}\n\n', end=False)
    ex.response_body(b"data: [DONE]\n\n", end=True)
    assert fit.samples == 1
    report = app.path.disagg.report()
    assert report["enabled"] is True and report["roles"] == {"prefill": 1, "decode": 2, "both": 0, "none": 0}


def pd(prefill_ms: float, transfer: float = 0.02) -> Disagg:
    return Disagg("prefill-decode", "cost", None, 1000, 500.0, prefill_ms + transfer * 1000, 1000, prefill_ms)


def test_the_transfer_fit_follows_the_observed_first_tokens() -> None:
    fit = TransferFit(0.02)
    fit.observe(pd(200.0), 700.0)  # the prefill leg was predicted at 200 ms: 500 ms over 1,000 tokens
    assert fit.value == pytest.approx(0.5)
    for _ in range(50):
        fit.observe(pd(200.0, fit.value), 300.0)
    assert fit.value == pytest.approx(0.1, abs=1e-3)
    # a sample is judged by the prefill leg predicted at its decision, whatever the estimate is now
    before = fit.value
    fit.observe(pd(200.0, transfer=5.0), 300.0)
    assert fit.value == pytest.approx(before, abs=1e-4)  # the old reading (remote - today x uncached): -0.02
    fit.observe(pd(300.0), 0.0)  # faster than predicted: >= 0
    assert fit.value >= 0.0
    fit.observe(Disagg("decode-only", "below_threshold", uncached_tokens=0), 10.0)  # not a sample
    assert fit.samples == 53


def test_roles_come_from_the_pod_label_and_the_config() -> None:
    values = ("prefill", "decode", "prefill-decode", "both", None, "", "encode-prefill", "encode", "prefil")
    assert [role_of(v) for v in values] == [
        "prefill", "decode", "both", "both", "decode", "decode", "prefill", "none", "none",
    ]  # fmt: skip
    pod = {
        "metadata": {"name": "vllm-0", "labels": {"llm-d.ai/role": "decode"}},
        "status": {"podIP": "10.1.0.5", "conditions": [{"type": "Ready", "status": "True"}]},
    }
    assert parse_pod(pod)[1].role == "decode"
    pod["metadata"]["labels"] = {"app": "x"}
    assert parse_pod(pod)[1].role == "decode"
    s = parse_settings({"pool": {"backends": POOL}})
    assert [b.role for b in s.pool.engines] == ["decode", "decode", "prefill"]


def test_bad_disaggregation_settings_are_refused_with_their_path() -> None:
    with pytest.raises(ConfigError) as e:
        parse_settings({"disaggregation": {"fallback": "local"}})
    assert "disaggregation.fallback" in str(e.value)
    with pytest.raises(ConfigError) as e:
        parse_settings({"pool": {"backends": [{"name": "a", "address": "10.0.0.1:1", "role": "encode"}]}})
    assert "pool.backends" in str(e.value) and "role" in str(e.value)


def test_decisions_admission_and_flow_control_see_the_decode_endpoints_only() -> None:
    app = make_app({}, prompt_tokens=10)
    assert [s.endpoint.name for s in app.pool.decode_view().states] == ["d1", "d2"]
    assert [s.endpoint.name for s in app.pool.view().states] == ["d1", "d2", "p1"]
    both = app_of({"pool": {"backends": [{"name": "x", "address": "10.0.0.1:1"}]}})
    assert both.pool.decode_view() is both.pool.view()  # no roles: the same snapshot, no copy


async def test_the_prefill_endpoint_is_expected_to_hold_the_prompt_before_its_events_say_so() -> None:
    app = make_app({}, prompt_tokens=2000)
    keys = list(range(1, 126))

    class Keyed(FixedHolds):
        async def lookup(self, facts: RequestFacts) -> KvLookup:
            return KvLookup({}, 2000, block_keys=keys)

    app.path.holds = Keyed({}, 2000)
    ex = await route(app)
    assert isinstance(ex, Exchange) and ex.decision.disagg is not None and ex.decision.disagg.prefill is not None
    held = app.path.placements.holds(keys, time.monotonic())
    assert held.get("p1") == len(keys)
    ex.end(completed=True)


async def test_the_suspected_fallback_stays_within_each_role() -> None:
    """Every decode endpoint suspected (its probe pending) and the prefill one fine: the request still goes to a
    suspected decode endpoint, not a 503; and a suspected prefill endpoint, the only one, is still named."""
    app = make_app({}, prompt_tokens=2000)
    for name in ("d1", "d2"):
        app.pool.suspect(name, "test")
    ex = await route(app)
    assert isinstance(ex, Exchange) and ex.decision.endpoint.name in ("d1", "d2")
    ex.end(completed=True)
    app2 = make_app({}, prompt_tokens=2000)
    app2.pool.suspect("p1", "test")
    ex = await route(app2)
    assert isinstance(ex, Exchange) and ex.decision.disagg is not None and ex.decision.disagg.prefill is not None
    assert ex.decision.disagg.prefill.name == "p1"
    ex.end(completed=True)


async def test_the_subset_hint_bounds_the_prefill_candidates_too() -> None:
    pool = [*POOL, {"name": "p2", "address": "10.0.0.4:8000", "role": "prefill"}]
    app = make_app({}, prompt_tokens=2000, pool=pool)
    subset = ["10.0.0.1:8000", "10.0.0.4:8000"]
    for _ in range(4):
        ex = await app.path.route(Inbound(CHAT, {":method": "POST"}, body(), subset=subset))
        assert isinstance(ex, Exchange) and ex.decision.disagg is not None and ex.decision.disagg.prefill is not None
        assert (ex.decision.endpoint.name, ex.decision.disagg.prefill.name) == ("d1", "p2")
        ex.end(completed=True)


async def test_streams_decoding_on_the_decode_endpoint_weigh_against_a_local_prefill() -> None:
    """The prefill endpoint has 10,000 tokens queued (a remote prefill is predicted 1.2 s, the local one 0.2 s): with
    eight streams decoding on each decode endpoint, a local prefill would stall each of them for its 0.2 s, so the
    prefill still goes remote; without the stall's weight the request's own TTFT decides and keeps it local. Far
    more queued there (80,000 tokens), the stall is worth it: local."""
    cases = ((1.0, 10_000, "cost"), (0.0, 10_000, "cheaper_local"), (1.0, 80_000, "cheaper_local"))
    for weight, queued, expected in cases:
        app = make_app({}, prompt_tokens=2000, max_ttft_ratio=1.0, decode_stall_weight=weight)
        p1 = app.pool.endpoint("p1")
        assert p1 is not None
        held = [app.pool.acquire(p1, queued)]
        for name in ("d1", "d2") * 8:  # eight streams decoding on each
            ep = app.pool.endpoint(name)
            assert ep is not None
            lease = app.pool.acquire(ep, 10)
            lease.first_byte()
            held.append(lease)
        ex = await route(app)
        assert isinstance(ex, Exchange) and ex.decision.disagg is not None
        d = ex.decision.disagg
        assert d.reason == expected, (weight, d)
        assert d.stall_ms is not None and (d.stall_ms > 0) == (weight > 0)
        ex.end(completed=True)
        for lease in held:
            lease.release()


async def test_disaggregation_is_hot_reloadable() -> None:
    app = make_app({}, prompt_tokens=2000)
    ex = await route(app)
    assert isinstance(ex, Exchange) and ex.decision.disagg is not None
    ex.end(completed=True)
    off = app.settings.model_copy(update={"disaggregation": app.settings.disaggregation.model_copy(
        update={"enabled": False})})  # fmt: skip
    assert app.apply(off) == []
    ex = await route(app)
    assert isinstance(ex, Exchange) and ex.decision.disagg is None and ex.decision.endpoint.name in ("d1", "d2")
    ex.end(completed=True)
    assert app.path.disagg.report()["enabled"] is False
