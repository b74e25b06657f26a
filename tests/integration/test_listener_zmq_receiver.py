"""listener.zmq_receiver over real ZMQ sockets: the true connection state (and what /healthz makes of it),
staleness, the receive backlog bound, the publisher allow-list, bind mode.

Here the tests that start a server or bind a socket; the rest, in process:
tests/unit/listener/test_zmq_receiver.py."""

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
from listener.metrics import ListenerMetrics
from listener.zmq_receiver import VERIFY, ZmqReceiver, rcv_hwm
from listener.zmq_source import ZmqEventSource
from tests.support.fake_engines import PAGE as BS
from tests.support.fake_engines import Engine, stored, tokens
from tests.support.poll import async_wait_until

MODEL = "m"
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


async def test_bind_mode_queues_the_new_connection_before_its_first_message(ctx: zmq.asyncio.Context) -> None:
    """In bind mode the engine's publisher connects to the listener: the receiver learns its port, counts the peer
    once handshaken, and queues the reconnection marker before the first message that came over it."""
    cfg = SourceConfig(backend_name="e1", model=MODEL, zmq_endpoint="tcp://127.0.0.1:*", zmq_mode="bind")
    rx = ZmqReceiver(cfg, LimitsConfig(), ListenerMetrics(), ctx)
    rx.open()
    reader = asyncio.create_task(rx.read_loop())
    engine = ctx.socket(zmq.XPUB)  # its subscription message says the listener's SUB is there
    engine.setsockopt(zmq.LINGER, 0)
    try:
        assert rx.bound_endpoint is not None and not rx.bound_endpoint.endswith(":*")
        engine.connect(rx.bound_endpoint)
        async with asyncio.timeout(10):
            assert (await engine.recv())[:1] == b"\x01"
        await engine.send_multipart([b"", (7).to_bytes(8, "big"), b"payload"])
        first, size = await asyncio.wait_for(rx.get(), 10)
        assert first is VERIFY and size == 0
        assert rx.connected and rx.ever_connected and rx.peers == 1
        item, size = await asyncio.wait_for(rx.get(), 10)
        assert item == (7, b"payload") and size == len(b"payload") + 64 and rx.backlog_bytes == size
        rx.release(size)
        assert rx.backlog_bytes == 0
    finally:
        engine.close(linger=0)
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader
        rx.close()
    assert not rx.opened and rx.peers == 0
