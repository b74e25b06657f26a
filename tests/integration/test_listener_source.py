"""listener.source: both sources keep the EventSource contract the app relies on: ``open`` raises
SourceOpenError (and leaves nothing open), ``close`` is idempotent, ``backlog_bytes`` and ``persistence`` say what
the source keeps, ``status`` has the fields /healthz reads; and a source the app has never seen (a fake here,
the gRPC source later) is run, counted and reported through the Protocol alone.

Here the tests that start a server or bind a socket; the rest, in process:
tests/unit/listener/test_source.py."""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from listener.app import ListenerApp
from listener.config import ListenerConfig, SourceConfig
from listener.source import EventSource, SourceOpenError
from listener.state_store import PersistedSource
from tests.support.listener_zmq_source import MODEL, zmq_source


def test_a_zmq_source_that_cannot_bind_raises_source_open_error_and_keeps_nothing_open(
    ctx: zmq.asyncio.Context,
) -> None:
    busy = ctx.socket(zmq.PUB)
    busy.setsockopt(zmq.LINGER, 0)
    port = busy.bind_to_random_port("tcp://127.0.0.1")
    try:
        src: EventSource = zmq_source(ctx, f"tcp://127.0.0.1:{port}", mode="bind")
        with pytest.raises(SourceOpenError, match="in use"):
            src.open()
        assert src.connected is False and src.backlog_bytes == 0
        src.close()
        src.close()  # idempotent
    finally:
        busy.close(linger=0)


class FakeSource:
    """An EventSource the app has no code for: it runs until cancelled and says it is connected."""

    def __init__(self, cfg: SourceConfig) -> None:
        self.cfg = cfg
        self.name = cfg.backend_name
        self.endpoint = "fake://engine"
        self.connected = True
        self.backlog_bytes: int | None = 123
        self.opened = self.closed = 0
        self.running = asyncio.Event()

    def open(self) -> None:
        self.opened += 1

    def close(self) -> None:
        self.closed += 1

    async def run(self) -> None:
        self.running.set()
        await asyncio.Event().wait()

    def status(self, stale_after: float) -> dict[str, object]:
        return {"state": "connected", "connected": True, "state_age_seconds": 0.5, "fake": True}

    def persistence(self) -> PersistedSource | None:
        return None


async def test_the_app_runs_any_event_source_through_the_protocol() -> None:
    cfg = ListenerConfig(
        listen="127.0.0.1:0",
        sources=(SourceConfig(backend_name="f1", engine="trtllm", model=MODEL, http_endpoint="http://x:1"),),
    )
    app = ListenerApp(cfg)
    fake = FakeSource(cfg.sources[0])
    app.live.sources["f1"] = fake  # what a new kind of source would be: the app knows only the Protocol
    await app.start()
    try:
        await asyncio.wait_for(fake.running.wait(), 10)
        assert fake.opened == 1
        app.live.update_gauges()
        backlog = app.metrics.registry.get_sample_value("kv_listener_backlog_bytes", {"source": "f1"})
        assert backlog == 123
        health = app.health()
        assert health["status"] == "ok"
        assert health["sources"]["f1"]["fake"] is True  # type: ignore[index]
    finally:
        await app.stop()
    assert fake.closed >= 1
