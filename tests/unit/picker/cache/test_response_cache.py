"""Tier 2's exact response cache without Envoy: the key's byte layout, eligibility, entries, the SSE replay,
the buffering bounds, and the stage + observer on the real request path (a dict-backed store)."""

from __future__ import annotations

import hashlib
import json
import struct
from typing import Any

import pytest

from picker.cache import grammar, storing
from picker.cache import response_cache as rc
from picker.cache.entry import CacheEntry, EntryError
from picker.cache.grammar import complete_stream, sse_events, sse_replay
from picker.cache.key import cache_key, canonical_json, eligible, key_material
from picker.cache.response_cache import ResponseCache
from picker.config import ConfigError, parse_settings
from picker.facts import Answer, RequestFacts, parse_request
from picker.request.exchange import Exchange
from picker.runtime.app import PickerApp
from tests.support.builders import BACKENDS, CHAT, route
from tests.support.response_cache import OK, DictStore, make, req, respond


def facts_of(data: dict[str, Any], path: str = CHAT, tenant: str | None = None) -> RequestFacts:
    return parse_request(json.dumps(data).encode(), path, max_body_bytes=1 << 20, tenant_id=tenant)


def key_of(data: dict[str, Any], path: str = CHAT, tenant: str | None = None) -> str | None:
    return cache_key(facts_of(data, path, tenant), data)


# -- the key -----------------------------------------------------------------------------------------------
def test_key_material_is_the_documented_byte_layout() -> None:
    data = req(temperature=0, max_tokens=16, top_p=0.5, tools=[{"type": "function"}])
    got = key_material(facts_of(data, tenant="acme"), data)
    rest = {"tools": [{"type": "function"}], "api": "chat"}
    want = b"".join(
        (
            b"m", b"\x00",
            hashlib.sha256(b'[{"content":"hi","role":"user"}]').digest(), b"\x00",
            b"\x01" + struct.pack(">d", 0.0), b"\x00",
            b"\x01" + struct.pack(">q", 16), b"\x00",
            b"\x01" + struct.pack(">d", 0.5), b"\x00",
            b"\x01acme", b"\x00",
            hashlib.sha256(json.dumps(rest, sort_keys=True, separators=(",", ":")).encode()).digest(),
        )
    )  # fmt: skip
    assert got == want
    assert key_of(data, tenant="acme") == hashlib.sha256(want).hexdigest()
    absent = key_material(facts_of(req()), req())
    assert absent is not None and absent.count(b"\x00\x00") >= 3  # NONE tags: temperature, max_tokens, top_p, tenant


def test_none_and_some_zero_never_collide() -> None:
    base = key_of(req())
    assert key_of(req(temperature=0)) != base  # absent temperature is not 0
    assert key_of(req(max_tokens=0)) != base
    assert key_of(req(top_p=0)) != base
    assert key_of(req(), tenant="") != base  # an empty tenant header is not no tenant
    assert key_of(req(temperature=0)) == key_of(req(temperature=0.0)) == key_of(req(temperature=-0.0))


def test_key_is_canonical_and_sees_every_field_that_shapes_the_answer() -> None:
    a = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"temperature":0}'
    b = b'{ "temperature" : 0 ,\n "messages" : [ { "content" : "hi" , "role" : "user" } ], "model" : "m" }'
    fa = parse_request(a, CHAT, max_body_bytes=1 << 20)
    fb = parse_request(b, CHAT, max_body_bytes=1 << 20)
    assert cache_key(fa, json.loads(a)) == cache_key(fb, json.loads(b))  # whitespace and key order
    base = key_of(req(temperature=0))
    for other in (
        req(temperature=0, model="m2"),
        req(temperature=0, messages=[{"role": "user", "content": "hi!"}]),
        req(temperature=0, stream=True),
        req(temperature=0, tools=[{"type": "function", "function": {"name": "f"}}]),
        req(temperature=0, response_format={"type": "json_object"}),
        req(temperature=0, seed=1),
        req(temperature=0, stop=["x"]),
        req(temperature=0, max_tokens=5),
        req(temperature=0, top_p=1),
    ):
        assert key_of(other) != base, other
    assert key_of(req(temperature=0), tenant="t1") != key_of(req(temperature=0), tenant="t2")
    assert key_of(req(temperature=0), path="/v1/messages") != base  # the API is keyed


