"""The request path's stages in order (parse → cache → prepare → decide → commit) and the response
observers, without Envoy: what each stage hands the next and what it must not do."""

from __future__ import annotations

import json
import time

from picker.cache.state import CacheState
from picker.facts import Answer, RequestFacts
from picker.kv.stage import KvLookup
from picker.request.exchange import Exchange
from picker.request.path import Inbound
from picker.routing.endpoints import BackendHold, StorageTier
from picker.runtime.app import PickerApp
from tests.support.builders import BACKENDS, CHAT, FixedHolds, app_of


def make_app(**extra) -> PickerApp:
    return app_of(
        {
            "selection_strategy": "PrefixAwareHash",
            "prefix_routing": {"enabled": True},
            "pool": {"backends": BACKENDS},
        }
        | extra
    )


def chat_body(system: str = "you are helpful") -> bytes:
    return json.dumps(
        {"model": "m", "messages": [{"role": "system", "content": system}, {"role": "user", "content": "q"}]}
    ).encode()


def sample(app: PickerApp, name: str, labels: dict[str, str] | None = None) -> float | None:
    return app.metrics.registry.get_sample_value(name, labels or {})


def in_flight(app: PickerApp) -> dict[str, int]:
    return app.pool.in_flight()


async def test_bad_request_stops_at_parse() -> None:
    app = make_app()
    out = await app.path.route(Inbound(CHAT, {":method": "POST"}, b"{not json"))
    assert isinstance(out, Answer) and out.status == 400 and json.loads(out.body)["error"]["code"] == "invalid_json"
    assert sample(app, "continuum_picker_requests_total", {"outcome": "bad_request"}) == 1
    assert in_flight(app) == {"a": 0, "b": 0}  # nothing committed
    assert sample(app, "continuum_picker_decision_seconds_count") == 0


async def test_empty_body_on_an_inference_path_is_refused() -> None:
    out = await make_app().path.route(Inbound(CHAT, {":method": "POST"}, b""))
    assert isinstance(out, Answer) and out.status == 400 and b"empty_body" in out.body


async def test_routed_request_commits_once_and_releases_once() -> None:
    app = make_app()
    ex = await app.path.route(Inbound(CHAT, {":method": "POST"}, chat_body()))
    assert isinstance(ex, Exchange)
    name = ex.decision.endpoint.name
    assert in_flight(app)[name] == 1 and ex.decision.reason == "prefix_hash"
    assert app.recorder.counts["prefix_hash"] == 1 and len(app.recorder.prefixes_seen) == 1
    assert sample(app, "continuum_picker_decision_seconds_count") == 1
    ex.end(completed=True)
    ex.end(completed=False)  # the stream's close after a completed response: no second release
    assert in_flight(app) == {"a": 0, "b": 0}


async def test_subset_hint_outside_the_pool_is_503() -> None:
    app = make_app()
    out = await app.path.route(Inbound(CHAT, {":method": "POST"}, chat_body(), subset=["10.9.9.9:1"]))
    assert isinstance(out, Answer) and out.status == 503 and b"subset hint" in out.body
    assert sample(app, "continuum_picker_requests_total", {"outcome": "no_backend"}) == 1


async def test_path_only_routing_when_the_body_comes_after_the_pick() -> None:
    ex = await make_app().path.route(Inbound(CHAT, {":method": "POST"}, None))
    assert isinstance(ex, Exchange) and ex.facts.model is None and ex.decision.reason == "fallback"


class StoredAnswers:
    """A response-cache stage (the path's ``ResponseCache``) that answers every request for model ``m``."""

    enabled = True
    wants_body = False

    def __init__(self) -> None:
        self.looked_up: list[RequestFacts] = []

    async def lookup(self, facts: RequestFacts, body, headers=None, *, semantic_ok=None, data=None):
        self.looked_up.append(facts)
        if facts.model == "m":
            return Answer(200, b'{"cached":true}', "kv_epp_cache_hit", (("x-cache", "HIT"),))
        return CacheState("BYPASS")

    def on_headers(self, ex: Exchange, status: int | None) -> None:
        return None

    def on_body(self, ex: Exchange, chunk: bytes, end: bool) -> None:
        return None

    def on_end(self, ex: Exchange, completed: bool) -> None:
        return None


