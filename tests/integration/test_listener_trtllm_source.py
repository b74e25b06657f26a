"""listener.trtllm_source: the poller against a small aiohttp server serving POST /kv_cache_events (ids, gaps,
restarts, bad bodies, the allow-list, a response over the bound) and the decoder of its JSON events.

Here the tests that start a server or bind a socket; the rest, in process:
tests/unit/listener/test_trtllm_source.py."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from listener.trtllm_source import TrtllmHttpSource
from picker.shared.block_keys import request_block_keys
from tests.support.http_server import serve
from tests.support.trtllm_events import BS, TOK, blk, make


@pytest.fixture
async def server() -> AsyncIterator[tuple[str, list[Any]]]:
    queue: list[Any] = []

    async def handler(request: web.Request) -> web.Response:
        body = queue.pop(0) if queue else []
        return web.Response(body=body if isinstance(body, bytes) else json.dumps(body).encode())

    async with serve([web.post("/kv_cache_events", handler)]) as url:
        yield url, queue


async def test_trtllm_events(server: tuple[str, list[Any]]) -> None:
    url, queue = server
    app, src = make(url)
    feed = app.feeds["t1"]
    keys = request_block_keys(TOK, BS, "m")
    queue.extend(
        [
            [
                {"event_id": 0, "data": {"type": "created", "num_blocks_per_cache_level": [10, 0]}},
                {
                    "event_id": 1,
                    "data": {"type": "stored", "parent_hash": None, "blocks": [blk(1, TOK[:4]), blk(2, TOK[4:8])]},
                },
            ],
            [
                {"event_id": 1, "data": {"type": "stored", "parent_hash": None, "blocks": [blk(9, TOK[:4])]}},  # dup
                {"event_id": 2, "data": {"type": "stored", "parent_hash": 2, "blocks": [blk(3, TOK[8:12], level=1)]}},
                {"event_id": 3, "data": {"type": "updated", "block_hash": 3}},
                {"event_id": 4, "data": {"type": "removed", "block_hashes": [2]}},
                {"event_id": 5, "data": {"type": "stored", "blocks": "nope"}},
            ],
            b"{not json",
            [{"event_id": 9, "data": {"type": "stored", "parent_hash": None, "blocks": [blk(5, TOK[:4])]}}],  # gap
            [{"event_id": 0, "data": {"type": "created"}}],  # restart
        ]
    )
    async with aiohttp.ClientSession() as s:
        await src.poll_once(s)
        assert feed.state == {keys[0]: "gpu_hot", keys[1]: "gpu_hot"}
        await src.poll_once(s)
        assert feed.state == {keys[0]: "gpu_hot", keys[2]: "storage_warm"}
        await src.poll_once(s)  # malformed body: counted, state kept
        assert len(feed.state) == 2
        await src.poll_once(s)
        assert feed.state == {keys[0]: "gpu_hot"}  # the gap cleared the old state first
        await src.poll_once(s)
        assert feed.state == {}
    m = app.metrics.registry

    def v(name: str, **lab: str) -> float:
        return m.get_sample_value(name, {"source": "t1", **lab}) or 0.0

    assert v("kv_listener_events_dropped_total", reason="duplicate") == 1
    assert v("kv_listener_events_dropped_total", reason="malformed") == 2
    assert v("kv_listener_sequence_gaps_total") == 1
    assert v("kv_listener_engine_restarts_total") == 1


async def test_trtllm_host_not_allowed(server: tuple[str, list[Any]]) -> None:
    url, _ = server
    _app, src = make(url, allowed_publishers=("10.1.1.1",))
    await src.run()  # returns at once: never polls a host outside the allow-list
    assert not src.connected


async def test_a_response_over_the_bound_clears_and_a_failed_poll_disconnects(server: tuple[str, list[Any]]) -> None:
    url, queue = server
    app, src = make(url)
    src.max_response_bytes = 2048
    queue.extend(
        [
            [{"event_id": 0, "data": {"type": "stored", "parent_hash": None, "blocks": [blk(1, TOK[:4])]}}],
            [{"event_id": 1, "data": {"type": "stored", "parent_hash": 1, "blocks": [blk(2, TOK[4:8])] * 30}}],
        ]
    )
    async with aiohttp.ClientSession() as s:
        await src.poll_once(s)
        assert len(app.feeds["t1"].state) == 1 and src.connected and src.last_event_at is not None
        await src.poll_once(s)  # larger than 2 KiB: events were lost
        assert app.feeds["t1"].state == {} and src.connected
    dropped = app.metrics.registry.get_sample_value(
        "kv_listener_events_dropped_total", {"source": "t1", "reason": "too_large"}
    )
    assert dropped == 1
    down = TrtllmHttpSource(src.cfg.model_copy(update={"http_endpoint": "http://127.0.0.1:1"}), src.limits,
                            src.tracker, src.metrics)  # fmt: skip
    async with aiohttp.ClientSession() as s:
        await down.poll_once(s)  # nobody listens: only disconnected
    assert not down.connected and down.status(60)["state"] == "connecting"