def test_completions_prompt_is_keyed_whole() -> None:
    p = "/v1/completions"
    one = {"model": "m", "prompt": ["a", "b"], "temperature": 0}
    other = {"model": "m", "prompt": ["a", "c"], "temperature": 0}
    assert facts_of(one, p).prompt == facts_of(other, p).prompt == "a"  # routing keys the first element only
    assert key_of(one, p) != key_of(other, p)
    ids = {"model": "m", "prompt": [1, 2, 3]}
    assert key_of(ids, p) != key_of({"model": "m", "prompt": [1, 2, 4]}, p)


def test_unkeyable_requests() -> None:
    data = req(model="a\x00b")
    assert key_of(data) is None  # a NUL in the model would make the layout ambiguous
    assert key_of(req(max_tokens=1 << 63)) is None
    deep: Any = "x"
    for _ in range(300):  # orjson reads 1,024 levels but writes about 254: the key's canonical JSON cannot be made
        deep = [deep]
    assert json.loads(json.dumps(req(tools=deep)))  # a body the request parser accepts
    assert key_of(req(tools=deep)) is None


async def test_a_body_too_deep_to_key_is_routed_as_a_bypass() -> None:
    """It raised out of the route (an internal-error 500 and a traceback per request) before."""
    app, _, _ = make()
    deep: Any = {"a": 1}
    for _ in range(300):
        deep = [deep]
    ex = await route(app, req(temperature=0, tools=deep))
    assert isinstance(ex, Exchange) and ex.x_cache == "BYPASS" and ex.cache.key is None
    assert count(app, "skip") == 1


def test_eligibility() -> None:
    assert eligible(facts_of(req()))
    assert eligible(facts_of(req(temperature=0, stream=True)))  # streams are buffered, always
    assert not eligible(facts_of(req(temperature=0.7)))
    assert eligible(facts_of({"model": "m", "prompt": "x"}, "/v1/completions"))
    assert eligible(facts_of(req(max_tokens=8), "/v1/messages"))
    assert not eligible(facts_of({"model": "m", "input": "x"}, "/v1/responses"))
    assert not eligible(RequestFacts(api="other"))


def test_canonical_json_form() -> None:
    assert canonical_json({"b": 1, "a": [1.5, "é", {"d": None, "c": True}]}) == (
        '{"a":[1.5,"é",{"c":true,"d":null}],"b":1}'.encode()
    )
    assert canonical_json(1) != canonical_json(1.0)


# -- entries and SSE -----------------------------------------------------------------------------------------
def test_entry_round_trip_and_refusals() -> None:
    e = CacheEntry(200, (("content-type", "application/json"), ("x-engine", "é")), b'{"x":1}')
    assert CacheEntry.decode(e.encode()) == e
    s = CacheEntry(200, (("content-type", "text/event-stream"),), b"data: [DONE]\n\n", stream=True)
    assert CacheEntry.decode(s.encode()) == s
    forged = CacheEntry(0, e.headers, e.body).encode()  # only a 200 is ever stored: anything else was written
    for bad in (b"", b"XXXX" + e.encode()[4:], e.encode()[:12], forged, CacheEntry(404, (), b"").encode()):
        with pytest.raises(EntryError):  # by someone else, or corrupted: a miss
            CacheEntry.decode(bad)
    a = e.answer()
    assert a.status == 200 and a.body == e.body and ("x-cache", "HIT") in a.headers


def test_sse_parse_is_strict_and_the_replay_is_standard() -> None:
    raw = b'data: {"a":1}\r\n\r\n: comment\nid: 7\ndata:{"b":2}\ndata: more\n\nevent: ping\ndata: x\n\ndata: [DONE]\n\n'
    events = sse_events(raw)
    assert events == [(None, b'{"a":1}'), (None, b'{"b":2}\nmore'), ("ping", b"x"), (None, b"[DONE]")]
    assert sse_replay(events) == (
        b'data: {"a":1}\n\ndata: {"b":2}\ndata: more\n\nevent: ping\ndata: x\n\ndata: [DONE]\n\n'
    )
    assert sse_events(sse_replay(events)) == events
    assert sse_events(b'data: {"a":1}\n\ndata: [DO') is None  # cut mid-event
    assert sse_events(b'data: {"a":1}\n') is None  # no blank line after the last event
    assert sse_events(b"\n\n") is None  # no event
    assert complete_stream("chat", events) and not complete_stream("chat", events[:-1])
    anthropic = sse_events(b"event: message_start\ndata: {}\n\nevent: message_stop\ndata: {}\n\n")
    assert anthropic is not None and complete_stream("anthropic", anthropic)


