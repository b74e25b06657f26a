"""listener.zmq_replay against a replay ROUTER on loopback: every reply layout, the end marker, a silent or a
malformed engine, the bound on one replay.

Here the tests that start a server or bind a socket; the rest, in process:
tests/unit/listener/test_zmq_replay.py."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
import zmq
import zmq.asyncio

from listener import zmq_replay
from listener.config import LimitsConfig, SourceConfig
from listener.zmq_replay import END_SEQ, ReplayEnd, replay
from tests.support.fake_engines import ReplayServer, seq8


def cfg(endpoint: str, timeout_ms: int = 2000) -> SourceConfig:
    return SourceConfig(
        backend_name="e1", model="m", zmq_endpoint="tcp://127.0.0.1:1", replay_endpoint=endpoint,
        replay_timeout_ms=timeout_ms,
    )  # fmt: skip


async def collect(stream: AsyncIterator[tuple[int, bytes]]) -> tuple[list[tuple[int, bytes]], str]:
    got: list[tuple[int, bytes]] = []
    try:
        async for item in stream:
            got.append(item)
    except ReplayEnd as end:
        return got, end.args[0]
    raise AssertionError("a replay always ends with ReplayEnd")


@pytest.mark.parametrize("layout", ReplayServer.LAYOUTS)
async def test_replies_from_the_start_seq_until_the_end_marker(ctx: zmq.asyncio.Context, layout: str) -> None:
    server = ReplayServer(ctx, layout)
    server.buffer = {1: b"one", 2: b"two", 3: b"three"}
    try:
        got, status = await collect(replay(ctx, cfg(server.endpoint), LimitsConfig(), 2, lambda: None))
    finally:
        await server.close()
    assert got == [(2, b"two"), (3, b"three")] and status == "end" and server.requests == [2]


async def test_a_silent_engine_times_out(ctx: zmq.asyncio.Context) -> None:
    silent = ctx.socket(zmq.ROUTER)
    silent.setsockopt(zmq.LINGER, 0)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        got, status = await collect(replay(ctx, cfg(f"tcp://127.0.0.1:{port}", 50), LimitsConfig(), 0, lambda: None))
    finally:
        silent.close(linger=0)
    assert (got, status) == ([], "timeout")


@contextlib.asynccontextmanager
async def answering(ctx: zmq.asyncio.Context, *replies: list[bytes]) -> AsyncIterator[str]:
    """A ROUTER that answers any request with these replies (frames after the envelope)."""
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")

    async def serve() -> None:
        ident = (await router.recv_multipart())[0]
        for frames in replies:
            await router.send_multipart([ident, *frames])

    task = asyncio.create_task(serve())
    try:
        yield f"tcp://127.0.0.1:{port}"
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        router.close(linger=0)


async def test_a_malformed_reply_ends_the_replay_and_is_reported(ctx: zmq.asyncio.Context) -> None:
    malformed: list[int] = []
    async with answering(ctx, [b"", seq8(0), b"zero"], [b"", b"\x01\x02", b"bad seq"]) as endpoint:
        got, status = await collect(replay(ctx, cfg(endpoint), LimitsConfig(), 0, lambda: malformed.append(1)))
    assert got == [(0, b"zero")] and status == "error" and malformed == [1]


async def test_one_replay_applies_a_bounded_number_of_batches(
    ctx: zmq.asyncio.Context, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(zmq_replay, "MAX_REPLAY_MESSAGES", 2)
    replies = [[b"", seq8(i), b"p"] for i in range(5)] + [[b"", END_SEQ, b""]]
    async with answering(ctx, *replies) as endpoint:
        got, status = await collect(replay(ctx, cfg(endpoint), LimitsConfig(), 0, lambda: None))
    assert [s for s, _ in got] == [0, 1] and status == "limit"
