"""GeminiApi over real HTTP: against tiny aiohttp servers started here (the key header, the request bodies, a 400
refusal, a timeout, oversized answers, a redirect) and against the fake Generative Language API
(tests/support/fake_gemini.py), with GeminiContextCache on top (single-flight create, hit, negative cache, clear)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web

from picker.config import GeminiBackendConfig, GeminiContextCacheConfig
from picker.gemini.context_cache import (
    MAX_RESPONSE_BYTES,
    ApiError,
    ApiTimeout,
    CreateRefused,
    GeminiApi,
    GeminiContextCache,
    build_context_cache,
)
from tests.support.fake_gemini import FakeGemini, start_fake_gemini
from tests.support.http_server import serve

KEY = "AIzaSy-integration-key-0123456789abcdef"
MODEL = "gemini-2.5-flash"


def backend(base_url: str, key_file: Path, name: str = "gem") -> GeminiBackendConfig:
    return GeminiBackendConfig(
        name=name, type="gemini", base_url=base_url, api_key_file=str(key_file), models=(MODEL,), allow_insecure=True
    )


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    p = tmp_path / "api-key"
    p.write_text(KEY + "\n")
    return p


@pytest.fixture
async def api() -> AsyncIterator[GeminiApi]:
    a = GeminiApi(op_timeout_s=5.0)
    yield a
    await a.close()


class Recorder:
    def __init__(self) -> None:
        self.requests: list[tuple[str, str, dict[str, str], Any]] = []

    async def record(self, request: web.Request) -> None:
        raw = await request.read()
        body = orjson.loads(raw) if raw else None
        self.requests.append((request.method, str(request.rel_url), dict(request.headers), body))


# -- against servers of our own -------------------------------------------------------------------------------------
async def test_create_extend_delete_send_the_key_and_the_bodies(api: GeminiApi, key_file: Path) -> None:
    rec = Recorder()

    async def created(request: web.Request) -> web.Response:
        await rec.record(request)
        return web.json_response({"name": "cachedContents/abc123", "model": f"models/{MODEL}"})

    async def patched(request: web.Request) -> web.Response:
        await rec.record(request)
        return web.json_response({"name": "cachedContents/abc123"})

    async def deleted(request: web.Request) -> web.Response:
        await rec.record(request)
        return web.json_response({})

    routes = [
        web.post("/v1beta/cachedContents", created),
        web.patch("/v1beta/cachedContents/{id}", patched),
        web.delete("/v1beta/cachedContents/{id}", deleted),
    ]
    async with serve(routes) as url:
        b = backend(url, key_file)
        before = asyncio.get_running_loop().time()
        c = await api.create(b, MODEL, "S" * 5000, 600.0, 5.0)
        assert c.name == "cachedContents/abc123"
        assert before + 600 <= c.expire_at_monotonic <= asyncio.get_running_loop().time() + 600
        expires = await api.extend(b, c.name, 600.0)
        assert expires >= c.expire_at_monotonic
        await api.delete(b, c.name)
    (m1, u1, h1, b1), (m2, u2, h2, b2), (m3, u3, h3, b3) = rec.requests
    assert (m1, u1) == ("POST", "/v1beta/cachedContents")
    assert b1 == {"model": f"models/{MODEL}", "systemInstruction": {"parts": [{"text": "S" * 5000}]}, "ttl": "600s"}
    assert (m2, u2, b2) == ("PATCH", "/v1beta/cachedContents/abc123?updateMask=ttl", {"ttl": "600s"})
    assert (m3, u3, b3) == ("DELETE", "/v1beta/cachedContents/abc123", None)
    for h in (h1, h2, h3):
        assert h["x-goog-api-key"] == KEY  # the file's content, whitespace stripped
        assert "Authorization" not in h and KEY not in str({k: v for k, v in h.items() if k != "x-goog-api-key"})


async def test_a_400_is_a_refusal_without_the_key_in_its_message(api: GeminiApi, key_file: Path) -> None:
    async def refuse(request: web.Request) -> web.Response:
        echoed = request.headers["x-goog-api-key"]  # a careless server quoting the key back
        msg = f"Cached content is too small. total_token_count=10, min_total_token_count=4096 (key {echoed})"
        return web.json_response({"error": {"code": 400, "message": msg, "status": "INVALID_ARGUMENT"}}, status=400)

    async with serve([web.post("/v1beta/cachedContents", refuse)]) as url:
        with pytest.raises(CreateRefused) as info:
            await api.create(backend(url, key_file), MODEL, "short", 600.0, 5.0)
    assert info.value.status == 400
    assert "Cached content is too small" in str(info.value)
    assert KEY not in str(info.value) and KEY not in repr(info.value.args)


@pytest.mark.parametrize("status", [401, 403, 429, 500, 503])
async def test_other_statuses_are_api_errors_not_refusals(api: GeminiApi, key_file: Path, status: int) -> None:
    async def fail(request: web.Request) -> web.Response:
        return web.json_response({"error": {"code": status, "message": "nope"}}, status=status)

    async with serve([web.post("/v1beta/cachedContents", fail)]) as url:
        with pytest.raises(ApiError) as info:
            await api.create(backend(url, key_file), MODEL, "S" * 100, 600.0, 5.0)
    assert not isinstance(info.value, CreateRefused)
    assert info.value.status == status and f"HTTP {status}: nope" in str(info.value)


async def test_no_answer_in_time_is_a_timeout(api: GeminiApi, key_file: Path) -> None:
    never = asyncio.Event()

    async def hang(request: web.Request) -> web.Response:
        await never.wait()
        return web.json_response({})

    async with serve([web.post("/v1beta/cachedContents", hang)]) as url:
        with pytest.raises(ApiTimeout, match=r"no answer within 0\.2s"):
            await api.create(backend(url, key_file), MODEL, "S" * 100, 600.0, 0.2)
        never.set()


@pytest.mark.parametrize("chunked", [False, True])
async def test_an_answer_over_1_mib_is_refused(api: GeminiApi, key_file: Path, chunked: bool) -> None:
    big = b'{"name": "cachedContents/abc", "pad": "' + b"x" * MAX_RESPONSE_BYTES + b'"}'

    async def huge(request: web.Request) -> web.StreamResponse:
        if not chunked:
            return web.Response(body=big, content_type="application/json")
        resp = web.StreamResponse()  # no content-length: the client must stop reading by itself
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        for i in range(0, len(big), 1 << 16):
            await resp.write(big[i : i + (1 << 16)])
        await resp.write_eof()
        return resp

    async with serve([web.post("/v1beta/cachedContents", huge)]) as url:
        with pytest.raises(ApiError, match="larger than 1048576 bytes"):
            await api.create(backend(url, key_file), MODEL, "S" * 100, 600.0, 5.0)


async def test_a_redirect_is_not_followed(api: GeminiApi, key_file: Path) -> None:
    followed: list[str] = []

    async def redirect(request: web.Request) -> web.Response:
        raise web.HTTPFound("/elsewhere")

    async def elsewhere(request: web.Request) -> web.Response:
        followed.append(request.headers.get("x-goog-api-key", ""))
        return web.json_response({"name": "cachedContents/abc"})

    async with serve([web.post("/v1beta/cachedContents", redirect), web.post("/elsewhere", elsewhere)]) as url:
        with pytest.raises(ApiError) as info:
            await api.create(backend(url, key_file), MODEL, "S" * 100, 600.0, 5.0)
    assert info.value.status == 302 and followed == []


async def test_a_connection_failure_is_an_api_error(api: GeminiApi, key_file: Path) -> None:
    async with serve([]) as url:
        pass  # the port is free again: nothing listens
    with pytest.raises(ApiError, match="create on backend gem failed"):
        await api.create(backend(url, key_file), MODEL, "S" * 100, 600.0, 5.0)


# -- against the fake Generative Language API -----------------------------------------------------------------------
@pytest.fixture
async def fake() -> AsyncIterator[FakeGemini]:
    f = await start_fake_gemini(api_key=KEY, min_cache_tokens=4096)
    yield f
    await f.stop()


async def test_api_against_the_fake(api: GeminiApi, key_file: Path, fake: FakeGemini) -> None:
    b = backend(fake.base_url, key_file)
    c = await api.create(b, MODEL, "word " * 4000, 600.0, 5.0)  # 20000 bytes: 5000 tokens
    assert c.name in fake.cached
    fake.advance(500)
    await api.extend(b, c.name, 600.0)
    assert fake.patches == 1
    fake.advance(500)  # past the original TTL, within the extended one
    assert c.name in fake.cached
    await api.delete(b, c.name)
    assert c.name not in fake.cached
    await api.delete(b, c.name)  # already gone (404): no error
    with pytest.raises(CreateRefused, match="too small"):
        await api.create(b, MODEL, "short prompt", 600.0, 5.0)
    wrong = key_file.parent / "wrong-key"
    wrong.write_text("not-the-key")
    with pytest.raises(ApiError) as info:
        await api.create(backend(fake.base_url, wrong, "other"), MODEL, "word " * 4000, 600.0, 5.0)
    assert info.value.status == 403 and not isinstance(info.value, CreateRefused)


async def test_the_cache_over_the_fake(key_file: Path, fake: FakeGemini, caplog: pytest.LogCaptureFixture) -> None:
    cfg = GeminiContextCacheConfig(enabled=True, min_prefix_bytes=16384, negative_ttl_seconds=600)
    cache = build_context_cache(cfg)
    assert isinstance(cache, GeminiContextCache)
    b = backend(fake.base_url, key_file)
    system = "You are a careful assistant. " * 700  # ~20 KB
    with caplog.at_level(logging.DEBUG):
        fake.hold_creates()
        assert {cache.lookup(b, MODEL, system).result for _ in range(10)} == {"miss"}
        fake.release_creates()
        await cache.wait_idle()
        assert fake.creates == 1 and len(fake.cached) == 1
        hit = cache.lookup(b, MODEL, system)
        assert hit.result == "hit" and hit.cached_content in fake.cached
        # under the threshold: no create
        assert cache.lookup(b, MODEL, "short").result == "ineligible"
        # over the byte threshold, under the fake's token minimum (16384 bytes are 4096 of its tokens): refused
        # once, then negative-cached
        fake.min_cache_tokens = 5000
        under = "z" * 16384
        assert cache.lookup(b, MODEL, under).result == "miss"
        await cache.wait_idle()
        assert fake.creates == 2
        assert [cache.lookup(b, MODEL, under).result for _ in range(3)] == ["negative"] * 3
        await cache.wait_idle()
        assert fake.creates == 2
        assert cache.clear_response() == {"success": True, "cleared_entries": 1}
        await cache.wait_idle()
        assert fake.cached == {}
    s = cache.stats()
    assert (s["creates"], s["create_failures"], s["create_refused"], s["deletes"], s["negative"]) == (1, 1, 1, 1, 3)
    assert KEY not in caplog.text
    await cache.close()