def count(app: PickerApp, result: str) -> float | None:
    return app.metrics.registry.get_sample_value("continuum_response_cache_requests_total", {"result": result})


async def test_miss_is_stored_then_hit_without_routing() -> None:
    app, cache, store = make()
    ex = await route(app, req(temperature=0))
    assert isinstance(ex, Exchange) and ex.x_cache == "MISS" and ex.cache.key is not None and ex.wants_body
    respond(ex, [OK[:11], OK[11:]])
    await cache.flush()
    assert list(store.data) == [ex.cache.key] and store.ttls[ex.cache.key] == 300.0
    # only the allow-list (response_cache.stored_headers) reaches the store: no date, no engine header
    assert CacheEntry.decode(store.data[ex.cache.key]).headers == (("content-type", "application/json"),)
    hit = await route(app, req(temperature=0))
    assert isinstance(hit, Answer) and hit.status == 200 and hit.body == OK
    assert dict(hit.headers) == {"content-type": "application/json", "x-cache": "HIT"}
    assert app.pool.in_flight() == {"a": 0, "b": 0}
    assert (count(app, "hit"), count(app, "miss"), count(app, "skip")) == (1, 1, 0)
    assert cache.buffered == 0


async def test_bypass_is_routed_and_never_stored() -> None:
    app, cache, store = make()
    ex = await route(app, req(temperature=0.7))
    assert isinstance(ex, Exchange) and ex.x_cache == "BYPASS" and ex.cache.key is None
    assert cache not in ex._body_observers  # only an eligible miss's body is read (by the cache)
    respond(ex, [b"{}"])
    await cache.flush()
    assert store.data == {} and count(app, "skip") == 1


async def test_disabled_cache_is_not_consulted() -> None:
    app, cache, _ = make()
    cache.configure(parse_settings({"response_cache": {"enabled": False}}).response_cache)
    ex = await route(app, req(temperature=0))
    assert isinstance(ex, Exchange) and ex.x_cache is None and count(app, "skip") == 0


async def test_only_a_complete_200_within_the_bound_is_stored() -> None:
    app, cache, store = make(max_response_size=10)
    ex = await route(app, req(temperature=0))
    assert isinstance(ex, Exchange)
    respond(ex, [b"123456", b"78901"])  # 11 bytes > 10: buffer dropped at the chunk that passes the bound
    assert ex.cache.buf is None and cache.buffered == 0
    ex = await route(app, req(temperature=0))
    assert isinstance(ex, Exchange)
    respond(ex, [b"{}"], status=500)
    ex = await route(app, req(temperature=0))
    assert isinstance(ex, Exchange)
    ex.cache.headers = (("content-type", "application/json"),)
    ex.response_headers(200)
    ex.response_body(b"{", False)
    ex.end(completed=False)  # the stream closed before the body ended
    ex = await route(app, req(temperature=0))
    assert isinstance(ex, Exchange)
    ex.cache.headers = (("content-type", "application/json"),)
    ex.response_headers(200)
    ex.end(completed=True)  # response mode none: no body reached the picker
    await cache.flush()
    assert store.data == {} and cache.buffered == 0
    assert cache.not_stored == {"too_large": 1, "status": 1, "incomplete": 2}


async def test_declared_length_over_the_bound_is_not_buffered() -> None:
    app, cache, _ = make(max_response_size=10)
    ex = await route(app, req(temperature=0))
    assert isinstance(ex, Exchange)
    ex.cache.headers = (("content-length", "11"),)
    ex.response_headers(200)
    assert ex.cache.buf is None and cache.not_stored == {"too_large": 1}


