"""The simulator's deterministic /v1/embeddings: OpenAI's shapes, similar texts similar, unrelated ones not."""

from __future__ import annotations

import base64
import struct
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from benchmarks.engine_sim import EngineSimulator, SimConfig
from benchmarks.engine_sim.embeddings import (
    DEFAULT_DIM,
    MAX_DIM,
    MAX_INPUT_CHARS,
    MAX_OUTPUT_VALUES,
    MAX_TOTAL_CHARS,
    OFFLOAD_CHARS,
    cosine,
    embed_text,
)
from tests.support.embedding_texts import LONG, ONE_WORD_CHANGED, UNRELATED

FAST = SimConfig(time_scale=0.001, kv_events_enabled=False)


@pytest.fixture
async def sim() -> AsyncIterator[EngineSimulator]:
    simulator = EngineSimulator(FAST)
    await simulator.start()
    try:
        yield simulator
    finally:
        await simulator.stop()


async def post(sim: EngineSimulator, body: Any) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as http, http.post(sim.base_url + "/v1/embeddings", json=body) as resp:
        return resp.status, await resp.json()


async def test_openai_response_shape(sim: EngineSimulator) -> None:
    status, out = await post(sim, {"model": FAST.model, "input": [LONG, ONE_WORD_CHANGED, UNRELATED[0]]})
    assert status == 200
    assert out["object"] == "list" and out["model"] == FAST.model
    assert [d["object"] for d in out["data"]] == ["embedding"] * 3
    assert [d["index"] for d in out["data"]] == [0, 1, 2]
    vectors = [d["embedding"] for d in out["data"]]
    assert all(len(v) == DEFAULT_DIM for v in vectors)
    assert vectors[0] == embed_text(LONG)  # the HTTP answer is the offline function's
    assert cosine(vectors[0], vectors[1]) > 0.9 > 0.5 > cosine(vectors[0], vectors[2])
    words = len(LONG.split()) + len(ONE_WORD_CHANGED.split()) + len(UNRELATED[0].split())
    assert out["usage"] == {"prompt_tokens": words, "total_tokens": words}


async def test_string_input_dimensions_and_base64(sim: EngineSimulator) -> None:
    status, out = await post(sim, {"model": FAST.model, "input": "hello world", "dimensions": 64})
    assert status == 200 and len(out["data"]) == 1 and len(out["data"][0]["embedding"]) == 64
    status, out = await post(sim, {"model": FAST.model, "input": "hello world", "encoding_format": "base64"})
    assert status == 200
    raw = base64.b64decode(out["data"][0]["embedding"])
    floats = struct.unpack(f"<{DEFAULT_DIM}f", raw)
    assert all(abs(x - y) < 1e-6 for x, y in zip(floats, embed_text("hello world"), strict=True))


@pytest.mark.parametrize(
    ("body", "status", "fragment"),
    [
        ({"model": FAST.model}, 400, "'input'"),
        ({"model": FAST.model, "input": []}, 400, "'input'"),
        ({"model": FAST.model, "input": [1, 2, 3]}, 400, "'input'"),
        ({"model": FAST.model, "input": ""}, 400, "input[0]"),
        ({"model": FAST.model, "input": "x", "dimensions": 0}, 400, "'dimensions'"),
        ({"model": FAST.model, "input": "x", "encoding_format": "int8"}, 400, "'encoding_format'"),
        ({"model": "other-model", "input": "x"}, 404, "does not exist"),
        # the bounds: every text within MAX_INPUT_CHARS, all of them within MAX_TOTAL_CHARS, and the answer
        # within MAX_OUTPUT_VALUES coordinates (texts x dimensions)
        (
            {"model": FAST.model, "input": ["y" * MAX_INPUT_CHARS] * (MAX_TOTAL_CHARS // MAX_INPUT_CHARS + 1)},
            400,
            "characters in all",
        ),
        (
            {"model": FAST.model, "input": ["x"] * (MAX_OUTPUT_VALUES // MAX_DIM + 1), "dimensions": MAX_DIM},
            400,
            "coordinates",
        ),
        ([1], 400, "JSON object"),
    ],
)
async def test_bad_requests_name_the_field(sim: EngineSimulator, body: Any, status: int, fragment: str) -> None:
    got, out = await post(sim, body)
    assert got == status
    assert fragment in out["message"]


async def test_a_large_request_is_answered_as_a_small_one(sim: EngineSimulator) -> None:
    """Above OFFLOAD_CHARS the server computes in a worker thread: the same vectors as inline."""
    text = "word " * (OFFLOAD_CHARS // 5 + 10)
    got, out = await post(sim, {"model": FAST.model, "input": [text, "short"]})
    assert got == 200
    assert [d["index"] for d in out["data"]] == [0, 1]
    assert out["data"][0]["embedding"] == embed_text(text)
    assert out["data"][1]["embedding"] == embed_text("short")
