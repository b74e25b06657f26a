"""A ListenerApp's config on a fake engine (tests/support/fake_engines.py), its ZMQ source, apps started
for a block, and a spy on every delta the feed of e1 emits."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from listener.app import ListenerApp
from listener.config import ListenerConfig, SourceConfig, StateConfig
from listener.zmq_source import ZmqEventSource
from tests.support.fake_engines import PAGE, Engine

BS = PAGE
MODEL = "m"


def config(engine: Engine, state_path: Path | None, **top: Any) -> ListenerConfig:
    src = SourceConfig(
        backend_name="e1",
        model=MODEL,
        block_size=BS,
        zmq_endpoint=engine.endpoint,
        replay_endpoint=engine.replay_endpoint,
        replay_timeout_ms=10_000,
    )
    state = StateConfig(path=str(state_path), interval_seconds=0.05) if state_path else StateConfig()
    return ListenerConfig(listen="127.0.0.1:0", key_block_size=BS, sources=(src,), state=state, **top)


def source(app: ListenerApp) -> ZmqEventSource:
    src = app.sources["e1"]
    assert isinstance(src, ZmqEventSource)
    return src


@contextlib.asynccontextmanager
async def started(*apps: ListenerApp) -> AsyncIterator[None]:
    for a in apps:
        await a.start()
    try:
        yield
    finally:
        for a in apps:
            await a.stop()


def record_puts(app: ListenerApp) -> list[tuple[str, list[int]]]:
    """Every delta the feed of e1 emits, in order (("put"|"del", keys) and ("clear", []))."""
    feed = app.feeds["e1"]
    out: list[tuple[str, list[int]]] = []
    emit, clear = feed.emit, feed.clear

    def emit_spy(op: str, keys: list[int], tier: str | None, page: int = 0) -> None:
        out.append((op, list(keys)))
        emit(op, keys, tier, page)

    def clear_spy(reason: str) -> None:
        out.append(("clear", []))
        clear(reason)

    feed.emit = emit_spy  # type: ignore[method-assign]
    feed.clear = clear_spy  # type: ignore[method-assign]
    return out
