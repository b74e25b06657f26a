"""The fake Generative Language API (tests/support/fake_gemini.py; a fake, not Google's service) over real HTTP:
the cachedContents lifecycle with expiry by an injected clock, the too-small refusal, generateContent with and
without a cached content (driven by picker.gemini.convert, so the conversion meets a real HTTP peer), streaming,
the OpenAI-compatible endpoint, auth, the fake as a subprocess and over TLS, and Google's own client library
against it."""

from __future__ import annotations

import asyncio
import datetime
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from picker.gemini.convert import (
    StreamConverter,
    cache_create_body,
    from_native_response,
    native_path,
    openai_compat_with_cache,
    to_native_request,
)
from tests.integration.conftest import http
from tests.support.certs import TestCA
from tests.support.fake_gemini import MAX_REQUESTS_RECORDED, FakeGemini, start_fake_gemini, tokens_of
from tests.support.poll import async_wait_until
from tests.support.ready_process import start_cli

KEY = "fake-gemini-test-key"
MODEL = "gemini-2.5-flash"
MIN_TOKENS = 100
SYSTEM = "You are a terse assistant. " * 40  # 1080 bytes: 270 tokens by the fake's count
T0 = 1_700_000_000.0


class Clock:
    """The fake's clock, moved by the test."""

    def __init__(self) -> None:
        self.t = T0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
async def fake(clock: Clock) -> AsyncIterator[FakeGemini]:
    f = await start_fake_gemini(api_key=KEY, min_cache_tokens=MIN_TOKENS, clock=clock)
    try:
        yield f
    finally:
        await f.stop()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


class Api:
    """Calls to the fake with the key in ``x-goog-api-key``."""

    def __init__(self, fake: FakeGemini, session: aiohttp.ClientSession) -> None:
        self.fake, self.session = fake, session

    async def call(
        self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None, key: str | None = KEY
    ) -> tuple[int, Any]:
        hdrs = {"content-type": "application/json", **({"x-goog-api-key": key} if key else {}), **(headers or {})}
        data = orjson.dumps(body) if body is not None else None
        async with self.session.request(method, self.fake.base_url + path, data=data, headers=hdrs) as r:
            raw = await r.read()
            return r.status, (orjson.loads(raw) if raw else None)

    async def raw(self, path: str, body: Any) -> tuple[int, bytes]:
        headers = {"content-type": "application/json", "x-goog-api-key": KEY}
        async with self.session.post(self.fake.base_url + path, data=orjson.dumps(body), headers=headers) as r:
            return r.status, await r.read()

    async def create(self, system: str = SYSTEM, ttl_s: float = 300, model: str = MODEL) -> dict[str, Any]:
        status, res = await self.call("POST", "/v1beta/cachedContents", cache_create_body(model, system, ttl_s))
        assert status == 200, res
        return dict(res)


@pytest.fixture
def api(fake: FakeGemini, session: aiohttp.ClientSession) -> Api:
    return Api(fake, session)


def chat(system: str | None = SYSTEM, user: str = "what is a cache", **fields: Any) -> dict[str, Any]:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    return {"model": MODEL, "messages": messages, **fields}