async def test_all_buffers_together_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(storing, "MAX_BUFFERED_TOTAL", len(OK) + 20)
    app, cache, _ = make()
    one, two = await route(app, req(temperature=0)), await route(app, req(temperature=0, seed=2))
    assert isinstance(one, Exchange) and isinstance(two, Exchange)
    for ex in (one, two):
        ex.cache.headers = ()
        ex.response_headers(200)
    one.response_body(OK[:-1], False)
    two.response_body(b'{"b":"12345678901234567', False)  # 21 over the rest: the second is dropped, the first goes on
    assert one.cache.buf is not None and two.cache.buf is None and cache.buffered == len(OK) - 1
    one.response_body(OK[-1:], True)  # its entry (the body + 9 bytes encoded) fits the bound
    await cache.flush()
    assert cache.buffered == 0 and cache.not_stored == {"buffer_full": 1} and cache.stored == 1


async def test_stream_stored_as_replayable_sse_and_incomplete_streams_are_not() -> None:
    app, cache, store = make()
    sse = [
        b'data: {"choices":[{"index":0,"delta":{"content":"a"},"finish_reason":null}]}\n\n',
        b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\ndata: {"choices":[]}\n\n'
        b"data: [DONE]\n\n",
    ]
    ex = await route(app, req(temperature=0, stream=True))
    assert isinstance(ex, Exchange)
    respond(ex, sse, ctype="text/event-stream")
    cut = await route(app, req(temperature=0, stream=True, seed=9))
    assert isinstance(cut, Exchange)
    respond(cut, sse[:1], ctype="text/event-stream")  # ended without data: [DONE]
    await cache.flush()
    assert len(store.data) == 1
    hit = await route(app, req(temperature=0, stream=True))
    assert isinstance(hit, Answer) and hit.body == b"".join(sse) and ("x-cache", "HIT") in hit.headers
    assert ("content-type", "text/event-stream") in hit.headers
    not_stream = await route(app, req(temperature=0))  # the JSON form is another key
    assert isinstance(not_stream, Exchange) and not_stream.x_cache == "MISS"


async def test_store_failures_are_misses() -> None:
    store = DictStore()
    store.fail = True
    app, cache, _ = make(store)
    ex = await route(app, req(temperature=0))
    assert isinstance(ex, Exchange) and ex.x_cache == "MISS"
    respond(ex, [OK])
    await cache.flush()
    assert cache.not_stored == {"store_error": 1}
    store.fail = False
    store.data[str(ex.cache.key)] = b"garbage"  # not an entry: a miss, not an error
    again = await route(app, req(temperature=0))
    assert isinstance(again, Exchange) and again.x_cache == "MISS"


async def test_tenants_do_not_share_entries() -> None:
    app, cache, _ = make()
    ex = await route(app, req(temperature=0), {"x-tenant-id": "t1"})
    assert isinstance(ex, Exchange)
    respond(ex, [OK])
    await cache.flush()
    other = await route(app, req(temperature=0), {"x-tenant-id": "t2"})
    assert isinstance(other, Exchange) and other.x_cache == "MISS"
    same = await route(app, req(temperature=0), {"x-tenant-id": "t1"})
    assert isinstance(same, Answer)


async def test_enabled_and_limits_are_hot_reloadable() -> None:
    app, cache, _ = make()
    off = parse_settings({"pool": {"backends": BACKENDS}, "response_cache": {"enabled": False}})
    app.apply(off)
    ex = await route(app, req(temperature=0))
    assert isinstance(ex, Exchange) and ex.x_cache is None and cache not in ex._body_observers
    on = parse_settings(
        {"pool": {"backends": BACKENDS}, "response_cache": {"enabled": True, "capacity": 7, "ttl": "1m"}}
    )
    app.apply(on)
    ex = await route(app, req(temperature=0))
    assert isinstance(ex, Exchange) and ex.x_cache == "MISS" and cache.ttl == 60.0


