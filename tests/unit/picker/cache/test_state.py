"""The response cache's seam on the request path: ``ResponseCache.lookup`` answers a hit, else the exchange's
typed ``CacheState`` (BYPASS, or an eligible MISS with its keys), and the storing observer keeps that exchange's
response in it; the path's ``ResponseCache`` Protocol is the one the cache implements."""

from __future__ import annotations

import json

from picker.cache.entry import BYPASS, MISS
from picker.cache.response_cache import ResponseCache
from picker.cache.state import CacheState
from picker.cache.store import MemoryCacheStore
from picker.config import parse_settings
from picker.facts import Answer, parse_request_body
from picker.request.exchange import Exchange
from picker.request.path import Inbound
from tests.support.builders import CHAT, app_of, static_pool

OK = b'{"choices":[{"index":0,"text":"ok","finish_reason":"stop"}]}'


def body(**fields: object) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}).encode()


def cache() -> ResponseCache:
    cfg = parse_settings({"response_cache": {"enabled": True}}).response_cache
    return ResponseCache(cfg, MemoryCacheStore(100))


async def test_lookup_gives_bypass_miss_or_the_hit() -> None:
    c = cache()
    hot, _ = parse_request_body(body(temperature=0.7), CHAT, max_body_bytes=1 << 20)
    bypass = await c.lookup(hot, body(temperature=0.7))
    assert isinstance(bypass, CacheState) and bypass.x_cache == BYPASS and bypass.key is None
    facts, data = parse_request_body(body(), CHAT, max_body_bytes=1 << 20)
    miss = await c.lookup(facts, body(), data=data)
    assert isinstance(miss, CacheState) and miss.x_cache == MISS and miss.key is not None and miss.semantic is None
    assert (miss.headers, miss.buf, miss.size, miss.complete) == ((), None, 0, False)  # nothing seen yet


async def test_the_exchange_carries_the_cache_state_and_the_observer_fills_it() -> None:
    s = {"response_cache": {"enabled": True}, "pool": static_pool(1)}
    app = app_of(s)
    ex = await app.path.route(Inbound(CHAT, {":method": "POST"}, body()))
    assert isinstance(ex, Exchange) and ex.cache is not None and ex.x_cache == MISS and ex.wants_body
    ex.cache.headers = (("content-type", "application/json"),)  # what the protocol layer keeps for a miss
    ex.response_headers(200)
    assert ex.cache.buf == [] and ex.cache.size == 0
    ex.response_body(OK, True)
    assert ex.cache.complete and ex.cache.buf is None  # handed to the store
    await app.response_cache.flush()
    hit = await app.path.route(Inbound(CHAT, {":method": "POST"}, body()))
    assert isinstance(hit, Answer) and hit.body == OK


async def test_without_a_response_cache_an_exchange_has_no_cache_state() -> None:
    app = app_of({"pool": static_pool(1)})
    ex = await app.path.route(Inbound(CHAT, {":method": "POST"}, body()))
    assert isinstance(ex, Exchange) and ex.cache is None and ex.x_cache is None and ex.kv is None