def rfc3339_at(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


# ---- cachedContents -------------------------------------------------------------------------------------------


async def test_create_get_patch_delete(api: Api, fake: FakeGemini, clock: Clock) -> None:
    res = await api.create(ttl_s=300)
    name = res["name"]
    assert name.startswith("cachedContents/")
    assert res["model"] == f"models/{MODEL}"
    assert res["usageMetadata"] == {"totalTokenCount": tokens_of(SYSTEM)}
    assert res["createTime"] == res["updateTime"] == rfc3339_at(T0)
    assert res["expireTime"] == rfc3339_at(T0 + 300)
    assert set(fake.cached) == {name} and fake.creates == 1

    assert await api.call("GET", f"/v1beta/{name}") == (200, res)
    status, listing = await api.call("GET", "/v1beta/cachedContents")
    assert status == 200 and [r["name"] for r in listing["cachedContents"]] == [name]

    clock.t += 100
    status, patched = await api.call("PATCH", f"/v1beta/{name}?updateMask=ttl", {"ttl": "600s"})
    assert status == 200
    assert patched["expireTime"] == rfc3339_at(T0 + 700) and patched["updateTime"] == rfc3339_at(T0 + 100)
    assert fake.patches == 1

    assert await api.call("DELETE", f"/v1beta/{name}") == (200, {})
    assert fake.deletes == 1 and not fake.cached
    status, err = await api.call("GET", f"/v1beta/{name}")
    assert status == 404 and err["error"]["status"] == "NOT_FOUND"
    status, err = await api.call("DELETE", f"/v1beta/{name}")
    assert status == 404 and fake.deletes == 2


async def test_a_resource_expires_by_the_fakes_clock(api: Api, fake: FakeGemini, clock: Clock) -> None:
    name = (await api.create(ttl_s=60))["name"]
    clock.t += 59.9
    assert (await api.call("GET", f"/v1beta/{name}"))[0] == 200
    native = to_native_request(chat(), cached_content=name)
    assert (await api.call("POST", native_path(MODEL, False), native))[0] == 200
    clock.t += 0.1
    status, err = await api.call("GET", f"/v1beta/{name}")
    assert (status, err["error"]["code"]) == (404, 404)
    assert not fake.cached
    status, err = await api.call("POST", native_path(MODEL, False), native)
    assert status == 400 and "CachedContent not found" in err["error"]["message"]
    assert (await api.call("PATCH", f"/v1beta/{name}", {"ttl": "60s"}))[0] == 404


async def test_advance_moves_the_clock_too(api: Api, fake: FakeGemini) -> None:
    name = (await api.create(ttl_s=60))["name"]
    fake.advance(61)
    assert (await api.call("GET", f"/v1beta/{name}"))[0] == 404


async def test_patch_by_expire_time_and_its_refusals(api: Api, clock: Clock) -> None:
    name = (await api.create())["name"]
    at = rfc3339_at(T0 + 5000)
    status, res = await api.call("PATCH", f"/v1beta/{name}?updateMask=expireTime", {"expireTime": at})
    assert status == 200 and res["expireTime"] == at
    status, res = await api.call(
        "PATCH", f"/v1beta/{name}?updateMask=expire_time", {"expireTime": "2030-01-01T00:00:00Z"}
    )
    assert status == 200 and res["expireTime"] == "2030-01-01T00:00:00.000000Z"
    for path, body in [
        (f"/v1beta/{name}?updateMask=ttl", {"ttl": "ten minutes"}),
        (f"/v1beta/{name}?updateMask=model", {"model": "models/x"}),
        (f"/v1beta/{name}?updateMask=ttl", {"expireTime": at}),  # the mask names nothing in the body
        (f"/v1beta/{name}", {"ttl": "60s", "expireTime": at}),
        (f"/v1beta/{name}", {"expireTime": "tomorrow"}),
    ]:
        status, err = await api.call("PATCH", path, body)
        assert status == 400 and err["error"]["status"] == "INVALID_ARGUMENT", (path, body)


async def test_a_too_small_prefix_is_refused_as_google_does(api: Api, fake: FakeGemini) -> None:
    small = "x" * (MIN_TOKENS * 4 - 1)  # 99 tokens
    status, err = await api.call("POST", "/v1beta/cachedContents", cache_create_body(MODEL, small, 300))
    assert status == 400
    assert err == {
        "error": {
            "code": 400,
            "message": f"Cached content is too small. total_token_count={MIN_TOKENS - 1}, "
            f"min_total_token_count={MIN_TOKENS}",
            "status": "INVALID_ARGUMENT",
        }
    }
    assert fake.creates == 1 and not fake.cached
    await api.create(system="x" * (MIN_TOKENS * 4))  # exactly the minimum is enough


async def test_fail_next_create_fails_one_create(api: Api, fake: FakeGemini) -> None:
    fake.fail_next_create = 503
    status, err = await api.call("POST", "/v1beta/cachedContents", cache_create_body(MODEL, SYSTEM, 300))
    assert status == 503 and err["error"]["status"] == "UNAVAILABLE"
    assert fake.fail_next_create is None and not fake.cached
    await api.create()
    assert fake.creates == 2 and len(fake.cached) == 1


async def test_a_held_create_waits_until_released(api: Api, fake: FakeGemini) -> None:
    fake.hold_creates()
    task = asyncio.create_task(api.create())
    await async_wait_until(lambda: fake.creates == 1, what="the create to arrive")
    assert not task.done() and not fake.cached
    fake.release_creates()
    await task
    assert len(fake.cached) == 1


async def test_bad_create_bodies_are_refused(api: Api) -> None:
    for body in [
        {"systemInstruction": {"parts": [{"text": SYSTEM}]}},  # no model
        {"model": MODEL, "systemInstruction": {"parts": [{"text": SYSTEM}]}},  # not models/...
        {"model": f"models/{MODEL}", "systemInstruction": {"parts": []}},
        {"model": f"models/{MODEL}", "systemInstruction": {"parts": [{"text": SYSTEM}]}, "ttl": "5m"},
        [1, 2],
    ]:
        status, err = await api.call("POST", "/v1beta/cachedContents", body)
        assert status == 400 and err["error"]["status"] == "INVALID_ARGUMENT", body
    status, _ = await api.raw("/v1beta/cachedContents", "x")
    assert status == 400


# ---- generateContent ------------------------------------------------------------------------------------------


async def test_generate_content_without_a_cache(api: Api) -> None:
    body = chat(user="tell me about caches")
    status, resp = await api.call("POST", native_path(MODEL, False), to_native_request(body))
    assert status == 200
    prompt = tokens_of(SYSTEM) + tokens_of("tell me about caches")
    assert resp["usageMetadata"]["promptTokenCount"] == prompt
    assert "cachedContentTokenCount" not in resp["usageMetadata"]
    out = from_native_response(resp, model=MODEL, response_id="r1", created=1)
    assert out["choices"][0]["message"]["content"] == "echo: tell me about caches"
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"] == {
        "prompt_tokens": prompt,
        "completion_tokens": 5,
        "total_tokens": prompt + 5,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


async def test_generate_content_with_a_cache_reports_the_cached_tokens_inside_the_prompt(api: Api) -> None:
    name = (await api.create())["name"]
    body = chat(user="tell me about caches")
    status, plain = await api.call("POST", native_path(MODEL, False), to_native_request(body))
    status, cached = await api.call("POST", native_path(MODEL, False), to_native_request(body, cached_content=name))
    assert status == 200
    assert cached["usageMetadata"]["cachedContentTokenCount"] == tokens_of(SYSTEM)
    assert cached["usageMetadata"]["promptTokenCount"] == plain["usageMetadata"]["promptTokenCount"]
    out = from_native_response(cached, model=MODEL, response_id="r2", created=2)
    assert out["usage"]["prompt_tokens_details"] == {"cached_tokens": tokens_of(SYSTEM)}
    assert out["choices"][0]["message"]["content"] == "echo: tell me about caches"


async def test_generate_content_refusals(api: Api) -> None:
    name = (await api.create())["name"]
    other = (await api.create(model="gemini-2.5-pro"))["name"]
    contents = [{"role": "user", "parts": [{"text": "hi"}]}]
    system = {"parts": [{"text": SYSTEM}]}
    for body, says in [
        ({"contents": contents, "cachedContent": name, "systemInstruction": system}, "can not be used"),
        ({"contents": contents, "cachedContent": "cachedContents/nope"}, "not found"),
        ({"contents": contents, "cachedContent": other}, "has to be the same"),
        ({"contents": []}, "contents is not specified"),
        ({"contents": [{"role": "system", "parts": [{"text": "x"}]}]}, "valid role"),
        ({"contents": contents, "generationConfig": {"maxOutputTokens": 0}}, "max_output_tokens"),
    ]:
        status, err = await api.call("POST", native_path(MODEL, False), body)
        assert status == 400 and says in err["error"]["message"], (body, err)
    status, err = await api.call("POST", f"/v1beta/models/{MODEL}:embedContent", {"contents": contents})
    assert status == 404 and err["error"]["status"] == "NOT_FOUND"


async def test_max_output_tokens_cuts_the_answer(api: Api) -> None:
    body = chat(system=None, user="one two three four five", max_tokens=3, n=2)
    status, resp = await api.call("POST", native_path(MODEL, False), to_native_request(body))
    assert status == 200
    out = from_native_response(resp, model=MODEL, response_id="r", created=0)
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in out["choices"]] == [
        (0, "echo: one two", "length"),
        (1, "echo: one two", "length"),
    ]
    assert out["usage"]["completion_tokens"] == 6


