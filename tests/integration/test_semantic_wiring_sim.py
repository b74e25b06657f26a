"""The semantic cache and the Anthropic injection wired into the request path and the ext_proc stream.

Semantic: the app's response cache against the simulator's real ``/v1/embeddings`` (an in-process server on a
free port): a near-duplicate question after a stored answer is a semantic HIT; another system prompt, tool list or
tenant is a MISS; an embedding failure (refused, timed out) is a plain miss that indexes nothing; the path is
hot-reloadable. Anthropic: the request path sets the rewritten body, and the stream sends it upstream in place of
the client's (full duplex and BUFFERED), with a matching ``content-length``.

Here the tests that start a server or bind a socket; the rest, in process:
tests/unit/picker/cache/test_semantic_wiring.py."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp import web

from benchmarks.engine_sim import EngineSimulator
from picker.cache.semantic import ENTRY_PREFIX
from picker.cache.state import SemanticPending
from picker.config import parse_settings
from picker.facts import Answer
from picker.request.exchange import Exchange
from tests.support.http_server import serve
from tests.support.semantic_chat import (
    ALICE,
    ANSWER,
    BOB,
    NEAR,
    QUESTION,
    SYSTEM,
    answer,
    chat,
    make,
    route,
    sample,
    semantic_count,
    settings,
    sim_url,
)

TOOLS = [{"type": "function", "function": {"name": "search_docs", "parameters": {"type": "object"}}}]


async def test_near_duplicate_is_a_semantic_hit(sim: EngineSimulator) -> None:
    app = make(sim_url(sim))
    try:
        first = await route(app, chat(QUESTION))
        assert isinstance(first, Exchange) and first.x_cache == "MISS"
        assert isinstance(first.cache.semantic, SemanticPending)
        await answer(app, first)
        assert len(app.semantic_index) == 1
        assert first.cache.semantic.key.startswith(ENTRY_PREFIX)
        assert await app.cache_store.get(first.cache.semantic.key) is not None  # the body under its sem: key
        hit = await route(app, chat(NEAR))
        assert isinstance(hit, Answer), hit
        headers = dict(hit.headers)
        assert headers["x-cache"] == "HIT" and headers["x-cache-mode"] == "semantic"
        assert hit.body == ANSWER and headers["content-type"] == "application/json"
        assert "x-engine" not in headers  # not in response_cache.stored_headers (the default): never replayed
        assert app.pool.in_flight() == {"a": 0, "b": 0}  # no engine slot taken
        exact = await route(app, chat(QUESTION))  # the same question: the exact entry, no mode header
        assert isinstance(exact, Answer) and "x-cache-mode" not in dict(exact.headers)
        rc = "continuum_response_cache_requests_total"
        assert (sample(app, rc, "hit"), sample(app, rc, "miss")) == (2, 1)
        assert (semantic_count(app, "hit"), semantic_count(app, "miss"), semantic_count(app, "error")) == (1, 1, 0)
    finally:
        await app.embeddings.close()


async def test_a_configured_stored_header_is_replayed_on_a_semantic_hit(sim: EngineSimulator) -> None:
    app = make(sim_url(sim), cache_extra={"stored_headers": ["content-type", "x-engine"]})
    try:
        first = await route(app, chat(QUESTION))
        assert isinstance(first, Exchange) and isinstance(first.cache.semantic, SemanticPending)
        await answer(app, first)
        hit = await route(app, chat(NEAR))
        assert isinstance(hit, Answer) and dict(hit.headers).get("x-cache-mode") == "semantic", hit
        assert dict(hit.headers)["x-engine"] == "e1"
    finally:
        await app.embeddings.close()


@pytest.mark.parametrize(
    "other",
    [
        pytest.param({"system": "You are a pirate."}, id="system-prompt"),
        pytest.param({"tools": TOOLS}, id="tool-list"),
        pytest.param({"max_tokens": 7}, id="sampling-field"),
    ],
)
async def test_other_partition_is_a_miss(sim: EngineSimulator, other: dict[str, Any]) -> None:
    app = make(sim_url(sim))
    try:
        first = await route(app, chat(QUESTION))
        assert isinstance(first, Exchange)
        await answer(app, first)
        system = other.pop("system", SYSTEM)
        miss = await route(app, chat(NEAR, system, **other))
        assert isinstance(miss, Exchange) and miss.x_cache == "MISS"
        assert isinstance(miss.cache.semantic, SemanticPending)
        assert miss.cache.semantic.partition != first.cache.semantic.partition  # type: ignore[union-attr]
        assert semantic_count(app, "miss") == 2 and semantic_count(app, "hit") == 0
    finally:
        await app.embeddings.close()


async def test_tenants_never_share(sim: EngineSimulator) -> None:
    app = make(sim_url(sim))
    tenant = app.settings.extproc.tenant_header
    try:
        first = await route(app, chat(QUESTION), {tenant: "t1", **ALICE})
        assert isinstance(first, Exchange)
        await answer(app, first)
        assert isinstance(await route(app, chat(NEAR), {tenant: "t2", **ALICE}), Exchange)
        assert isinstance(await route(app, chat(NEAR), {tenant: "t1", **ALICE}), Answer)
    finally:
        await app.embeddings.close()


async def test_callers_never_share(sim: EngineSimulator) -> None:
    """Alice's stored answer is never served to Bob's near-duplicate (same tenant header, or none); Alice's own
    near-duplicate still hits. The caller identity is read from the credential header, hashed, never kept raw."""
    app = make(sim_url(sim))
    tenant = app.settings.extproc.tenant_header
    try:
        first = await route(app, chat(QUESTION), {tenant: "t1", **ALICE})
        assert isinstance(first, Exchange) and isinstance(first.cache.semantic, SemanticPending)
        assert first.facts.identity is not None and "sk-alice" not in repr(first.facts)
        await answer(app, first)
        for bob in ({tenant: "t1", **BOB}, BOB, {"x-api-key": "sk-alice"}):
            miss = await route(app, chat(NEAR), bob)
            assert isinstance(miss, Exchange) and miss.x_cache == "MISS", bob
        hit = await route(app, chat(NEAR), {tenant: "t1", **ALICE})
        assert isinstance(hit, Answer) and hit.body == ANSWER
        assert semantic_count(app, "hit") == 1 and semantic_count(app, "miss") == 4
    finally:
        await app.embeddings.close()


async def test_no_caller_identity_skips_the_semantic_path(sim: EngineSimulator) -> None:
    app = make(sim_url(sim))
    try:
        ex = await route(app, chat(QUESTION), {})
        assert isinstance(ex, Exchange) and ex.x_cache == "MISS" and ex.cache.semantic is None
        assert semantic_count(app, "skip") == 1 and app.embeddings.stats.requests == 0
    finally:
        await app.embeddings.close()


async def test_a_gateway_identity_header_replaces_authorization(sim: EngineSimulator) -> None:
    app = make(sim_url(sim), semantic_extra={"identity_header": "X-Caller"})
    try:
        assert "x-caller" in app.path.wanted_headers
        first = await route(app, chat(QUESTION), {"x-caller": "alice", **BOB})
        assert isinstance(first, Exchange) and isinstance(first.cache.semantic, SemanticPending)
        await answer(app, first)
        assert isinstance(await route(app, chat(NEAR), {"x-caller": "bob", **BOB}), Exchange)
        assert isinstance(await route(app, chat(NEAR), ALICE), Exchange)  # no gateway header: skipped
        assert isinstance(await route(app, chat(NEAR), {"x-caller": "alice"}), Answer)
    finally:
        await app.embeddings.close()


async def test_not_eligible_for_the_semantic_path_is_skipped(sim: EngineSimulator) -> None:
    app = make(sim_url(sim))
    try:
        data = chat(QUESTION)
        del data["temperature"]  # absent: the exact cache's, not the semantic path's (an explicit 0 only)
        ex = await route(app, data)
        assert isinstance(ex, Exchange) and ex.x_cache == "MISS" and ex.cache.semantic is None
        assert semantic_count(app, "skip") == 1 and app.embeddings.stats.requests == 0
    finally:
        await app.embeddings.close()


async def test_embedding_timeout_is_a_plain_miss() -> None:
    release = asyncio.Event()

    async def stall(_: web.Request) -> web.Response:
        await release.wait()
        return web.json_response({"data": [{"embedding": [1.0, 0.0]}]})

    async with serve([web.post("/v1/embeddings", stall)]) as url:
        app = make(url, timeout_ms=100)
        try:
            ex = await route(app, chat(QUESTION))  # returns although the embedder never answers
            assert isinstance(ex, Exchange) and ex.x_cache == "MISS" and ex.cache.semantic is None
            assert app.embeddings.stats.timeouts == 1 and semantic_count(app, "error") == 1
        finally:
            release.set()
            await app.embeddings.close()


async def test_semantic_path_is_hot_reloadable(sim: EngineSimulator) -> None:
    app = make(sim_url(sim), enabled=False)
    try:
        ex = await route(app, chat(QUESTION))
        assert isinstance(ex, Exchange) and ex.cache.semantic is None and app.embeddings.stats.requests == 0
        app.apply(settings(sim_url(sim)))
        ex = await route(app, chat(QUESTION))
        assert isinstance(ex, Exchange) and isinstance(ex.cache.semantic, SemanticPending)
        await answer(app, ex)
        app.apply(settings(sim_url(sim)))  # reloaded unchanged: the index stays
        assert len(app.semantic_index) == 1
        stricter = settings(sim_url(sim)).model_dump()
        stricter["response_cache"]["semantic"]["threshold"] = 1.0
        app.apply(parse_settings(stricter))
        assert app.semantic_index.threshold == 1.0
        assert isinstance(await route(app, chat(NEAR)), Exchange)  # below an exact-match threshold
    finally:
        await app.embeddings.close()


async def test_a_saturated_pool_gets_exact_hits_but_no_embedding_request(sim: EngineSimulator) -> None:
    app = make(sim_url(sim), admission={"max_in_flight_total": 1})
    try:
        first = await route(app, chat(QUESTION))
        assert isinstance(first, Exchange)
        await answer(app, first)  # stored; its slot released
        requests = app.embeddings.stats.requests
        held = await route(app, chat("Which planets have rings?"))  # a miss that keeps its slot: saturated
        assert isinstance(held, Exchange)
        try:
            exact = await route(app, chat(QUESTION))  # the exact lookup comes before the admission check
            assert isinstance(exact, Answer) and dict(exact.headers)["x-cache"] == "HIT"
            shed = await route(app, chat(NEAR))  # would be a semantic hit, but saturated: no embedding, a 429
            assert isinstance(shed, Answer) and shed.status == 429
            assert app.embeddings.stats.requests == requests + 1  # only the held miss's embedding
        finally:
            held.end(completed=False)
        hit = await route(app, chat(NEAR))  # not saturated any more: the semantic path runs again
        assert isinstance(hit, Answer) and dict(hit.headers).get("x-cache-mode") == "semantic"
    finally:
        await app.embeddings.close()
