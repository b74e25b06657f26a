"""ZMQ sources over real sockets: encodings, removals, replay (all reply layouts), restart, clears,
allowed publishers, topic filter and hostile payloads. Publishers are tiny XPUB sockets (the XPUB's
subscription message tells us the listener is connected, so no sleeps are needed)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio
from aiohttp import ClientSession

from listener.app import ListenerApp
from listener.config import LimitsConfig, ListenerConfig, SourceConfig
from listener.metrics import ListenerMetrics
from listener.zmq_receiver import ZmqReceiver
from picker.shared.block_keys import request_block_keys
from tests.support.poll import async_wait_until

BS = 4
MODEL = "m"
TOKENS = list(range(1000, 1032))  # 8 blocks


def seq8(n: int) -> bytes:
    return n.to_bytes(8, "big")


def stored(hashes: list[int], parent: int | None, tokens: list[int], as_map: bool = False) -> Any:
    if as_map:
        return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
                "token_ids": tokens, "block_size": BS, "medium": "GPU"}  # fmt: skip
    return ["BlockStored", hashes, parent, tokens, BS, None, "GPU", None]


def batch(*events: Any) -> bytes:
    return msgpack.packb([0.0, list(events), 0])


def keys(n_blocks: int) -> list[int]:
    return request_block_keys(TOKENS[: n_blocks * BS], BS, MODEL)


class Pub:
    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self.sock = ctx.socket(zmq.XPUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{self.port}"

    async def subscribed(self) -> None:
        async with asyncio.timeout(10):
            msg = await self.sock.recv()
        assert msg[:1] == b"\x01"

    async def send(self, seq: int, payload: bytes, topic: bytes = b"") -> None:
        await self.sock.send_multipart([topic, seq8(seq), payload])


class ReplayServer:
    """A ROUTER answering replay requests from a dict of seq → payload, in a chosen reply layout."""

    def __init__(self, ctx: zmq.asyncio.Context, layout: str) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.layout = layout
        self.buffer: dict[int, bytes] = {}
        self.requests: list[int] = []
        self.task = asyncio.create_task(self._serve())

    def _frames(self, ident: bytes, seq: bytes, payload: bytes) -> list[bytes]:
        return {
            "seq_payload": [ident, b"", seq, payload],
            "topic_seq_payload": [ident, b"", b"kv", seq, payload],
            "nodelim_seq_payload": [ident, seq, payload],
            "nodelim_topic_seq_payload": [ident, b"kv", seq, payload],
        }[self.layout]

    async def _serve(self) -> None:
        while True:
            frames = await self.sock.recv_multipart()
            ident, start = frames[0], int.from_bytes(frames[-1], "big")
            self.requests.append(start)
            for s in sorted(self.buffer):
                if s >= start:
                    await self.sock.send_multipart(self._frames(ident, seq8(s), self.buffer[s]))
            await self.sock.send_multipart(self._frames(ident, b"\xff" * 8, b""))

    async def close(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        self.sock.close(linger=0)


@contextlib.asynccontextmanager
async def running(pub: Pub, **src: Any) -> AsyncIterator[ListenerApp]:
    limits = src.pop("limits", LimitsConfig())
    cfg = ListenerConfig(
        listen="127.0.0.1:0",
        key_block_size=BS,
        limits=limits,
        sources=(SourceConfig(backend_name="e1", model=MODEL, block_size=BS, zmq_endpoint=pub.endpoint, **src),),
    )
    app = ListenerApp(cfg)
    await app.start()
    try:
        await pub.subscribed()
        yield app
    finally:
        await app.stop()


def sample(app: ListenerApp, name: str, **labels: str) -> float:
    v = app.metrics.registry.get_sample_value(name, {"source": "e1", **labels})
    return v or 0.0


async def test_both_encodings_multiblock_and_removal(ctx: zmq.asyncio.Context) -> None:
    pub = Pub(ctx)
    async with running(pub) as app:
        feed = app.feeds["e1"]
        await pub.send(0, batch(stored([1, 2, 3], None, TOKENS[:12])))
        await pub.send(1, batch(stored([4, 5], 3, TOKENS[12:20], as_map=True)))
        await async_wait_until(lambda: len(feed.state) == 5)
        assert set(feed.state) == set(keys(5))
        await pub.send(2, msgpack.packb({"ts": 1, "events": [{"type": "BlockRemoved", "block_hashes": [5, 4]}]}))
        await async_wait_until(lambda: len(feed.state) == 3)
        assert set(feed.state) == set(keys(3))
        assert sample(app, "kv_listener_events_processed_total") == 3


@pytest.mark.parametrize(
    "layout", ["seq_payload", "topic_seq_payload", "nodelim_seq_payload", "nodelim_topic_seq_payload"]
)
async def test_gap_is_replayed(ctx: zmq.asyncio.Context, layout: str) -> None:
    pub = Pub(ctx)
    replay = ReplayServer(ctx, layout)
    msgs = {
        0: batch(stored([1, 2], None, TOKENS[:8])),
        1: batch(stored([3], 2, TOKENS[8:12])),
        2: batch(stored([4], 3, TOKENS[12:16], as_map=True)),
        3: batch(stored([5], 4, TOKENS[16:20])),
    }
    replay.buffer = dict(msgs)
    try:
        async with running(pub, replay_endpoint=replay.endpoint) as app:
            feed = app.feeds["e1"]
            await pub.send(0, msgs[0])
            await pub.send(3, msgs[3])  # 1 and 2 are lost on the SUB path
            await async_wait_until(lambda: len(feed.state) == 5)
            assert set(feed.state) == set(keys(5))
            assert replay.requests == [0]  # from the last applied seq: its digest proves the incarnation
            assert sample(app, "kv_listener_sequence_gaps_total") == 1
            assert sample(app, "kv_listener_replays_total", result="ok") == 1
            assert sample(app, "kv_listener_backend_clears_total", reason="gap") == 0
    finally:
        await replay.close()


async def test_gap_without_replay_clears_the_backend(ctx: zmq.asyncio.Context) -> None:
    pub = Pub(ctx)
    async with running(pub) as app:
        feed = app.feeds["e1"]
        await pub.send(0, batch(stored([1, 2], None, TOKENS[:8])))
        await async_wait_until(lambda: len(feed.state) == 2)
        await pub.send(5, batch(stored([9], None, TOKENS[:4])))
        await async_wait_until(lambda: sample(app, "kv_listener_backend_clears_total", reason="gap") == 1)
        await async_wait_until(lambda: len(feed.state) == 1)
        assert set(feed.state) == set(keys(1))


async def test_restart_and_all_blocks_cleared(ctx: zmq.asyncio.Context) -> None:
    pub = Pub(ctx)
    async with running(pub) as app:
        feed = app.feeds["e1"]
        for s in range(3):
            await pub.send(s, batch(stored([10 + s], None if s == 0 else 9 + s, TOKENS[s * 4 : s * 4 + 4])))
        await async_wait_until(lambda: len(feed.state) == 3)
        await pub.send(0, batch(stored([77], None, TOKENS[:4])))  # sequence reset: engine restarted
        await async_wait_until(lambda: sample(app, "kv_listener_engine_restarts_total") == 1)
        await async_wait_until(lambda: set(feed.state) == set(keys(1)))
        assert app.trackers["e1"].tracked_blocks == 1
        await pub.send(1, batch(["AllBlocksCleared"]))
        await async_wait_until(
            lambda: sample(app, "kv_listener_backend_clears_total", reason="all_blocks_cleared") == 1
        )
        assert feed.state == {} and app.trackers["e1"].tracked_blocks == 0


async def test_allowed_publishers_by_peer_address(ctx: zmq.asyncio.Context) -> None:
    pub = Pub(ctx)
    async with running(pub, allowed_publishers=("10.9.9.9",)) as app:
        await pub.send(0, batch(stored([1], None, TOKENS[:4])))
        await async_wait_until(
            lambda: sample(app, "kv_listener_events_dropped_total", reason="publisher_not_allowed") == 1
        )
        assert app.feeds["e1"].state == {}
    pub2 = Pub(ctx)
    async with running(pub2, allowed_publishers=("127.0.0.1",)) as app:
        await pub2.send(0, batch(stored([1], None, TOKENS[:4])))
        await async_wait_until(lambda: len(app.feeds["e1"].state) == 1)


async def test_topic_filter(ctx: zmq.asyncio.Context) -> None:
    pub = Pub(ctx)
    async with running(pub, topic="kv@10.0.0.1@m") as app:
        await pub.send(0, batch(stored([1], None, TOKENS[:4])), topic=b"kv@10.0.0.2@m")
        await pub.send(0, batch(stored([2], None, TOKENS[4:8])), topic=b"kv@10.0.0.1@m")
        await async_wait_until(lambda: len(app.feeds["e1"].state) == 1)
        assert sample(app, "kv_listener_messages_received_total") == 1


async def test_hostile_payloads_are_counted_and_skipped(ctx: zmq.asyncio.Context) -> None:
    pub = Pub(ctx)
    limits = LimitsConfig(
        max_tracked_blocks=50, max_retained_tokens=100, max_event_tokens=4096, max_message_bytes=1 << 20
    )
    async with running(pub, limits=limits) as app:
        hostile = [
            b"\x93\x01\x02",  # truncated msgpack
            msgpack.packb([0.0, [["BlockStored", "x", None, "y", BS]], 0]),  # wrong types
            msgpack.packb([0.0, [["BlockStored", [1], None, [1, 2, 3, 4], 10**9]], 0]),  # billion-token block
            b"\x93\xcb" + b"\0" * 8 + b"\xdd\x3b\x9a\xca\x00",  # claims a billion events
            msgpack.packb([0.0, [["BlockStored", [1], None, list(range(100_000)), BS]], 0]),  # huge array
            msgpack.packb([0.0, [["BlockStored", list(range(10_000)), None, [], BS]], 0]),
        ]
        for i, p in enumerate(hostile):
            await pub.send(i, p)
        await pub.sock.send_multipart([b"", b"\x01\x02", b"x"])  # bad sequence frame
        await pub.sock.send_multipart([b"", seq8(99)])  # two frames
        await pub.send(len(hostile), batch(stored([7], None, TOKENS[:4])))
        await async_wait_until(lambda: len(app.feeds["e1"].state) == 1)
        dropped = {r: sample(app, "kv_listener_events_dropped_total", reason=r) for r in ("malformed", "too_large")}
        assert dropped["malformed"] >= 5 and dropped["too_large"] >= 1
        tracker = app.trackers["e1"]
        assert tracker.tracked_blocks <= limits.max_tracked_blocks
        assert tracker.retained_tokens <= limits.max_retained_tokens
        async with ClientSession() as s, s.get(f"http://127.0.0.1:{app.port}/healthz") as r:
            assert r.status == 200
            assert (await r.json())["status"] == "ok"


async def test_restart_after_only_seq_zero_is_not_a_duplicate(ctx: zmq.asyncio.Context) -> None:
    """Found end to end: an engine that had published only seq 0 restarts and publishes seq 0 again
    (AllBlocksCleared). Same seq with another payload is a restart; the very same message is a duplicate."""
    pub = Pub(ctx)
    async with running(pub) as app:
        feed = app.feeds["e1"]
        await pub.send(0, batch(stored([1, 2], None, TOKENS[:8])))
        await async_wait_until(lambda: len(feed.state) == 2)
        cleared = batch(["AllBlocksCleared"])
        await pub.send(0, cleared)
        await async_wait_until(lambda: sample(app, "kv_listener_engine_restarts_total") == 1)
        await async_wait_until(lambda: feed.state == {})
        await pub.send(0, cleared)
        await async_wait_until(lambda: sample(app, "kv_listener_events_dropped_total", reason="duplicate") == 1)
        assert sample(app, "kv_listener_engine_restarts_total") == 1


def test_an_ipv4_peer_on_a_dual_stack_socket_matches_its_ipv4_allow_entry(ctx: zmq.asyncio.Context) -> None:
    """libzmq reports an IPv4 peer of an IPv6-enabled socket as ::ffff:a.b.c.d: the allow-list's a.b.c.d admits it."""

    class Frame:
        def __init__(self, peer: str) -> None:
            self.peer = peer

        def get(self, _: str) -> str:
            return self.peer

    cfg = SourceConfig(backend_name="e1", model=MODEL, zmq_endpoint="tcp://x:1", allowed_publishers=("10.1.2.3",))
    rx = ZmqReceiver(cfg, LimitsConfig(), ListenerMetrics(), ctx)
    assert rx.peer_allowed(Frame("::ffff:10.1.2.3"))
    assert rx.peer_allowed(Frame("10.1.2.3"))
    assert not rx.peer_allowed(Frame("::ffff:10.1.2.4"))
    assert not rx.peer_allowed(Frame("fd00::10.1.2.3"))