async def test_streaming_sends_crlf_events_with_the_usage_on_the_last(api: Api) -> None:
    name = (await api.create())["name"]
    body = chat(user="stream this answer please", stream=True)
    status, raw = await api.raw(native_path(MODEL, True), to_native_request(body, cached_content=name))
    assert status == 200
    frames = raw.split(b"\r\n\r\n")
    assert frames[-1] == b"" and 2 <= len(frames) - 1 <= 3
    events = [orjson.loads(f.removeprefix(b"data: ")) for f in frames[:-1]]
    assert "candidatesTokenCount" not in events[0]["usageMetadata"]
    assert events[-1]["usageMetadata"]["cachedContentTokenCount"] == tokens_of(SYSTEM)
    assert events[-1]["candidates"][0]["finishReason"] == "STOP"

    conv = StreamConverter(MODEL, "chatcmpl-s", 3, include_usage=True)
    out = b"".join(conv.feed(raw[i : i + 7]) for i in range(0, len(raw), 7)) + conv.finish()
    chunks = [orjson.loads(f[6:]) for f in out.split(b"\n\n")[:-2]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "echo: stream this answer please"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens_details"] == {
        "cached_tokens": tokens_of(SYSTEM)
    }
    assert out.endswith(b"data: [DONE]\n\n")


