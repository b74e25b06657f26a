"""True connection state, staleness and the receive backlog bound, over real ZMQ sockets (issue 8)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import zmq
import zmq.asyncio
from aiohttp import ClientSession

from listener.app import ListenerApp
from listener.config import LimitsConfig, ListenerConfig, SourceConfig
from listener.zmq_receiver import rcv_hwm
from listener.zmq_source import ZmqEventSource
from tests.support.poll import async_wait_until
from tests.unit.test_listener_restart_state import BS, MODEL, Engine, stored, tokens

FREE_PORT_PROBE = "tcp://127.0.0.1"


def make(endpoint: str, replay: str | None = None, limits: LimitsConfig | None = None, **top: Any) -> ListenerApp:
    src = SourceConfig(backend_name="e1", model=MODEL, block_size=BS, zmq_endpoint=endpoint, replay_endpoint=replay)
    return ListenerApp(
        ListenerConfig(listen="127.0.0.1:0", key_block_size=BS, limits=limits or LimitsConfig(), sources=(src,), **top)
    )


@contextlib.asynccontextmanager
async def running(app: ListenerApp) -> AsyncIterator[ListenerApp]:
    await app.start()
    try:
        yield app
    finally:
        await app.stop()


async def healthz(app: ListenerApp) -> dict[str, Any]:
    async with ClientSession() as s, s.get(f"http://127.0.0.1:{app.port}/healthz") as r:
        body: dict[str, Any] = await r.json()
        return body


def source(app: ListenerApp) -> ZmqEventSource:
    src = app.sources["e1"]
    assert isinstance(src, ZmqEventSource)
    return src


async def test_both_sides_connecting_is_never_connected(ctx: zmq.asyncio.Context) -> None:
    """The engine publishes in connect mode on an address the listener also connects to: no TCP peer
    ever, no event ever; /healthz must not say connected."""
    probe = ctx.socket(zmq.PULL)
    port = probe.bind_to_random_port(FREE_PORT_PROBE)
    probe.close(linger=0)  # a port nobody listens on
    endpoint = f"tcp://127.0.0.1:{port}"
    engine = ctx.socket(zmq.PUB)
    engine.setsockopt(zmq.LINGER, 0)
    engine.connect(endpoint)  # the engine's publisher in connect mode
    try:
        async with running(make(endpoint, connect_grace_seconds=0.0)) as app:
            await engine.send_multipart([b"", (0).to_bytes(8, "big"), msgpack.packb([0.0, [], 0])])
            body = await async_wait_until(
                lambda: healthz(app), what="/healthz"
            )  # answers at once; the state is what matters
            e1 = body["sources"]["e1"]
            assert e1["connected"] is False and e1["state"] == "connecting"
            body = await async_wait_until(lambda: _degraded(app), what="degraded status after the grace period")
            assert body["degraded_sources"] == ["e1"]
    finally:
        engine.close(linger=0)


async def _degraded(app: ListenerApp) -> dict[str, Any] | None:
    body = await healthz(app)
    return body if body["status"] == "degraded" else None


async def test_connected_only_while_a_peer_is_and_stale_without_events(ctx: zmq.asyncio.Context) -> None:
    engine = Engine(ctx)
    try:
        async with running(make(engine.endpoint, engine.replay_endpoint, stale_after_seconds=0.3)) as app:
            await engine.subscribed(1)
            await async_wait_until(lambda: source(app).connected)
            await engine.publish([stored([1], None, tokens(1, 1))])
            await async_wait_until(lambda: source(app).last_seq == 0)
            body = await async_wait_until(lambda: _degraded(app), what="a stale source")
            e1 = body["sources"]["e1"]
            assert e1["state"] == "stale" and e1["connected"] is True and e1["last_seq"] == 0
            assert e1["last_event_age_seconds"] >= 0.3
            await engine.close()
            await async_wait_until(lambda: not source(app).connected, what="the monitor to see the disconnect")
            body = await healthz(app)
            assert body["sources"]["e1"]["state"] == "disconnected" and body["sources"]["e1"]["connected"] is False
    finally:
        await engine.close()


async def test_backlog_is_bounded_in_bytes_and_repaired_by_replay(ctx: zmq.asyncio.Context) -> None:
    engine = Engine(ctx)
    limits = LimitsConfig(max_backlog_bytes=1 << 16, max_message_bytes=1 << 15)
    assert rcv_hwm(limits) == 2  # so libzmq holds at most 2 × 32 KiB more
    gate = asyncio.Event()
    peak = 0
    try:
        app = make(engine.endpoint, engine.replay_endpoint, limits=limits)
        src = source(app)
        original = src.apply_payload

        async def gated(payload: bytes) -> None:
            nonlocal peak
            peak = max(peak, src.backlog_bytes)
            await gate.wait()  # the applier is stuck: the reader must not queue without bound
            await original(payload)

        src.apply_payload = gated  # type: ignore[method-assign]
        async with running(app):
            await engine.subscribed(1)
            filler = list(range(70_000, 72_000))  # ~10 KiB payloads: 6 fit in the 64 KiB backlog
            for i in range(60):
                await engine.publish([stored([100 + i], None, tokens(i, 1)), ["Unknown", filler]])

            def drops() -> float:
                v = app.metrics.registry.get_sample_value(
                    "kv_listener_events_dropped_total", {"source": "e1", "reason": "backlog_full"}
                )
                return v or 0.0

            await async_wait_until(lambda: drops() > 0, what="backlog_full drops")
            assert src.backlog_bytes <= limits.max_backlog_bytes
            gate.set()
            last = await engine.publish([stored([999], None, tokens(99, 1))])
            await async_wait_until(lambda: src.last_seq == last, what="the gap repaired by replay")
            assert len(app.feeds["e1"].state) == 61
            assert peak <= limits.max_backlog_bytes
    finally:
        await engine.close()


async def test_a_big_batch_does_not_hold_the_loop(ctx: zmq.asyncio.Context) -> None:
    """The applier yields between events: other tasks (the /healthz handler) run during a big batch."""
    app = make("tcp://127.0.0.1:1")
    src = source(app)
    events = [stored([10_000 + i], None, tokens(i, 1)) for i in range(20_000)]
    payload = msgpack.packb([0.0, events, 0])
    ticks = 0
    done = False

    async def ticker() -> None:
        nonlocal ticks
        while not done:
            ticks += 1
            await asyncio.sleep(0)

    t = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    before = ticks
    await src.apply_payload(payload)
    during = ticks - before
    done = True
    await t
    assert src.tracker.tracked_blocks > 0
    assert during > 1, "the loop did not get a turn while 20 000 events were applied"