# -- review findings: only finished answers, headers, invalidation, write bytes, stream bound, tenant bytes ------
STREAM_OK = [
    b'data: {"choices":[{"index":0,"delta":{"content":"a"},"finish_reason":null}]}\n\n',
    b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n',
]


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b'{"choices":[{"message":{"content":"par"},"finish_reason":"abort"}]}', id="aborted"),
        pytest.param(b'{"choices":[{"message":{"content":"par"},"finish_reason":null}]}', id="unfinished"),
        pytest.param(b'{"error":{"message":"engine died"}}', id="error-object"),
        pytest.param(b'{"object":"error","message":"x"}', id="vllm-error"),
        pytest.param(b'{"choices":[{"message":{"content":"tru', id="unparsable"),
        pytest.param(b"[1,2]", id="not-an-object"),
        # accepted as finished before: no finish_reason at all, no choices, an empty list, one choice unfinished
        pytest.param(b'{"choices":[{"index":0,"message":{"content":"par"}}]}', id="no-finish-reason"),
        pytest.param(b'{"id":"x","object":"chat.completion"}', id="no-choices"),
        pytest.param(b'{"choices":[]}', id="empty-choices"),
        pytest.param(b'{"choices":{"0":{"finish_reason":"stop"}}}', id="choices-not-a-list"),
        pytest.param(
            b'{"choices":[{"index":0,"finish_reason":"stop"},{"index":1,"message":{"content":"p"}}]}',
            id="one-of-two-unfinished",
        ),
        pytest.param(b'{"choices":[{"index":"0","finish_reason":"stop"}]}', id="index-not-an-integer"),
        pytest.param(b'{"choices":[{"index":0,"finish_reason":"content_filter"}]}', id="content-filter"),
    ],
)
async def test_an_unfinished_or_error_body_is_not_stored(body: bytes) -> None:
    app, cache, store = make()
    ex = await route(app, req(temperature=0))
    assert isinstance(ex, Exchange)
    respond(ex, [body])
    await cache.flush()
    assert store.data == {} and cache.not_stored == {"unfinished": 1}


@pytest.mark.parametrize(
    "events",
    [
        pytest.param(
            [STREAM_OK[0], b'data: {"error":{"message":"CUDA out of memory"}}\n\ndata: [DONE]\n\n'], id="in-band-error"
        ),
        pytest.param(
            [STREAM_OK[0], b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"abort"}]}\n\ndata: [DONE]\n\n'],
            id="aborted",
        ),
        pytest.param([STREAM_OK[0], b"data: [DONE]\n\n"], id="no-finish-reason-after-null"),
        # accepted as finished before: no finish_reason key anywhere, no choice at all, one index of two unfinished
        pytest.param(
            [b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n', b"data: [DONE]\n\n"],
            id="no-finish-reason-key",
        ),
        pytest.param([b'data: {"choices":[]}\n\n', b"data: [DONE]\n\n"], id="no-choice"),
        pytest.param([b'data: {"id":"x"}\n\n', b"data: [DONE]\n\n"], id="no-choices-key"),
        pytest.param(
            [
                b'data: {"choices":[{"index":0,"delta":{"content":"a"},"finish_reason":null},'
                b'{"index":1,"delta":{"content":"b"},"finish_reason":null}]}\n\n',
                b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n',
            ],
            id="one-index-of-two-unfinished",
        ),
        pytest.param(
            [
                b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n',
                b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"abort"}]}\n\ndata: [DONE]\n\n',
            ],
            id="last-reason-abort",
        ),
        pytest.param([b"data: {not json}\n\n", b"data: [DONE]\n\n"], id="unparsable-event"),
    ],
)
async def test_an_error_ending_stream_is_not_stored(events: list[bytes]) -> None:
    app, cache, store = make()
    ex = await route(app, req(temperature=0, stream=True))
    assert isinstance(ex, Exchange)
    respond(ex, events, ctype="text/event-stream")
    await cache.flush()
    assert store.data == {} and cache.not_stored == {"unfinished": 1}
    ok = await route(app, req(temperature=0, stream=True, seed=3))
    assert isinstance(ok, Exchange)
    respond(ok, STREAM_OK, ctype="text/event-stream")  # the same shape, finished: stored
    await cache.flush()
    assert cache.stored == 1


def test_anthropic_endings() -> None:
    good = b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"end_turn"}}\n\n'
    stop = b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
    err = b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error"}}\n\n'
    for raw, want in (
        (good + stop, True),
        (good + err + stop, False),
        (good.replace(b"end_turn", b"refusal") + stop, False),
    ):
        events = sse_events(raw)
        assert events is not None and grammar.finished_stream("anthropic", events) is want, raw
    assert grammar.finished_body("anthropic", b'{"type":"message","stop_reason":"end_turn","content":[]}')
    assert not grammar.finished_body("anthropic", b'{"type":"message","stop_reason":null,"content":[]}')
    assert not grammar.finished_body("anthropic", b'{"type":"error","error":{"type":"api_error"}}')