class CountingHolds:
    def __init__(self) -> None:
        self.calls = 0

    async def lookup(self, facts: RequestFacts) -> KvLookup:
        self.calls += 1
        return KvLookup({"b": BackendHold(8, StorageTier.GPU_HOT)})

    def page_tokens(self, backend: str) -> int | None:
        return None


async def test_a_cache_hit_skips_prepare_decide_and_commit() -> None:
    app = make_app(kv_cache_index={"enabled": True})
    holds, cache = CountingHolds(), StoredAnswers()
    app.path.holds, app.path.cache = holds, cache
    app.path.configure(app.settings)
    out = await app.path.route(Inbound(CHAT, {":method": "POST"}, chat_body()))
    assert out == Answer(200, b'{"cached":true}', "kv_epp_cache_hit", (("x-cache", "HIT"),))
    assert len(cache.looked_up) == 1 and holds.calls == 0 and in_flight(app) == {"a": 0, "b": 0}
    assert app.recorder.outcomes["cache_hit"] == 1 and app.recorder.outcomes["routed"] == 0  # counted as a hit


async def test_prepare_awaits_the_holds_and_decide_uses_them() -> None:
    app = make_app(kv_cache_index={"enabled": True})
    holds = CountingHolds()
    app.path.holds = holds
    app.path.configure(app.settings)
    ex = await app.path.route(Inbound(CHAT, {":method": "POST"}, chat_body()))
    assert isinstance(ex, Exchange) and holds.calls == 1
    assert ex.decision.reason == "kv_aware" and ex.decision.endpoint.name == "b"
    assert app.recorder.kv.kv_aware == 1
    # no prefix key (no text to key on): Tier 4 is not consulted at all
    bare = json.dumps({"model": "m", "messages": [{"role": "user", "content": ""}]}).encode()
    ex2 = await app.path.route(Inbound(CHAT, {":method": "POST"}, bare))
    assert isinstance(ex2, Exchange) and holds.calls == 1 and ex2.decision.reason == "fallback"


class BodyTap:
    wants_body = True

    def __init__(self) -> None:
        self.events: list[tuple[str, object]] = []

    def on_headers(self, ex: Exchange, status: int | None) -> None:
        self.events.append(("headers", status))

    def on_body(self, ex: Exchange, chunk: bytes, end: bool) -> None:
        self.events.append(("body", chunk))

    def on_end(self, ex: Exchange, completed: bool) -> None:
        self.events.append(("end", completed))


async def test_observers_see_status_body_and_end() -> None:
    app = make_app()
    # response bodies do not reach the picker (Envoy's response mode none): no body observer, no per-chunk work
    ex = await app.path.route(Inbound(CHAT, {":method": "POST"}, chat_body(), responses_readable=False))
    assert isinstance(ex, Exchange) and not ex.wants_body
    ex.response_headers(503)
    ex.end(completed=True)
    name = ex.decision.endpoint.name
    assert app.pool.success_rate(name) == 0.0  # the health observer charged the endpoint that served
    assert sample(app, "continuum_picker_backend_responses_total", {"backend": name, "status_class": "5xx"}) == 1

    tap = BodyTap()
    app.path.observers += (tap,)
    app.path.body_observers = (tap,)
    ex = await app.path.route(Inbound(CHAT, {":method": "POST"}, chat_body("other")))
    assert isinstance(ex, Exchange) and ex.wants_body
    ex.response_headers(200)
    ex.response_body(b"data: 1\n\n", end=False)
    ex.response_body(b"data: [DONE]\n\n", end=True)
    ex.end(completed=False)  # the stream closes afterwards: observers are not told twice
    assert tap.events == [("headers", 200), ("body", b"data: 1\n\n"), ("body", b"data: [DONE]\n\n"), ("end", True)]
    assert ex.first_byte_at is not None and ex.first_byte_at >= ex.decided_at


class Broken(BodyTap):
    """An observer with a bug (or an input it did not foresee): every callback raises."""

    def on_headers(self, ex: Exchange, status: int | None) -> None:
        raise TypeError("unhashable type: 'list'")

    def on_body(self, ex: Exchange, chunk: bytes, end: bool) -> None:
        raise ValueError("bad chunk")

    def on_end(self, ex: Exchange, completed: bool) -> None:
        raise KeyError("x")


