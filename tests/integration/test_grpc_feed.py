"""The listener's gRPC feed (kvfeed.v1.KvFeed) → picker gRPC consumers over real sockets: identical
indexes on two pickers across a listener restart, resume, snapshot on a gap, TLS and the bearer token,
the subscriber cap, a hello with the wrong key block size, /healthz under non-reading subscribers."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import grpc
import pytest

from listener.app import ListenerApp
from listener.config import FeedConfig, GrpcFeedConfig, ListenerConfig, SourceConfig
from listener.events import BlockRemoved, BlockStored
from picker.config import EventSourceConfig
from picker.kv.feed_consumers import make_consumer
from picker.kv.grpc_feed_consumer import GrpcFeedConsumer
from picker.kv.index import InMemoryKvIndex
from picker.shared.feed_records import GRPC_SUBSCRIBE
from picker.shared.kvfeed_pb import feed_pb2 as pb
from tests.support.certs import TestCA
from tests.support.poll import async_wait_until

BS = 4
MODEL = "m"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listener_cfg(grpc_port: int = 0, feed: FeedConfig | None = None, **grpc_kw: str) -> ListenerConfig:
    return ListenerConfig(
        listen="127.0.0.1:0",
        key_block_size=BS,
        drain_deadline_seconds=2,
        feed=feed or FeedConfig(history_size=16, subscriber_queue_size=64, max_keys_per_record=3),
        grpc=GrpcFeedConfig(listen=f"127.0.0.1:{grpc_port}", **grpc_kw),
        sources=(SourceConfig(backend_name="e1", model=MODEL, block_size=BS, zmq_endpoint="tcp://127.0.0.1:1"),),
    )


@pytest.fixture
async def app() -> AsyncIterator[ListenerApp]:
    a = ListenerApp(listener_cfg())
    await a.start()
    yield a
    await a.stop()


class Chains:
    """Stores chain i (8 blocks) on the listener's tracker."""

    def __init__(self, app: ListenerApp, start: int = 0) -> None:
        self.tracker = app.trackers["e1"]
        self.feed = app.feeds["e1"]
        self.n = start
        self.keys: set[int] = set()

    def store(self) -> list[int]:
        i = self.n
        self.n += 1
        toks = [i * 1000 + t for t in range(8 * BS)]
        self.tracker.apply(BlockStored(tuple(range(i * 100, i * 100 + 8)), None, toks, BS))
        self.keys.update(self.feed.state)  # every key the listener ever held
        return toks


def grpc_consumer(
    port: int, index: InMemoryKvIndex, scheme: str = "grpc", key_block_size: int | None = BS, **kw: object
) -> GrpcFeedConsumer:
    src = EventSourceConfig(backend_name="e1", endpoint=f"{scheme}://127.0.0.1:{port}", reconnect_interval_ms=10, **kw)
    c = make_consumer(src, index, key_block_size=key_block_size)
    assert isinstance(c, GrpcFeedConsumer)
    c.max_backoff_s = 0.05
    return c


def held(index: InMemoryKvIndex, keys: set[int]) -> set[int]:
    return {k for k in keys if index.lookup([k]).get("e1")}


async def test_two_grpc_consumers_hold_identical_indexes_across_a_listener_restart(app: ListenerApp) -> None:
    assert app.grpc is not None and app.grpc.port
    port = app.grpc.port
    chains = Chains(app)
    chains.store()
    i1, i2 = InMemoryKvIndex(), InMemoryKvIndex()
    c1, c2 = grpc_consumer(port, i1), grpc_consumer(port, i2)
    c1.start()
    c2.start()
    app2: ListenerApp | None = None
    try:
        feed = app.feeds["e1"]
        for round_ in range(20):  # many records: puts, removals, a clear
            chains.store()
            if round_ % 3 == 0:
                app.trackers["e1"].apply(BlockRemoved((round_ * 100 + 7,)))
            if round_ == 10:
                app.trackers["e1"].reset("restart")
        await async_wait_until(lambda: c1.last_event_id == c2.last_event_id == feed.last_id)
        want = set(feed.state)
        assert held(i1, chains.keys) == held(i2, chains.keys) == want
        assert i1.entry_count == i2.entry_count == len(want)
        assert c1.stats.source_model == MODEL and c1.stats.key_block_size == BS and c1.stats.connected

        # resume: c1 misses a few records (inside the 16-record history) and resumes from its id
        await c1.stop()
        chains.store()
        c1.start()
        await async_wait_until(lambda: c1.last_event_id == feed.last_id)
        assert c1.stats.snapshots == 1

        # a gap: more records than the history holds → snapshot
        await c1.stop()
        gone = c1.last_event_id
        assert gone is not None
        while feed.last_id - gone <= 16:  # more records than the history holds
            chains.store()
        c1.start()
        await async_wait_until(lambda: c1.stats.snapshots == 2 and c1.last_event_id == feed.last_id)
        assert held(i1, chains.keys) == set(feed.state)

        # the listener restarts on the same port (new base id, new state): both pickers snapshot
        await app.stop()
        app2 = ListenerApp(listener_cfg(port))
        await app2.start()
        chains2 = Chains(app2, start=100)
        chains2.store()
        feed2 = app2.feeds["e1"]
        await async_wait_until(lambda: c1.last_event_id == c2.last_event_id == feed2.last_id, timeout=20)
        everything = chains.keys | chains2.keys
        assert held(i1, everything) == held(i2, everything) == set(feed2.state) == chains2.keys
        assert c2.stats.snapshots == 2 and c2.stats.closes.get("draining") == 1
    finally:
        await c1.stop()
        await c2.stop()
        if app2 is not None:
            await app2.stop()