def test_finished_is_strict_per_api() -> None:
    """Accepted before: an answer with no finish_reason/stop_reason at all, or the other API's shape."""
    start = b'event: message_start\ndata: {"type":"message_start","message":{"stop_reason":null}}\n\n'
    stop = b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
    delta = b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":%s}}\n\n'
    for raw, want in (
        (start + stop, False),  # no message_delta
        (start + delta % b"null" + stop, False),
        (start + delta % b'"max_tokens"' + stop, True),
        (start + delta % b'"pause_turn"' + stop, False),
        (start + delta % b'"tool_use"' + delta % b"null" + stop, True),  # the last non-null reason
    ):
        events = sse_events(raw)
        assert events is not None and grammar.finished_stream("anthropic", events) is want, raw
    assert not grammar.finished_body("anthropic", b'{"type":"message","content":[]}')  # no stop_reason
    assert not grammar.finished_body("anthropic", b'{"choices":[{"index":0,"finish_reason":"stop"}]}')  # OpenAI-shaped
    openai = b'{"choices":[{"index":0,"finish_reason":"tool_calls"},{"index":1,"finish_reason":"length"}]}'
    assert grammar.finished_body("chat", openai) and grammar.finished_body("completions", openai)
    assert not grammar.finished_body("chat", b'{"stop_reason":"end_turn"}')  # Anthropic-shaped on an OpenAI path
    assert not grammar.finished_body("responses", openai)
    two = sse_events(
        b'data: {"choices":[{"index":1,"delta":{},"finish_reason":"stop"}]}\n\n'
        b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"function_call"}]}\n\n'
        b'data: {"choices":[],"usage":{"total_tokens":3}}\n\ndata: [DONE]\n\n'
    )
    assert two is not None and grammar.finished_stream("chat", two) and grammar.finished_stream("completions", two)


def test_a_reason_that_is_not_a_string_is_not_finished() -> None:
    """A list or an object where the reason goes (a broken engine) raised TypeError (unhashable) out of the
    response observer before: the client lost a good answer to the servicer's 500."""
    for reason in (b'["stop"]', b'{"a":1}', b"1", b"true"):
        assert not grammar.finished_body("chat", b'{"choices":[{"index":0,"finish_reason":%s}]}' % reason)
        assert not grammar.finished_body("anthropic", b'{"stop_reason":%s}' % reason)
        stream = sse_events(b'data: {"choices":[{"index":0,"finish_reason":%s}]}\n\ndata: [DONE]\n\n' % reason)
        assert stream is not None and not grammar.finished_stream("chat", stream)
        delta = b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":%s}}\n\n' % reason
        anthropic = sse_events(delta + b'event: message_stop\ndata: {"type":"message_stop"}\n\n')
        assert anthropic is not None and not grammar.finished_stream("anthropic", anthropic)


async def test_a_malformed_reason_from_the_engine_is_answered_not_stored() -> None:
    app, cache, store = make()
    ex = await route(app, req(temperature=0))
    assert isinstance(ex, Exchange)
    respond(ex, [b'{"choices":[{"index":0,"text":"ok","finish_reason":["stop"]}]}'])  # no exception
    await cache.flush()
    assert store.data == {} and cache.not_stored.get("unfinished") == 1


UPSTREAM_HEADERS = (
    ("content-type", "application/json"), ("content-language", "en"), ("request-id", "req_1"),
    ("anthropic-organization-id", "org"), ("x-ratelimit-remaining-requests", "9"),
    ("x-envoy-upstream-service-time", "3"), ("x-engine", "e1"), ("x-user-session", "alice-token"),
    ("set-cookie", "sid=alice"), ("X-Caller-Id", "alice"), ("date", "now"),
)  # fmt: skip


async def store_with(app: PickerApp, cache: ResponseCache, **fields: Any) -> Exchange:
    ex = await route(app, req(temperature=0, **fields))
    assert isinstance(ex, Exchange)
    ex.cache.headers = UPSTREAM_HEADERS
    ex.response_headers(200)
    ex.response_body(b'{"choices":[{"finish_reason":"stop"}]}', True)
    await cache.flush()
    return ex


