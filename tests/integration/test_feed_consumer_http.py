"""Regression (issue 7): text the listener sends (a close reason, a clear reason, a bad key) was logged
raw, so a newline in it forged a log line. Every such field is now escaped."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import pytest
from aiohttp import web

from picker.config import EventSourceConfig
from picker.kv.feed_consumer import KvFeedConsumer
from picker.kv.index import InMemoryKvIndex
from tests.support.http_server import serve

FORGED = "ts=2026-01-01 level=ERROR logger=kv_epp.admin event=forged"


async def until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def test_peer_text_cannot_forge_a_log_line(caplog: pytest.LogCaptureFixture) -> None:
    release = asyncio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if request.headers.get("Last-Event-ID") is None:
            await resp.write(f'id: 1\nevent: clear\ndata: {{"reason":"restart\\n{FORGED}"}}\n\n'.encode())
            await resp.write(f'id: 2\nevent: put\ndata: {{"keys":["zz\\n{FORGED}"],"tier":"gpu_hot"}}\n\n'.encode())
            await resp.write(f'event: close\ndata: {{"reason":"bye\\r\\n{FORGED}"}}\n\n'.encode())
        else:
            await release.wait()
        return resp

    caplog.set_level(logging.INFO, logger="kv_epp")
    async with serve([web.get("/events/e1", handler)]) as url:
        src = EventSourceConfig(backend_name="e1", endpoint=f"{url}/events/e1", reconnect_interval_ms=10)
        c = KvFeedConsumer(src, InMemoryKvIndex())
        c.start()
        try:
            await until(lambda: c.stats.reconnect_count >= 1)
        finally:
            release.set()
            await c.stop()

    lines = [r.getMessage() for r in caplog.records if r.name.startswith("kv_epp")]
    events = {line.split()[0] for line in lines}
    assert {"event=backend_cleared", "event=feed_record_dropped", "event=feed_disconnected"} <= events, lines
    for line in lines:
        assert "\n" not in line and "\r" not in line, line
    # the peer's text is still there, escaped, inside the consumer's own lines
    cleared = next(line for line in lines if line.startswith("event=backend_cleared"))
    disconnected = next(line for line in lines if line.startswith("event=feed_disconnected"))
    assert "reason='restart\\nts=2026-01-01 level=ERROR" in cleared, cleared
    assert "reason='bye\\r\\nts=2026-01-01 level=ERROR" in disconnected, disconnected