async def test_an_observer_that_raises_stops_neither_the_response_nor_the_others() -> None:
    from picker.request import exchange as path_module

    app = make_app()
    tap = BodyTap()
    app.path.observers = (Broken(), *app.path.observers, tap)
    app.path.body_observers = (Broken(), tap)
    before = dict(path_module.OBSERVER_FAILURES)
    ex = await app.path.route(Inbound(CHAT, {":method": "POST"}, chat_body()))
    assert isinstance(ex, Exchange)
    ex.response_headers(200)
    ex.response_body(b"{}", end=True)  # no exception reaches the protocol layer
    assert tap.events == [("headers", 200), ("body", b"{}"), ("end", True)]
    assert in_flight(app) == {"a": 0, "b": 0}  # the slot was freed all the same
    assert app.pool.success_rate(ex.decision.endpoint.name) == 1.0  # the health observer after it still ran
    after = path_module.OBSERVER_FAILURES
    for method in ("on_headers", "on_body", "on_end"):
        assert after[("Broken", method)] == before.get(("Broken", method), 0) + 1


async def test_an_aborted_stream_ends_the_exchange_uncompleted() -> None:
    app = make_app()
    tap = BodyTap()
    app.path.observers += (tap,)
    ex = await app.path.route(Inbound(CHAT, {":method": "POST"}, chat_body()))
    assert isinstance(ex, Exchange)
    ex.end(completed=False)
    assert tap.events == [("end", False)] and in_flight(app) == {"a": 0, "b": 0}


def cached_tokens(app: PickerApp, reason: str, scope: str, kind: str) -> float | None:
    return sample(app, "continuum_picker_cached_tokens_total", {"reason": reason, "scope": scope, "kind": kind})


async def test_cached_token_accounting_books_the_best_holder_and_the_pick() -> None:
    """A kv_aware pick that is not the best holder (the best one is busier): available is the best holder's
    matched tokens, captured the pick's, both per decision (scope "all"); nothing observed without a usage."""
    app = make_app(kv_cache_index={"enabled": True, "scoring": {"mode": "overlap"}})
    holds = {"a": BackendHold(8, StorageTier.GPU_HOT), "b": BackendHold(6, StorageTier.GPU_HOT)}
    app.path.holds = FixedHolds(holds, prompt_tokens=200)
    app.path.configure(app.settings)
    busy = app.pool.acquire(app.pool.endpoint("a"))  # a is loaded: b's score 0.85 beats a's 0.70
    ex = await app.path.route(Inbound(CHAT, {":method": "POST"}, chat_body()))
    assert isinstance(ex, Exchange) and ex.decision.reason == "kv_aware" and ex.decision.endpoint.name == "b"
    assert ex.kv is not None and (ex.kv.prompt_tokens, ex.kv.available_cached, ex.kv.predicted_cached) == (
        200, 8 * 16, 6 * 16,
    )  # fmt: skip
    assert cached_tokens(app, "kv_aware", "all", "prompt") == 200
    assert cached_tokens(app, "kv_aware", "all", "available") == 128
    assert cached_tokens(app, "kv_aware", "all", "captured") == 96
    assert cached_tokens(app, "kv_aware", "observed", "delivered") == 0  # no response was read
    busy.release()
    ex.end(completed=True)

    # the best holder picked: available == captured; a hold longer than the prompt is capped at its length
    app.path.holds = FixedHolds({"a": BackendHold(20, StorageTier.GPU_HOT)}, prompt_tokens=100)
    ex = await app.path.route(Inbound(CHAT, {":method": "POST"}, chat_body("other")))
    assert isinstance(ex, Exchange) and ex.decision.endpoint.name == "a"
    assert ex.kv is not None and (ex.kv.available_cached, ex.kv.predicted_cached) == (100, 100)
    assert cached_tokens(app, "kv_aware", "all", "available") == 228
    assert cached_tokens(app, "kv_aware", "all", "captured") == 196
    ex.end(completed=True)

    # not tokenized (Tier 4 off): no prediction, nothing booked under the decision's reason
    plain = make_app()
    ex = await plain.path.route(Inbound(CHAT, {":method": "POST"}, chat_body()))
    assert isinstance(ex, Exchange) and ex.kv is None
    assert cached_tokens(plain, ex.decision.reason, "all", "prompt") is None