async def test_only_the_allow_listed_headers_are_stored_and_replayed() -> None:
    """The old deny-list stored (and replayed to other callers) any header it did not name: a per-caller id, a
    session token, an ``x-user-...``. Only ``response_cache.stored_headers`` reach the store now."""
    app, cache, store = make()
    ex = await store_with(app, cache)
    stored = CacheEntry.decode(store.data[str(ex.cache.key)]).headers  # filtered before the store: not at replay
    assert stored == (("content-type", "application/json"), ("content-language", "en"))
    hit = await route(app, req(temperature=0), {"authorization": "Bearer bob"})  # another caller
    assert isinstance(hit, Answer)
    assert dict(hit.headers) == {"content-type": "application/json", "content-language": "en", "x-cache": "HIT"}
    assert "x-engine" not in dict(hit.headers) and "x-user-session" not in dict(hit.headers)


async def test_configured_stored_headers_are_replayed_and_the_list_is_hot_reloadable() -> None:
    app, cache, store = make(stored_headers=["content-type", "x-engine", "X-Caller-Id"])
    assert cache.stored_headers == {"content-type", "x-engine", "x-caller-id"}  # lower-cased by the config
    ex = await store_with(app, cache)
    hit = await route(app, req(temperature=0))
    assert isinstance(hit, Answer)
    assert dict(hit.headers) == {"content-type": "application/json", "x-engine": "e1", "X-Caller-Id": "alice",
                                 "x-cache": "HIT"}  # fmt: skip
    narrower = parse_settings(
        {"pool": {"backends": BACKENDS}, "response_cache": {"enabled": True, "stored_headers": ["content-type"]}}
    )
    app.apply(narrower)
    assert CacheEntry.decode(store.data[str(ex.cache.key)]).headers[1] == ("x-engine", "e1")  # stored earlier
    hit = await route(app, req(temperature=0))  # an older entry replays no more than the list says now
    assert isinstance(hit, Answer) and dict(hit.headers) == {"content-type": "application/json", "x-cache": "HIT"}
    other = await store_with(app, cache, seed=1)
    assert CacheEntry.decode(store.data[str(other.cache.key)]).headers == (("content-type", "application/json"),)


