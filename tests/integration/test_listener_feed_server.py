"""listener.feed_server, in process (aiohttp's test server on loopback): an SSE subscriber gets hello, its snapshot
or its resume, live records and a close; unknown backends, draining and the subscriber caps are refused; /healthz
and /metrics answer."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from aiohttp import ClientResponse
from aiohttp.test_utils import TestClient, TestServer

from listener.config import FeedConfig
from listener.feed import BackendFeed
from listener.feed_server import build_app
from listener.metrics import ListenerMetrics
from picker.shared.feed_records import SseParser
from tests.support.poll import async_wait_until

Records = list[tuple[str, dict[str, Any], str | None]]


class Listener:
    """The HTTP app over one feed, with the switches the real app turns."""

    def __init__(self, cfg: FeedConfig | None = None) -> None:
        self.cfg = cfg or FeedConfig(max_keys_per_record=2, keepalive_seconds=60)
        self.feeds = {"e1": BackendFeed("e1", self.cfg, base_id=7 << 40, model="m", engine="vllm", key_block_size=16)}
        self.metrics = ListenerMetrics()
        self.draining = False
        self.health: dict[str, object] = {"status": "ok"}


@pytest.fixture
async def served() -> AsyncIterator[tuple[Listener, TestClient[Any, Any]]]:
    lst = Listener(FeedConfig(max_keys_per_record=2, keepalive_seconds=60, max_subscribers_per_backend=2))
    app = build_app(lst.feeds, lst.cfg, lst.metrics, lambda: lst.health, lambda: lst.draining)
    async with TestClient(TestServer(app)) as client:
        yield lst, client


async def read_until(resp: ClientResponse, parser: SseParser, done: Callable[[Records], bool]) -> Records:
    out: Records = []
    while not done(out):
        chunk = await resp.content.readany()
        if not chunk:
            break
        out.extend((event, json.loads(data) if data else {}, rid) for event, data, rid in parser.feed(chunk))
    return out


def kinds(records: Records) -> list[str]:
    return [r[0] for r in records]


async def test_snapshot_then_live_records_then_close(served: tuple[Listener, TestClient[Any, Any]]) -> None:
    lst, client = served
    feed = lst.feeds["e1"]
    feed.emit("put", [1, 2, 3], "gpu_hot", page=16)
    resp = await client.get("/events/e1")
    assert resp.status == 200 and resp.headers["Content-Type"] == "text/event-stream"
    parser = SseParser()
    start = await read_until(resp, parser, lambda r: "snapshot_end" in kinds(r))
    assert kinds(start) == ["hello", "snapshot_begin", "put", "put", "snapshot_end"]
    hello = start[0][1]
    assert hello["backend"] == "e1" and hello["model"] == "m" and hello["key_block_size"] == 16
    assert hello["resumed"] is False and hello["last_id"] == feed.last_id
    assert start[1][1] == {"last_id": feed.last_id, "entries": 3}
    subscribers = lst.metrics.registry.get_sample_value("kv_listener_feed_subscribers", {"backend": "e1"})
    assert subscribers == 1
    feed.emit("del", [2], None)
    live = await read_until(resp, parser, lambda r: bool(r))
    assert live == [("del", {"keys": [f"{2:016x}"]}, str(feed.last_id))]
    feed.close_all("draining")
    end = await read_until(resp, parser, lambda r: False)  # to the end of the stream
    assert end == [("close", {"reason": "draining"}, None)]
    await async_wait_until(
        lambda: lst.metrics.registry.get_sample_value("kv_listener_feed_subscribers", {"backend": "e1"}) == 0
    )
    assert not feed.subscribers


async def test_resume_from_a_last_event_id(served: tuple[Listener, TestClient[Any, Any]]) -> None:
    lst, client = served
    feed = lst.feeds["e1"]
    feed.emit("put", [1], "gpu_hot")
    mark = feed.last_id
    feed.emit("put", [2], "storage_warm")
    for headers, query in (({"Last-Event-ID": str(mark)}, ""), ({}, f"?last_event_id={mark}")):
        resp = await client.get("/events/e1" + query, headers=headers)
        records = await read_until(resp, SseParser(), lambda r: len(r) == 2)
        assert records[0][1]["resumed"] is True
        assert records[1] == ("put", {"keys": [f"{2:016x}"], "tier": "storage_warm"}, str(mark + 1))
        resp.close()
    resp = await client.get("/events/e1", headers={"Last-Event-ID": "not a number"})
    records = await read_until(resp, SseParser(), lambda r: len(r) == 2)
    assert records[0][1]["resumed"] is False and records[1][0] == "snapshot_begin"
    resp.close()


async def test_refusals(served: tuple[Listener, TestClient[Any, Any]]) -> None:
    lst, client = served
    assert (await client.get("/events/nope")).status == 404
    held = [await client.get("/events/e1") for _ in range(2)]  # the cap: 2 per backend
    for resp in held:
        await read_until(resp, SseParser(), lambda r: bool(r))
    over = await client.get("/events/e1")
    assert over.status == 503 and over.headers["Retry-After"] == "5"
    for resp in held:
        resp.close()
    lst.draining = True
    assert (await client.get("/events/e1")).status == 503


async def test_healthz_and_metrics(served: tuple[Listener, TestClient[Any, Any]]) -> None:
    lst, client = served
    resp = await client.get("/healthz")
    assert resp.status == 200 and await resp.json() == {"status": "ok"}
    lst.draining = True
    lst.health = {"status": "draining"}
    resp = await client.get("/healthz")
    assert resp.status == 503 and await resp.json() == {"status": "draining"}
    lst.metrics.events_processed.labels("e1").inc(3)
    text = await (await client.get("/metrics")).text()
    assert 'kv_listener_events_processed_total{source="e1"} 3.0' in text
