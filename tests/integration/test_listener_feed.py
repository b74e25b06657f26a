"""Listener feed → picker consumers over real HTTP: two pickers hold the same index, resume from
the last id, snapshot when the id is too old, buffer_overflow on a slow consumer, drain on stop."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest

from listener.app import ListenerApp
from listener.config import FeedConfig, ListenerConfig, SourceConfig
from listener.events import BlockRemoved, BlockStored
from picker.config import EventSourceConfig
from picker.kv.feed_consumer import KvFeedConsumer
from picker.kv.index import InMemoryKvIndex
from picker.ops.metrics import PickerMetrics
from picker.shared.block_keys import request_block_keys
from tests.support.http_server import serve
from tests.support.poll import async_wait_until

BS = 4
MODEL = "m"


@pytest.fixture
async def app() -> AsyncIterator[ListenerApp]:
    cfg = ListenerConfig(
        listen="127.0.0.1:0",
        key_block_size=BS,
        drain_deadline_seconds=2,
        feed=FeedConfig(history_size=16, subscriber_queue_size=8, max_keys_per_record=3),
        sources=(SourceConfig(backend_name="e1", model=MODEL, block_size=BS, zmq_endpoint="tcp://127.0.0.1:1"),),
    )
    a = ListenerApp(cfg)
    await a.start()
    yield a
    await a.stop()


class Chains:
    """Stores chain i (8 blocks) on the listener's tracker."""

    def __init__(self, app: ListenerApp) -> None:
        self.tracker = app.trackers["e1"]
        self.n = 0

    def store(self) -> list[int]:
        i = self.n
        self.n += 1
        toks = [i * 1000 + t for t in range(8 * BS)]
        self.tracker.apply(BlockStored(tuple(range(i * 100, i * 100 + 8)), None, toks, BS))
        return request_block_keys(toks, BS, MODEL)


def consumer(app: ListenerApp, index: InMemoryKvIndex, metrics: PickerMetrics | None = None) -> KvFeedConsumer:
    src = EventSourceConfig(
        backend_name="e1", endpoint=f"http://127.0.0.1:{app.port}/events/e1", reconnect_interval_ms=10
    )
    return KvFeedConsumer(src, index, metrics, max_backoff_s=0.05)


def holds(index: InMemoryKvIndex, keys: list[int]) -> int:
    h = index.lookup(keys).get("e1")
    return h.blocks if h else 0


async def test_two_consumers_same_index_resume_and_snapshot(app: ListenerApp) -> None:
    chains = Chains(app)
    first = chains.store()
    i1, i2 = InMemoryKvIndex(), InMemoryKvIndex()
    metrics = PickerMetrics()
    c1, c2 = consumer(app, i1, metrics), consumer(app, i2)
    c1.start()
    c2.start()
    try:
        await async_wait_until(lambda: holds(i1, first) == 8 and holds(i2, first) == 8)
        assert c1.stats.snapshots == 1  # no id yet: started from a snapshot
        assert metrics.registry.get_sample_value("continuum_kv_consumer_connected", {"backend": "e1"}) == 1
        second = chains.store()
        app.trackers["e1"].apply(BlockRemoved((100 + 7,)))  # chain 1 loses its last block
        await async_wait_until(lambda: holds(i1, second) == 7 and holds(i2, second) == 7)
        assert i1.entry_count == i2.entry_count == len(app.feeds["e1"].state) == 15

        # resume: disconnect, miss a few records (inside the 16-record history), reconnect
        await c1.stop()
        last = c1.last_event_id
        third = chains.store()  # 3 records (8 keys, 3 per record)
        c1.start()
        await async_wait_until(lambda: holds(i1, third) == 8)
        assert c1.stats.snapshots == 1 and c1.last_event_id == app.feeds["e1"].last_id
        assert last is not None and c1.last_event_id > last

        # too old: more records than the history holds → snapshot, same state as the other picker
        await c1.stop()
        for _ in range(8):
            chains.store()
        app.trackers["e1"].reset("restart")
        newest = chains.store()
        c1.start()
        await async_wait_until(lambda: c1.stats.snapshots == 2 and holds(i1, newest) == 8)
        await async_wait_until(lambda: holds(i2, newest) == 8 and holds(i2, first) == 0)
        assert holds(i1, first) == 0
        assert i1.entry_count == i2.entry_count == 8
    finally:
        await c1.stop()
        await c2.stop()


async def test_slow_consumer_gets_buffer_overflow(app: ListenerApp) -> None:
    chains = Chains(app)
    feed = app.feeds["e1"]
    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{app.port}/events/e1") as resp:
        await async_wait_until(lambda: len(feed.subscribers) == 1)
        for _ in range(10):  # 30 records at once: more than the 8-record subscriber queue
            chains.store()
        body = await resp.text()
    assert 'event: close\ndata: {"reason":"buffer_overflow"}' in body
    assert app.metrics.registry.get_sample_value("kv_listener_feed_overflows_total", {"backend": "e1"}) == 1