@pytest.mark.parametrize(
    ("names", "path"),
    [
        pytest.param(["content-type", "x-engine", "set-cookie"], "response_cache.stored_headers[2]", id="set-cookie"),
        pytest.param(["Transfer-Encoding"], "response_cache.stored_headers[0]", id="hop-by-hop"),
        pytest.param(["x-a", "content-length"], "response_cache.stored_headers[1]", id="framing"),
        pytest.param(["date"], "response_cache.stored_headers[0]", id="date"),
        pytest.param(["x-cache"], "response_cache.stored_headers[0]", id="x-cache"),
        pytest.param(["x-cache-mode"], "response_cache.stored_headers[0]", id="x-cache-mode"),
        pytest.param(["content-encoding"], "response_cache.stored_headers[0]", id="content-encoding"),
        pytest.param([":status"], "response_cache.stored_headers[0]", id="pseudo"),
        pytest.param(["x-envoy-upstream-service-time"], "response_cache.stored_headers[0]", id="envoy"),
        pytest.param(["x-kv-epp-endpoint"], "response_cache.stored_headers[0]", id="picker"),
        pytest.param(["x engine"], "response_cache.stored_headers[0]", id="not-a-token"),
        pytest.param(["x-a", ""], "response_cache.stored_headers[1]", id="empty"),
        pytest.param([f"x-h{i}" for i in range(65)], "response_cache.stored_headers", id="too-many"),
        pytest.param("content-type", "response_cache.stored_headers", id="not-a-list"),
    ],
)
def test_stored_headers_are_validated_with_the_path_of_the_bad_key(names: Any, path: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_settings({"response_cache": {"stored_headers": names}})
    assert [p for p, _ in err.value.problems] == [path], err.value.problems


def test_stored_headers_default_and_bound() -> None:
    assert parse_settings({}).response_cache.stored_headers == ("content-type", "content-language")
    names = [f"x-h{i}" for i in range(64)]
    assert parse_settings({"response_cache": {"stored_headers": names}}).response_cache.stored_headers == tuple(names)


async def test_encoded_or_private_responses_are_not_stored() -> None:
    app, cache, store = make()
    await store_with(app, cache, seed=99)
    for i, header in enumerate(
        [("content-encoding", "gzip"), ("cache-control", "no-store"), ("cache-control", "max-age=0, Private")]
    ):
        ex = await route(app, req(temperature=0, seed=i))
        assert isinstance(ex, Exchange)
        ex.cache.headers = (("content-type", "application/json"), header)
        ex.response_headers(200)
        assert ex.cache.buf is None  # never buffered
        ex.response_body(b'{"choices":[{"finish_reason":"stop"}]}', True)
    await cache.flush()
    assert len(store.data) == 1 and cache.not_stored == {"encoded": 1, "no_store": 2}


async def test_write_values_count_in_the_buffer_bound_until_written(monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    class SlowStore(DictStore):
        def __init__(self) -> None:
            super().__init__()
            self.release = asyncio.Event()

        async def set(self, key: str, value: bytes, ttl_seconds: float) -> None:
            await self.release.wait()
            await super().set(key, value, ttl_seconds)

    store = SlowStore()
    app, cache, _ = make(store)
    body = b'{"choices":[{"finish_reason":"stop","text":"' + b"x" * 100 + b'"}]}'
    monkeypatch.setattr(storing, "MAX_BUFFERED_TOTAL", 300)
    one = await route(app, req(temperature=0))
    assert isinstance(one, Exchange)
    respond(one, [body])
    held = cache.buffered
    assert held > len(body)  # the encoded value is held while its write is in flight
    two = await route(app, req(temperature=0, seed=1))
    assert isinstance(two, Exchange)
    respond(two, [body])  # buffered (fits beside the first value) but its value would pass the bound
    assert cache.not_stored == {"buffer_full": 1} and cache.buffered == held
    store.release.set()
    await cache.flush()
    assert cache.buffered == 0 and cache.stored == 1


async def test_a_stream_is_bounded_by_the_smaller_of_the_two_sizes() -> None:
    app, cache, store = make(max_response_size=50, max_stream_buffer_size=10 << 20)
    ex = await route(app, req(temperature=0, stream=True))
    assert isinstance(ex, Exchange)
    respond(ex, STREAM_OK, ctype="text/event-stream")  # > 50 bytes
    await cache.flush()
    assert store.data == {} and cache.not_stored == {"too_large": 1}


def test_tenants_a_lossy_decode_would_merge_are_not_keyed() -> None:
    from envoy.config.core.v3 import base_pb2

    from picker.extproc.messages import header_value

    one = header_value(base_pb2.HeaderValue(key="x-tenant-id", raw_value=b"acme\xff"))
    two = header_value(base_pb2.HeaderValue(key="x-tenant-id", raw_value=b"acme\xfe"))
    k1, k2 = key_of(req(), tenant=one), key_of(req(), tenant=two)
    assert k1 is None or k1 != k2  # never one entry for two tenants (today's lossy decode: both not keyed)
    assert key_of(req(), tenant="acm\u00e9") is not None  # UTF-8 is keyed
    # a lossless decode (surrogateescape) is keyed on the raw bytes: different bytes, different keys
    raw = [t.decode("utf-8", "surrogateescape") for t in (b"acme\xff", b"acme\xfe")]
    assert None not in (key_of(req(), tenant=raw[0]), key_of(req(), tenant=raw[1]))
    assert key_of(req(), tenant=raw[0]) != key_of(req(), tenant=raw[1])


async def test_output_shaping_request_headers_are_keyed() -> None:
    data = req(temperature=0, max_tokens=8)
    f = facts_of(data, "/v1/messages")
    plain = cache_key(f, data)
    assert cache_key(f, data, {}) == cache_key(f, data, {"x-other": "1"}) == plain  # no shaping header: unchanged
    beta = cache_key(f, data, {"anthropic-beta": "output-128k-2025-02-19"})
    assert beta != plain and beta != cache_key(f, data, {"anthropic-beta": "other"})
    v1 = cache_key(f, data, {"anthropic-version": "2023-06-01"})
    assert v1 not in (plain, beta) and v1 == cache_key(f, data, {"anthropic-version": "2023-06-01", "x-other": "2"})
    _, cache, _ = make()
    body = json.dumps(data).encode()
    one = await cache.lookup(f, body, {"anthropic-beta": "a"})
    two = await cache.lookup(f, body, {"anthropic-beta": "b"})
    assert isinstance(one, rc.CacheState) and isinstance(two, rc.CacheState) and one.key != two.key