async def test_tls_and_bearer_token(tmp_path: Path) -> None:
    ca = TestCA()
    leaf = ca.issue("localhost")
    (tmp_path / "tls.crt").write_bytes(leaf.cert_pem)
    (tmp_path / "tls.key").write_bytes(leaf.key_pem)
    ca_file = ca.write_ca(tmp_path / "ca.pem")
    (tmp_path / "token").write_text("s3cret\n")
    (tmp_path / "wrong").write_text("nope\n")
    cfg = listener_cfg(
        tls_cert_file=str(tmp_path / "tls.crt"),
        tls_key_file=str(tmp_path / "tls.key"),
        token_file=str(tmp_path / "token"),
    )
    app = ListenerApp(cfg)
    await app.start()
    assert app.grpc is not None and app.grpc.port
    Chains(app).store()
    good_idx, bad_idx, plain_idx = InMemoryKvIndex(), InMemoryKvIndex(), InMemoryKvIndex()
    good = grpc_consumer(app.grpc.port, good_idx, "grpcs", ca_file=str(ca_file), token_file=str(tmp_path / "token"))
    bad = grpc_consumer(app.grpc.port, bad_idx, "grpcs", ca_file=str(ca_file), token_file=str(tmp_path / "wrong"))
    plain = grpc_consumer(app.grpc.port, plain_idx, "grpcs", ca_file=str(ca_file))
    for c in (good, bad, plain):
        c.start()
    try:
        want = len(app.feeds["e1"].state)
        assert want > 0
        await async_wait_until(lambda: good_idx.entry_count == want)
        await async_wait_until(lambda: bad.stats.closes.get("UNAUTHENTICATED", 0) >= 1)
        await async_wait_until(lambda: plain.stats.closes.get("UNAUTHENTICATED", 0) >= 1)
        assert bad_idx.entry_count == plain_idx.entry_count == 0
    finally:
        for c in (good, bad, plain):
            await c.stop()
        await app.stop()


async def test_subscriber_cap_refuses_the_next_one_on_both_transports() -> None:
    feed_cfg = FeedConfig(history_size=16, max_subscribers_per_backend=2, max_keys_per_record=3)
    app = ListenerApp(listener_cfg(feed=feed_cfg))
    await app.start()
    assert app.grpc is not None
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc.port}")
    subscribe = channel.unary_stream(
        GRPC_SUBSCRIBE,
        request_serializer=pb.SubscribeRequest.SerializeToString,
        response_deserializer=pb.FeedRecord.FromString,
    )
    calls = []
    try:
        for _ in range(2):
            call = subscribe(pb.SubscribeRequest(backend="e1"))
            first = await call.read()
            assert first.WhichOneof("body") == "hello" and first.hello.key_block_size == BS
            calls.append(call)
        assert len(app.feeds["e1"].subscribers) == 2
        third = subscribe(pb.SubscribeRequest(backend="e1"))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await third.read()
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{app.port}/events/e1") as resp:
            assert resp.status == 503
        unknown = subscribe(pb.SubscribeRequest(backend="nope"))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await unknown.read()
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        calls[0].cancel()
        await async_wait_until(lambda: len(app.feeds["e1"].subscribers) == 1)
        again = subscribe(pb.SubscribeRequest(backend="e1"))
        assert (await again.read()).WhichOneof("body") == "hello"
        calls.append(again)
    finally:
        for c in calls:
            c.cancel()
        await channel.close()
        await app.stop()


async def test_a_wrong_key_block_size_closes_the_stream(app: ListenerApp) -> None:
    assert app.grpc is not None and app.grpc.port
    Chains(app).store()
    idx = InMemoryKvIndex()
    c = grpc_consumer(app.grpc.port, idx, key_block_size=BS * 4)
    c.start()
    try:
        await async_wait_until(lambda: c.stats.closes.get("key_block_size_mismatch", 0) >= 1)
        assert idx.entry_count == 0 and c.stats.key_block_size == BS
    finally:
        await c.stop()