async def test_oversize_record_drops_connection_and_resumes() -> None:
    """A record over 1 MiB is dropped; the consumer reconnects and resumes from its last id."""
    from aiohttp import web

    big = "data: " + "x" * (1 << 20) + "\n\n"
    served: list[str | None] = []
    done = asyncio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        served.append(request.headers.get("Last-Event-ID"))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if len(served) == 1:
            await resp.write(b'id: 7\nevent: put\ndata: {"keys":["00000000000000aa"],"tier":"gpu_hot"}\n\n')
            await resp.write(b"event: put\n" + big.encode())
        else:
            await resp.write(b'id: 8\nevent: put\ndata: {"keys":["00000000000000bb"],"tier":"gpu_hot"}\n\n')
            await done.wait()
        return resp

    async with serve([web.get("/events/e1", handler)]) as url:
        idx = InMemoryKvIndex()
        c = KvFeedConsumer(
            EventSourceConfig(backend_name="e1", endpoint=f"{url}/events/e1", reconnect_interval_ms=10), idx
        )
        c.start()
        try:
            await async_wait_until(lambda: c.last_event_id == 8)
            assert served == [None, "7"]
            assert c.stats.events_dropped == 1 and c.stats.reconnect_count >= 1
            assert idx.lookup([0xAA]) and idx.lookup([0xBB])
        finally:
            done.set()
            await c.stop()


async def test_drain_tells_consumers(app: ListenerApp) -> None:
    Chains(app).store()
    idx = InMemoryKvIndex()
    c = consumer(app, idx)
    c.start()
    try:
        await async_wait_until(lambda: idx.entry_count == 8)
        await app.stop()
        await async_wait_until(lambda: c.stats.closes.get("draining", 0) == 1)
    finally:
        await c.stop()


async def test_hostile_records_are_dropped_and_a_silent_peer_is_left() -> None:
    """Found in review: a deeply nested record used to kill the consumer task (RecursionError), a
    4,000-digit key became a huge int in the index, and a peer that stops talking hung the consumer."""
    from aiohttp import web

    served: list[str | None] = []
    release = asyncio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        served.append(request.headers.get("Last-Event-ID"))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if len(served) == 1:
            deep = "[" * 5000 + "]" * 5000
            await resp.write(f'id: 1\nevent: put\ndata: {{"keys":{deep},"tier":"gpu_hot"}}\n\n'.encode())
            await resp.write(f'id: 2\nevent: put\ndata: {{"keys":["{"f" * 4000}"],"tier":"gpu_hot"}}\n\n'.encode())
            await resp.write(b'id: 3\nevent: put\ndata: {"keys":["00000000000000aa"],"tier":"gpu_hot"}\n\n')
            await release.wait()  # then silence: no keepalive, no close
        else:
            await resp.write(b'id: 4\nevent: put\ndata: {"keys":["00000000000000bb"],"tier":"gpu_hot"}\n\n')
            await release.wait()
        return resp

    async with serve([web.get("/events/e1", handler)]) as url:
        idx = InMemoryKvIndex()
        src = EventSourceConfig(
            backend_name="e1", endpoint=f"{url}/events/e1", reconnect_interval_ms=10, read_timeout_ms=300
        )
        c = KvFeedConsumer(src, idx)
        c.start()
        try:
            await async_wait_until(lambda: c.last_event_id == 4)  # reconnected after the silent peer's read timeout
            assert served == [None, "3"]
            assert c.stats.events_dropped == 2
            assert idx.lookup([0xAA]) and idx.lookup([0xBB]) and idx.prefix_count == 2
            assert c._task is not None and not c._task.done()
        finally:
            release.set()
            await c.stop()


async def test_entries_dropped_by_the_index_come_back_by_a_snapshot(app: ListenerApp) -> None:
    """Issue 8: the index may drop a backend's entries without the feed saying so (an admin clear, the
    expiry of a feed that went silent). Resuming from the last id would then never bring them back: the
    consumer must resubscribe for a snapshot. Before: the index stayed empty for that backend."""
    chains = Chains(app)
    first = chains.store()
    index = InMemoryKvIndex()
    c = consumer(app, index)
    c.start()
    try:
        await async_wait_until(lambda: holds(index, first) == 8)
        index.clear()  # POST /admin/kv-index/clear while the feed is connected (the admin also interrupts)
        c.interrupt()
        assert holds(index, first) == 0
        await async_wait_until(lambda: holds(index, first) == 8, what="a snapshot after the admin clear")
        assert c.stats.snapshots == 2

        await c.stop()  # the feed goes silent for longer than the ttl: the backend expires as a whole
        assert index.sweep_expired(now=time.monotonic() + index.ttl + 1) == 8  # as if ttl seconds passed
        assert index.lookup(first) == {} and index.expirations("e1") == 2
        second = chains.store()
        c.start()  # back: a snapshot (both chains), not a resume (which would bring only the second)
        await async_wait_until(lambda: holds(index, first) == 8 and holds(index, second) == 8)
        assert c.stats.snapshots == 3
    finally:
        await c.stop()
