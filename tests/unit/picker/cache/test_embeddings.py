"""EmbeddingsClient without a socket (a stand-in for the caller's aiohttp session): the request it sends, input
skipped without a request, each failure a None counted by its reason, and the breaker (timeouts count,
a success resets the run, a cancelled probe is neither outcome). A hand-driven clock."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest

from picker.cache.embeddings import EmbeddingsClient


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Content:
    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks
        self.read = 0

    async def iter_any(self) -> AsyncIterator[bytes]:
        for c in self.chunks:
            self.read += 1
            yield c


class Response:
    def __init__(self, status: int, chunks: list[bytes], content_length: int | None) -> None:
        self.status = status
        self.content_length = content_length
        self.content = Content(chunks)

    async def __aenter__(self) -> Response:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None


class Session:
    """What the client uses of an aiohttp.ClientSession: ``post`` as an async context manager."""

    def __init__(self) -> None:
        self.posts: list[tuple[str, bytes, dict[str, str]]] = []
        self.answer: Any = ok([3.0, 4.0])  # a Response, or an exception to raise
        self.entered = asyncio.Event()
        self.release: asyncio.Event | None = None  # set: the post waits for it
        self.closed = False

    def post(self, url: str, *, data: bytes, headers: dict[str, str]) -> Any:
        self.posts.append((url, data, headers))
        session = self

        class Call:
            async def __aenter__(self) -> Response:
                session.entered.set()
                if session.release is not None:
                    await session.release.wait()
                if isinstance(session.answer, BaseException):
                    raise session.answer
                return session.answer

            async def __aexit__(self, *exc: object) -> None:
                return None

        return Call()

    async def close(self) -> None:
        self.closed = True


def ok(vector: Any) -> Response:
    raw = orjson.dumps({"data": [{"embedding": vector}]})
    return Response(200, [raw], len(raw))


async def embed(client: EmbeddingsClient, text: str = "question", max_input_bytes: int = 100) -> Any:
    return await client.embed("http://emb:8080/", "e5", text, timeout_ms=1000, max_input_bytes=max_input_bytes)


async def test_one_post_of_openais_format_and_a_unit_vector_back() -> None:
    session = Session()
    client = EmbeddingsClient(session)  # type: ignore[arg-type]
    assert await embed(client) == (0.6, 0.8)
    [(url, payload, headers)] = session.posts
    assert url == "http://emb:8080/v1/embeddings"  # the backend's trailing slash is not doubled
    assert orjson.loads(payload) == {"model": "e5", "input": "question"}
    assert headers["content-type"] == "application/json"
    assert (client.stats.requests, client.stats.ok, client.stats.errors) == (1, 1, {})


async def test_input_that_is_empty_or_over_the_byte_bound_is_skipped_without_a_request() -> None:
    session = Session()
    client = EmbeddingsClient(session)  # type: ignore[arg-type]
    assert await embed(client, "") is None
    assert await embed(client, "x" * 11, max_input_bytes=10) is None
    assert await embed(client, "é" * 6, max_input_bytes=10) is None  # 6 characters, 12 UTF-8 bytes
    assert await embed(client, "é" * 5, max_input_bytes=10) == (0.6, 0.8)  # exactly 10 bytes
    assert client.stats.skipped == 3 and len(session.posts) == 1


async def test_text_that_cannot_be_json_is_malformed_without_a_request() -> None:
    session = Session()
    client = EmbeddingsClient(session)  # type: ignore[arg-type]
    assert await embed(client, "a\ud800b") is None  # a lone surrogate
    assert session.posts == [] and client.stats.errors == {"malformed": 1}


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        pytest.param(Response(503, [b"{}"], 2), "status", id="non-200"),
        pytest.param(Response(200, [b"{}"], 65), "too_large", id="declared-too-large"),
        pytest.param(Response(200, [b"x" * 40, b"x" * 40], None), "too_large", id="streamed-too-large"),
        pytest.param(Response(200, [b"not json"], None), "malformed", id="not-json"),
        pytest.param(Response(200, [b'{"data":{"embedding":[1]}}'], None), "malformed", id="data-not-a-list"),
        pytest.param(Response(200, [b'{"data":[[1,2]]}'], None), "malformed", id="item-not-an-object"),
        pytest.param(Response(200, [b'{"data":[{}]}'], None), "malformed", id="no-embedding"),
        pytest.param(ok([0, 0]), "malformed", id="zero-vector"),
        pytest.param(ok([1, "2"]), "malformed", id="not-numbers"),
        pytest.param(aiohttp.ClientConnectionError("refused"), "connect", id="client-error"),
        pytest.param(OSError("unreachable"), "connect", id="os-error"),
        pytest.param(RuntimeError("bug"), "other", id="anything-else"),
    ],
)
async def test_every_failure_is_a_none_counted_by_its_reason(answer: Any, reason: str) -> None:
    session = Session()
    session.answer = answer
    client = EmbeddingsClient(session, max_response_bytes=64)  # type: ignore[arg-type]
    assert await embed(client) is None
    assert client.stats.errors == {reason: 1} and client.stats.ok == 0


async def test_a_declared_length_over_the_bound_is_refused_before_reading() -> None:
    session = Session()
    session.answer = Response(200, [b"{}"], 1 << 30)
    client = EmbeddingsClient(session, max_response_bytes=64)  # type: ignore[arg-type]
    assert await embed(client) is None
    assert session.answer.content.read == 0


def test_breaker_settings_are_validated() -> None:
    client = EmbeddingsClient()
    for failures, cooldown in ((0, 1.0), (1, 0.0), (1, -1.0), (1, float("nan"))):
        with pytest.raises(ValueError, match="breaker failures >= 1 and cooldown > 0"):
            client.configure_breaker(failures, cooldown)
    client.configure_breaker(2, 3)
    assert (client.breaker_failures, client.breaker_cooldown_s) == (2, 3.0)


async def test_timeouts_open_the_breaker_and_a_success_resets_the_run() -> None:
    session = Session()
    clock = Clock()
    client = EmbeddingsClient(session, clock=clock)  # type: ignore[arg-type]
    client.configure_breaker(2, 5.0)
    good = session.answer
    session.answer = TimeoutError()
    assert await embed(client) is None
    session.answer = good
    assert await embed(client) is not None  # the run of failures starts again
    session.answer = TimeoutError()
    assert await embed(client) is None
    assert not client.open
    assert await embed(client) is None  # two in a row: open
    assert client.open and client.stats.timeouts == 3 and client.stats.breaker_opened == 1
    assert await embed(client) is None and len(session.posts) == 4  # open: no request
    clock.now += 4.999
    assert client.open
    clock.now += 0.001
    assert not client.open


async def test_a_cancelled_probe_is_neither_a_success_nor_a_failure() -> None:
    session = Session()
    clock = Clock()
    client = EmbeddingsClient(session, clock=clock)  # type: ignore[arg-type]
    client.configure_breaker(1, 5.0)
    session.answer = aiohttp.ClientConnectionError("refused")
    assert await embed(client) is None and client.open
    clock.now += 5.0
    session.answer = ok([1.0, 0.0])
    session.release = asyncio.Event()
    session.entered.clear()
    probe = asyncio.create_task(embed(client))
    await session.entered.wait()
    assert client.open  # the probe is out
    probe.cancel()
    with pytest.raises(asyncio.CancelledError):
        await probe
    assert not client.open and client.stats.breaker_opened == 1  # not reopened: the next call probes again
    session.release.set()
    assert await embed(client) == (1.0, 0.0)
    assert not client.open


async def test_close_leaves_the_callers_session_open() -> None:
    session = Session()
    client = EmbeddingsClient(session)  # type: ignore[arg-type]
    await client.close()
    assert not session.closed
    own = EmbeddingsClient()
    await own.close()  # no session was ever made: nothing to close