async def test_streaming_without_alt_sse_is_one_json_array(api: Api) -> None:
    status, events = await api.call(
        "POST", f"/v1beta/models/{MODEL}:streamGenerateContent", to_native_request(chat(user="a b c"))
    )
    assert status == 200 and isinstance(events, list) and 2 <= len(events) <= 3
    assert "".join(e["candidates"][0]["content"]["parts"][0]["text"] for e in events) == "echo: a b c"


# ---- the OpenAI-compatible endpoint ---------------------------------------------------------------------------


async def test_openai_compat_with_a_cache_reports_cached_tokens(api: Api) -> None:
    name = (await api.create())["name"]
    status, plain = await api.call("POST", "/v1beta/openai/chat/completions", chat(user="hello there"))
    assert status == 200 and plain["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    body = openai_compat_with_cache(chat(user="hello there"), name)
    status, resp = await api.call("POST", "/v1beta/openai/chat/completions", body)
    assert status == 200
    assert resp["object"] == "chat.completion"
    assert resp["choices"][0]["message"] == {"role": "assistant", "content": "echo: hello there"}
    assert resp["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    assert resp["usage"]["prompt_tokens_details"] == {"cached_tokens": tokens_of(SYSTEM)}

    both = {**chat(user="hello there"), "extra_body": {"google": {"cached_content": name}}}
    status, err = await api.call("POST", "/v1beta/openai/chat/completions", both)
    assert status == 400 and "can not be used" in err["error"]["message"]


async def test_openai_compat_streams_with_a_usage_chunk(api: Api) -> None:
    name = (await api.create())["name"]
    body = openai_compat_with_cache(
        chat(user="a b c d", stream=True, stream_options={"include_usage": True}, max_tokens=3), name
    )
    status, raw = await api.raw("/v1beta/openai/chat/completions", body)
    assert status == 200 and raw.endswith(b"data: [DONE]\n\n")
    chunks = [orjson.loads(f[6:]) for f in raw.split(b"\n\n")[:-2]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks if c["choices"]) == "echo: a b"
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


# ---- auth, records, errors ------------------------------------------------------------------------------------


async def test_auth(api: Api, session: aiohttp.ClientSession, fake: FakeGemini) -> None:
    status, err = await api.call("GET", "/v1beta/cachedContents", key=None)
    assert status == 401 and set(err["error"]) == {"code", "message", "status"}
    assert err["error"]["status"] == "UNAUTHENTICATED"
    status, err = await api.call("GET", "/v1beta/cachedContents", key="wrong")
    assert (status, err["error"]["status"]) == (403, "PERMISSION_DENIED")
    assert (await api.call("GET", f"/v1beta/cachedContents?key={KEY}", key=None))[0] == 200
    assert (await api.call("GET", "/v1beta/cachedContents?key=wrong", key=None))[0] == 403
    bearer = {"authorization": f"Bearer {KEY}"}
    status, _ = await api.call("POST", "/v1beta/openai/chat/completions", chat(), headers=bearer, key=None)
    assert status == 200
    status, _ = await api.call("POST", native_path(MODEL, False), to_native_request(chat()), headers=bearer, key=None)
    assert status == 401  # a bearer token on the native API is OAuth, not the key
    assert fake.creates == 0 and all(r.path != "/v1beta/cachedContents" or r.method == "GET" for r in fake.requests)


async def test_requests_are_recorded_bounded_and_without_the_key(api: Api, fake: FakeGemini) -> None:
    await api.call("GET", f"/v1beta/cachedContents?key={KEY}&pageSize=5", key=None)
    rec = fake.requests[-1]
    assert (rec.method, rec.path, rec.query, rec.body) == ("GET", "/v1beta/cachedContents", {"pageSize": "5"}, None)
    native = to_native_request(chat())
    for _ in range(MAX_REQUESTS_RECORDED + 5):
        await api.call("POST", native_path(MODEL, False), native)
    assert len(fake.requests) == MAX_REQUESTS_RECORDED
    assert fake.requests[-1].body == native and fake.generates == MAX_REQUESTS_RECORDED + 5


async def test_an_unknown_path_is_a_json_404(api: Api) -> None:
    status, err = await api.call("GET", "/v1beta/files")
    assert status == 404 and err["error"]["status"] == "NOT_FOUND"


# ---- as a subprocess, over TLS --------------------------------------------------------------------------------


def test_as_a_subprocess_it_prints_ready_and_is_steered_over_http(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    argv = ["-m", "tests.support.fake_gemini", "--port", "0", "--api-key-file", str(key_file)]
    proc = start_cli([*argv, "--min-cache-tokens", "10"], tmp_path, "fake-gemini")
    try:
        ready = proc.read_line()
        assert ready.startswith("READY ")
        base = f"http://127.0.0.1:{int(ready.split()[1])}"
        headers = {"x-goog-api-key": KEY}
        create = cache_create_body(MODEL, "y" * 40, 60)
        assert http("POST", f"{base}/v1beta/cachedContents", create, headers).status == 200
        assert http("POST", f"{base}/_fake/control", {"fail_next_create": 500}).json() == {"ok": True}
        assert http("POST", f"{base}/v1beta/cachedContents", create, headers).status == 500
        stats = http("GET", f"{base}/_fake/stats").json()
        assert stats["creates"] == 2 and len(stats["cached"]) == 1
        assert [r["path"] for r in stats["requests"]] == ["/v1beta/cachedContents"] * 2
        http("POST", f"{base}/_fake/control", {"advance_s": 61})
        assert http("GET", f"{base}/_fake/stats").json()["cached"] == {}
        assert http("GET", f"{base}/v1beta/cachedContents", headers={"x-goog-api-key": "no"}).status == 403
    finally:
        assert proc.stop() == 0, proc.stderr()


async def test_over_tls(tmp_path: Path) -> None:
    ca = TestCA()
    issued = ca.issue("localhost")
    (tmp_path / "c.pem").write_bytes(issued.cert_pem)
    (tmp_path / "k.pem").write_bytes(issued.key_pem)
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(tmp_path / "c.pem", tmp_path / "k.pem")
    fake = await start_fake_gemini(api_key=KEY, tls=server, host="127.0.0.1")
    try:
        assert fake.base_url == f"https://127.0.0.1:{fake.port}"
        client = ssl.create_default_context(cadata=ca.pem.decode())
        async with (
            aiohttp.ClientSession() as s,
            s.get(f"{fake.base_url}/v1beta/cachedContents", headers={"x-goog-api-key": KEY}, ssl=client) as r,
        ):
            assert r.status == 200 and await r.json() == {"cachedContents": []}
    finally:
        await fake.stop()


# ---- Google's client library ----------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:Inheritance class AiohttpClientSession:DeprecationWarning")
async def test_googles_client_library_against_the_fake(fake: FakeGemini) -> None:
    genai = pytest.importorskip(
        "google.genai",
        reason="Google's client library (pip package google-genai) is not installed in this environment",
    )
    from google.genai import types

    # kv-epp speaks v1beta (the version with cachedContents that the seed names); the library's default may differ
    client = genai.Client(api_key=KEY, http_options=types.HttpOptions(base_url=fake.base_url, api_version="v1beta"))
    cache = await client.aio.caches.create(
        model=MODEL, config=types.CreateCachedContentConfig(system_instruction=SYSTEM, ttl="300s")
    )
    assert cache.name in fake.cached and cache.usage_metadata.total_token_count == tokens_of(SYSTEM)
    config = types.GenerateContentConfig(cached_content=cache.name, max_output_tokens=50)
    resp = await client.aio.models.generate_content(model=MODEL, contents="hello there", config=config)
    assert resp.text == "echo: hello there"
    assert resp.usage_metadata.cached_content_token_count == tokens_of(SYSTEM)
    streamed = [c async for c in await client.aio.models.generate_content_stream(model=MODEL, contents="a b c")]
    assert "".join(c.text or "" for c in streamed) == "echo: a b c"
    assert streamed[-1].usage_metadata.candidates_token_count == 4
    updated = await client.aio.caches.update(name=cache.name, config=types.UpdateCachedContentConfig(ttl="900s"))
    assert updated.expire_time.timestamp() == pytest.approx(T0 + 900)
    await client.aio.caches.delete(name=cache.name)
    assert not fake.cached and (fake.creates, fake.patches, fake.deletes) == (1, 1, 1)
    with pytest.raises(genai.errors.ClientError) as e:
        await client.aio.caches.get(name=cache.name)
    assert e.value.code == 404