async def test_healthz_answers_while_many_subscribers_never_read() -> None:
    """Subscribers that connect and never read (SSE over raw sockets, gRPC streams never read) against a
    backend with many keys: /healthz answers while they are connected, and they share one snapshot."""
    feed_cfg = FeedConfig(max_keys_per_record=512, write_timeout_seconds=30)
    app = ListenerApp(listener_cfg(feed=feed_cfg))
    await app.start()
    assert app.grpc is not None
    feed = app.feeds["e1"]
    feed.emit("put", list(range(1, 50_001)), "gpu_hot")
    writers: list[asyncio.StreamWriter] = []
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc.port}")
    subscribe = channel.unary_stream(
        GRPC_SUBSCRIBE, request_serializer=pb.SubscribeRequest.SerializeToString, response_deserializer=bytes
    )
    calls = []
    try:
        for _ in range(20):
            _, w = await asyncio.open_connection("127.0.0.1", app.port)
            w.write(b"GET /events/e1 HTTP/1.1\r\nHost: x\r\n\r\n")
            await w.drain()
            writers.append(w)
        calls = [subscribe(pb.SubscribeRequest(backend="e1")) for _ in range(20)]
        await async_wait_until(lambda: len(feed.subscribers) == 40, timeout=30)
        async with aiohttp.ClientSession() as s:
            for _ in range(5):
                async with s.get(f"http://127.0.0.1:{app.port}/healthz") as resp:
                    body = await resp.json()
                    assert resp.status == 200 and body["sources"]["e1"]["subscribers"] == 40
        assert feed.snapshots_built == 1  # one state copy shared by all 40
    finally:
        for c in calls:
            c.cancel()
        for w in writers:
            w.close()
        await channel.close()
        await app.stop()


async def test_subscribers_that_never_read_are_dropped_at_the_write_deadline() -> None:
    feed_cfg = FeedConfig(max_keys_per_record=512, write_timeout_seconds=0.5, keepalive_seconds=0.2)
    app = ListenerApp(listener_cfg(feed=feed_cfg))
    await app.start()
    assert app.grpc is not None
    feed = app.feeds["e1"]
    feed.emit("put", list(range(1, 200_001)), "gpu_hot")  # ~1.6 MB per snapshot: more than any buffer
    # no BDP probing: the client's HTTP/2 window stays at 64 KiB, so a stream that is never read blocks the
    # listener's writes (with it the client library would take the whole snapshot into its own memory)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc.port}", options=[("grpc.http2.bdp_probe", 0)])
    subscribe = channel.unary_stream(
        GRPC_SUBSCRIBE, request_serializer=pb.SubscribeRequest.SerializeToString, response_deserializer=bytes
    )
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    calls = []
    try:
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", app.port))
        sock.send(b"GET /events/e1 HTTP/1.1\r\nHost: x\r\n\r\n")
        calls = [subscribe(pb.SubscribeRequest(backend="e1")) for _ in range(3)]
        await async_wait_until(lambda: len(feed.subscribers) == 4)
        await async_wait_until(lambda: not feed.subscribers, timeout=30)  # each write waited 0.5 s at most
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{app.port}/healthz") as resp:
            assert resp.status == 200
    finally:
        sock.close()
        for c in calls:
            c.cancel()
        await channel.close()
        await app.stop()


async def test_list_backends_and_a_busy_grpc_port(app: ListenerApp) -> None:
    from listener.app import StartupError

    assert app.grpc is not None and app.grpc.port
    Chains(app).store()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc.port}")
    try:
        list_backends = channel.unary_unary(
            "/kvfeed.v1.KvFeed/ListBackends",
            request_serializer=pb.ListBackendsRequest.SerializeToString,
            response_deserializer=pb.ListBackendsResponse.FromString,
        )
        answer = await list_backends(pb.ListBackendsRequest())
        (info,) = answer.backends
        assert (info.backend, info.model, info.engine, info.key_block_size) == ("e1", MODEL, "vllm", BS)
        assert info.entries == len(app.feeds["e1"].state) > 0 and info.last_id == app.feeds["e1"].last_id
    finally:
        await channel.close()
    other = ListenerApp(listener_cfg(app.grpc.port))
    with pytest.raises(StartupError, match=r"grpc\.listen"):
        await other.start()
    await other.stop()


async def test_the_ready_line_names_the_grpc_port(app: ListenerApp) -> None:
    assert app.grpc is not None
    assert app.ready_line() == f"kv-listener ready listen=127.0.0.1:{app.port} grpc=127.0.0.1:{app.grpc.port}"
