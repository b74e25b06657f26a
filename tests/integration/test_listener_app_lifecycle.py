"""listener.app.lifecycle: start → serve → drain → stop in process (HTTP and gRPC on loopback, ZMQ sockets): the
ready line, readiness at each step and /readyz, a busy HTTP port or ZMQ bind endpoint as a one-line StartupError
with nothing left open, a crashed supervised task, /healthz's degraded status. As real processes (signals, exit
codes): tests/integration/test_listener_lifecycle.py."""

from __future__ import annotations

import asyncio
import re
import socket
from typing import Any

import aiohttp
import pytest
import zmq
import zmq.asyncio

from listener.app import ListenerApp, StartupError
from listener.config import GrpcFeedConfig, ListenerConfig, SourceConfig
from listener.zmq_source import ZmqEventSource
from tests.support.poll import async_wait_until


def source(endpoint: str = "tcp://127.0.0.1:1", **kw: Any) -> SourceConfig:
    return SourceConfig(backend_name="e1", model="m", zmq_endpoint=endpoint, **kw)


def config(**kw: Any) -> ListenerConfig:
    return ListenerConfig(**{"listen": "127.0.0.1:0", "sources": (source(),), "drain_propagation_seconds": 0, **kw})


async def readyz(app: ListenerApp) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{app.port}/readyz") as r:
        return r.status, await r.json()


async def test_readiness_from_start_to_stop() -> None:
    app = ListenerApp(config(grpc=GrpcFeedConfig(listen="127.0.0.1:0")))
    assert app.readiness() == (False, "starting")
    await app.start()
    try:
        assert app.port and app.grpc is not None and app.grpc.port
        assert app.ready_line() == f"kv-listener ready listen=127.0.0.1:{app.port} grpc=127.0.0.1:{app.grpc.port}"
        assert await readyz(app) == (200, {"status": "ready", "reason": "ready"})
        assert app.metrics.registry.get_sample_value("continuum_listener_sources") == 1
        hurry = asyncio.Event()
        hurry.set()
        await app.drain_and_stop(hurry)
        assert app.readiness() == (False, "draining") and app.refusing
        assert app.grpc is None and app.health()["status"] == "draining"
    finally:
        await app.stop()
    await app.stop()  # idempotent


async def test_a_busy_http_port_is_a_startup_error_that_leaves_nothing_open() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        app = ListenerApp(config(listen=f"127.0.0.1:{port}"))
        with pytest.raises(StartupError, match=re.escape(f"listen 127.0.0.1:{port}: Address already in use")):
            await app.start()
    src = app.sources["e1"]
    assert not app.started and isinstance(src, ZmqEventSource) and src.ctx.closed  # nothing left open


async def test_a_busy_zmq_bind_endpoint_is_a_startup_error(ctx: zmq.asyncio.Context) -> None:
    busy = ctx.socket(zmq.PUB)
    busy.setsockopt(zmq.LINGER, 0)
    port = busy.bind_to_random_port("tcp://127.0.0.1")
    try:
        endpoint = f"tcp://127.0.0.1:{port}"
        app = ListenerApp(config(sources=(source(endpoint, zmq_mode="bind"),)))
        with pytest.raises(StartupError, match=re.escape(f"source e1: {endpoint}: Address already in use")):
            await app.start()
        src = app.sources["e1"]
        assert app.port is None and isinstance(src, ZmqEventSource) and src.ctx.closed
    finally:
        busy.close(linger=0)


async def test_a_crashed_supervised_task_makes_the_listener_not_ready() -> None:
    app = ListenerApp(config())

    def broken() -> None:
        raise RuntimeError("gauge bug")

    app.live.update_gauges = broken  # type: ignore[method-assign]
    await app.start()
    try:
        await async_wait_until(lambda: not app.healthy, what="the gauges task's crash")
        status, body = await readyz(app)
        assert status == 503 and "gauges" in body["reason"] and "gauge bug" in body["reason"]
        health = app.health()
        assert health["status"] == "task_failed" and "gauges" in health["failed_tasks"]  # type: ignore[operator]
    finally:
        await app.stop()


async def test_a_source_not_connected_past_the_grace_is_degraded() -> None:
    app = ListenerApp(config(connect_grace_seconds=0.0))
    await app.start()
    try:
        health = await async_wait_until(lambda: (h := app.health())["status"] == "degraded" and h)
        assert health["degraded_sources"] == ["e1"]
        entry = health["sources"]["e1"]
        assert entry["state"] == "connecting" and entry["pod_ready"] is True and entry["tracked_blocks"] == 0
        assert "discovery" not in health and app.readiness() == (True, "ready")  # degraded is not unready
    finally:
        await app.stop()