class KeyedHolds:
    """Tier 4's answer with the request's block keys (what the commit stage places and watches)."""

    def __init__(self, keys: list[int], page: int | None = None, prompt_tokens: int | None = None) -> None:
        self.keys = keys
        self.page = page  # the engine's page size as its events announce it (None: unknown)
        self.prompt_tokens = prompt_tokens if prompt_tokens is not None else len(keys) * 16

    async def lookup(self, facts: RequestFacts) -> KvLookup:
        return KvLookup({}, self.prompt_tokens, block_keys=self.keys)

    def page_tokens(self, backend: str) -> int | None:
        return self.page


async def test_a_pick_is_placed_and_watched_until_its_kv_events_and_a_failed_one_is_undone() -> None:
    app = make_app(kv_cache_index={"enabled": True})
    app.path.holds = KeyedHolds([11, 12, 13])
    app.path.configure(app.settings)
    placements = app.path.placements
    assert placements is not None
    ex = await app.path.route(Inbound(CHAT, {":method": "POST"}, chat_body()))
    assert isinstance(ex, Exchange) and ex.decision.reason == "kv_cost"
    name = ex.decision.endpoint.name
    assert placements.holds([11, 12, 13], time.monotonic()) == {name: 3}  # placed before any KV event
    ex.response_headers(200)  # headers before prefill (vLLM): still pending
    st = app.pool.view().by_name()[name]
    assert st.pending_prefill_tokens == 48 and st.decoding == 0
    placements.wrote(name, [11, 12, 13])  # the engine stored the request's blocks
    st = app.pool.view().by_name()[name]
    assert st.pending_prefill_tokens == 0 and st.decoding == 1 and app.pool.calibrator.samples == 1
    ex.end(completed=True)

    app.path.holds = KeyedHolds([21, 22])
    failed = await app.path.route(Inbound(CHAT, {":method": "POST"}, chat_body("another system prompt")))
    assert isinstance(failed, Exchange)
    assert placements.holds([21, 22], time.monotonic()) == {failed.decision.endpoint.name: 2}
    failed.response_headers(503)  # not cached there after all: the guess goes
    assert placements.holds([21, 22], time.monotonic()) == {}
    failed.end(completed=True)
    assert all(s.in_flight == 0 and s.pending_prefill_tokens == 0 for s in app.pool.view().states)


async def test_the_prefill_is_timed_on_the_last_block_of_the_engines_full_pages() -> None:
    """Pages of 32 tokens and a 56-token prompt (3 key blocks of 16): the engine stores page 0 (blocks 0-1) at
    prefill and page 1 only once decoding fills it; the prefill ends with block 1's store, not block 2's."""
    app = make_app(kv_cache_index={"enabled": True})
    app.path.holds = KeyedHolds([31, 32, 33], page=32, prompt_tokens=56)
    app.path.configure(app.settings)
    placements = app.path.placements
    assert placements is not None
    ex = await app.path.route(Inbound(CHAT, {":method": "POST"}, chat_body()))
    assert isinstance(ex, Exchange)
    name = ex.decision.endpoint.name
    ex.response_headers(200)
    placements.wrote(name, [31, 32])  # page 0 stored: the prefill is done
    st = app.pool.view().by_name()[name]
    assert st.pending_prefill_tokens == 0 and st.decoding == 1 and app.pool.calibrator.samples == 1
    ex.end(completed=True)

    # a prompt inside one page: nothing the engine stores at prefill ends it, so nothing is timed
    app.path.holds = KeyedHolds([41], page=32, prompt_tokens=20)
    short = await app.path.route(Inbound(CHAT, {":method": "POST"}, chat_body("another system prompt")))
    assert isinstance(short, Exchange)
    short.response_headers(200)  # no watch: the headers end its pending prefill
    assert app.pool.view().by_name()[short.decision.endpoint.name].pending_prefill_tokens == 0
    short.end(completed=True)
    assert app.pool.calibrator.samples == 1
