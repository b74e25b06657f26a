"""The semantic cache parts: the partition digest (isolation), the bounded vector index, the embeddings
client against the real simulator and against servers that fail in each way.

Here the tests that start a server or bind a socket; the rest, in process:
tests/unit/picker/cache/test_semantic.py."""

from __future__ import annotations

import asyncio

import orjson
import pytest
from aiohttp import web

from benchmarks.engine_sim import EngineSimulator
from benchmarks.engine_sim.embeddings import embed_text
from picker.cache.embeddings import EmbeddingsClient
from tests.support.embeddings_sim import EMB
from tests.support.http_server import serve
from tests.support.poll import async_wait_until
from tests.support.semantic_index import (
    NEAR,
    OTHER,
    QUESTION,
    Clock,
    chat,
    embed,
    index,
    query,
    refused_url,
)

# -- the embeddings client ------------------------------------------------------------------------------


async def test_client_against_the_simulator_near_duplicate_hits(sim: EngineSimulator) -> None:
    client = EmbeddingsClient()
    try:
        v1 = await embed(client, sim.base_url + "/", QUESTION)
        v2 = await embed(client, sim.base_url, NEAR)
        v3 = await embed(client, sim.base_url, OTHER)
    finally:
        await client.close()
    assert v1 is not None and v2 is not None and v3 is not None
    assert all(abs(a - b) < 1e-12 for a, b in zip(v1, embed_text(QUESTION), strict=True))
    idx = index()
    q1, q2 = query(chat(QUESTION)), query(chat(NEAR))
    assert q1 is not None and q2 is not None
    idx.add(q1.partition, v1, "k1")
    hit = idx.lookup(q2.partition, v2)
    assert hit is not None and hit.key == "k1"
    assert idx.lookup(q2.partition, v3) is None
    assert client.stats.ok == 3 and client.stats.requests == 3 and not client.stats.errors


async def test_long_or_empty_input_is_skipped_without_a_request() -> None:
    seen: list[bytes] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(await request.read())
        return web.json_response({"data": [{"embedding": [1.0, 0.0]}]})

    async with serve([web.post("/v1/embeddings", handler)]) as url:
        client = EmbeddingsClient()
        try:
            assert await embed(client, url, "x" * 101, max_input_bytes=100) is None
            assert await embed(client, url, "캐시" * 17, max_input_bytes=100) is None  # 34 chars, 102 bytes
            assert await embed(client, url, "") is None
            assert await embed(client, url, "x" * 100, max_input_bytes=100) == (1.0, 0.0)
        finally:
            await client.close()
    assert client.stats.skipped == 3 and len(seen) == 1
    assert orjson.loads(seen[0]) == {"model": EMB, "input": "x" * 100}


async def test_a_backend_that_never_answers_is_a_miss_within_the_timeout() -> None:
    release = asyncio.Event()

    async def stall(request: web.Request) -> web.Response:
        await release.wait()
        return web.json_response({})

    async with serve([web.post("/v1/embeddings", stall)]) as url:
        client = EmbeddingsClient()
        try:
            assert await embed(client, url, timeout_ms=100) is None
        finally:
            release.set()
            await client.close()
    assert client.stats.timeouts == 1 and client.stats.ok == 0


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        (web.json_response({"error": "boom"}, status=500), "status"),
        (web.Response(body=b"x" * 5000, content_type="application/json"), "too_large"),
        (web.Response(body=b"not json", content_type="application/json"), "malformed"),
        (web.json_response({"data": []}), "malformed"),
        (web.json_response({"data": [{"embedding": [0.0, 0.0]}]}), "malformed"),
        (web.json_response({"data": [{"embedding": "AAAA"}]}), "malformed"),
        (web.json_response([1, 2]), "malformed"),
    ],
    ids=["500", "too-large", "not-json", "no-data", "zero-vector", "base64", "not-object"],
)
async def test_bad_answers_are_misses(answer: web.Response, reason: str) -> None:
    async def handler(request: web.Request) -> web.Response:
        return answer

    async with serve([web.post("/v1/embeddings", handler)]) as url:
        client = EmbeddingsClient(max_response_bytes=4096)
        try:
            assert await embed(client, url) is None
        finally:
            await client.close()
    assert client.stats.errors == {reason: 1}


async def test_a_streamed_answer_over_the_bound_is_cut_off() -> None:
    async def chunked(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()  # no Content-Length: the bound is applied while reading
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        for _ in range(64):
            await resp.write(b" " * 1024)
        await resp.write_eof()
        return resp

    async with serve([web.post("/v1/embeddings", chunked)]) as url:
        client = EmbeddingsClient(max_response_bytes=4096)
        try:
            assert await embed(client, url) is None
        finally:
            await client.close()
    assert client.stats.errors == {"too_large": 1}


# -- the embeddings breaker -----------------------------------------------------------------------------
async def test_the_breaker_opens_after_consecutive_failures_and_probes_after_the_cooldown() -> None:
    seen: list[int] = []
    healthy = False

    async def handler(request: web.Request) -> web.Response:
        seen.append(1)
        if healthy:
            return web.json_response({"data": [{"embedding": [1.0, 0.0]}]})
        return web.json_response({"error": "down"}, status=503)

    clock = Clock()
    async with serve([web.post("/v1/embeddings", handler)]) as url:
        client = EmbeddingsClient(clock=clock)
        client.configure_breaker(3, 10.0)
        try:
            for _ in range(3):
                assert not client.open
                assert await embed(client, url) is None
            assert client.open and len(seen) == 3 and client.stats.breaker_opened == 1
            assert await embed(client, url) is None  # open: no request
            assert len(seen) == 3
            clock.now += 10.0  # the cool-down is over: one probe, which fails: open again
            assert not client.open
            assert await embed(client, url) is None
            assert len(seen) == 4 and client.open and client.stats.breaker_opened == 2
            healthy = True
            clock.now += 10.0
            assert await embed(client, url) == (1.0, 0.0)  # the probe succeeds: closed
            assert not client.open and len(seen) == 5
            healthy = False
            assert await embed(client, url) is None  # one failure after a success: still closed
            assert not client.open
        finally:
            await client.close()


async def test_only_one_probe_goes_out_while_half_open() -> None:
    release = asyncio.Event()
    seen: list[int] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(1)
        await release.wait()
        return web.json_response({"data": [{"embedding": [0.0, 1.0]}]})

    clock = Clock()
    async with serve([web.post("/v1/embeddings", handler)]) as url:
        client = EmbeddingsClient(clock=clock)
        client.configure_breaker(1, 5.0)
        try:
            assert await embed(client, refused_url()) is None
            assert client.open
            clock.now += 5.0
            probe = asyncio.create_task(embed(client, url))
            await async_wait_until(lambda: len(seen) == 1, timeout=30.0)
            assert client.open  # the probe is out: the others still skip
            assert await embed(client, url) is None and len(seen) == 1
            release.set()
            assert await probe == (0.0, 1.0)
            assert not client.open
        finally:
            release.set()
            await client.close()
