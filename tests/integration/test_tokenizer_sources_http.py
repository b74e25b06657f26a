"""Tokenizer sources: engine /tokenize (chat and prompt, timeout, errors → None), local, none.

Here the tests that start a server or bind a socket; the rest, in process:
tests/unit/picker/kv/test_tokenizer_sources.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from picker.kv.tokenizer_sources import (
    EngineTokenizer,
)
from tests.support.http_server import serve


@pytest.fixture
async def engine() -> AsyncIterator[tuple[str, list[dict[str, Any]]]]:
    seen: list[dict[str, Any]] = []
    release = asyncio.Event()

    async def tokenize(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(body)
        if body.get("model") == "slow":
            await release.wait()
        if body.get("model") == "broken":
            return web.json_response({"tokens": ["x"]})
        if body.get("model") == "err":
            return web.json_response({"error": "no"}, status=400)
        n = len(body.get("messages", [])) or len(body.get("prompt", ""))
        return web.json_response({"count": n, "max_model_len": 100, "tokens": list(range(n))})

    async with serve([web.post("/tokenize", tokenize)]) as url:
        yield url, seen
        release.set()


async def test_engine_tokenizer(engine: tuple[str, list[dict[str, Any]]]) -> None:
    url, seen = engine
    tok = EngineTokenizer(lambda model: url, timeout_ms=200, max_concurrency=2)
    try:
        msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
        assert await tok.token_ids("m", messages=msgs) == [0, 1]
        assert seen[-1] == {"model": "m", "messages": msgs, "add_generation_prompt": True}
        assert await tok.token_ids("m", prompt="abc") == [0, 1, 2]
        assert seen[-1] == {"model": "m", "prompt": "abc"}
        assert await tok.token_ids("slow", prompt="abc") is None  # timeout → None, never raises
        assert await tok.token_ids("broken", prompt="abc") is None
        assert await tok.token_ids("err", prompt="abc") is None
        assert await tok.token_ids("m") is None
        assert tok.failures["timeout"] == 1 and tok.failures["bad_response"] == 1
    finally:
        await tok.close()
    down = EngineTokenizer(lambda model: "http://127.0.0.1:1", timeout_ms=200)
    assert await down.token_ids("m", prompt="x") is None
    await down.close()


async def test_engine_tokenizer_reads_an_answer_written_in_pieces() -> None:
    """Regression (issue 8, item 3): the /tokenize answer arriving in two writes was read half and dropped."""
    answer = b'{"count": 3, "max_model_len": 100, "tokens": [11, 22, 33]}'

    async def tokenize(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"content-type": "application/json"})
        await resp.prepare(request)
        await resp.write(answer[:20])
        await asyncio.sleep(0.05)  # part of the scenario: the second piece comes later, as on a real network
        await resp.write(answer[20:])
        await resp.write_eof()
        return resp

    async with serve([web.post("/tokenize", tokenize)]) as url:
        tok = EngineTokenizer(lambda model: url, timeout_ms=5_000)
        try:
            assert await tok.token_ids("m", prompt="abc") == [11, 22, 33]
            assert tok.failures == {}
        finally:
            await tok.close()


async def test_engine_tokenizer_refuses_an_oversized_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    import picker.kv.tokenizer_sources as ts

    monkeypatch.setattr(ts, "MAX_TOKENIZE_RESPONSE_BYTES", 64)

    async def tokenize(request: web.Request) -> web.Response:
        return web.json_response({"tokens": list(range(100))})

    async with serve([web.post("/tokenize", tokenize)]) as url:
        tok = EngineTokenizer(lambda model: url, timeout_ms=5_000)
        try:
            assert await tok.token_ids("m", prompt="abc") is None
            assert tok.failures == {"too_large": 1}
        finally:
            await tok.close()
