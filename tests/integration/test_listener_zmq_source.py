"""listener.zmq_source over real ZMQ sockets (the engines of fake_engines): encodings, removals, replay (all reply
layouts), restart, clears, allowed publishers, topic filter and hostile payloads; the keys of what vLLM and SGLang
publish; the applier's turns; incarnation checks on a reconnection; restoring persisted state.

Here the tests that start a server or bind a socket; the rest, in process:
tests/unit/listener/test_zmq_source.py."""

from __future__ import annotations

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
from picker.shared.block_keys import request_block_keys
from tests.support import fake_engines
from tests.support.fake_engines import Engine, Pub, ReplayServer, seq8
from tests.support.listener_apps import config as restart_config
from tests.support.listener_apps import record_puts, source, started
from tests.support.poll import async_wait_until
from tests.support.zmq_batches import BS, KB, MODEL, TOKENS, batch, stored


def keys(n_blocks: int) -> list[int]:
    return request_block_keys(TOKENS[: n_blocks * BS], BS, MODEL)


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


@pytest.mark.parametrize("layout", ReplayServer.LAYOUTS)
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


KTOKENS = list(range(3000, 3000 + 8 * KB))


@contextlib.asynccontextmanager
async def running_keyed(
    ctx: zmq.asyncio.Context, engine: str = "vllm", **limits: Any
) -> AsyncIterator[tuple[Pub, Any]]:
    pub = Pub(ctx)
    cfg = ListenerConfig(
        listen="127.0.0.1:0",
        limits=LimitsConfig(**limits),
        sources=(SourceConfig(backend_name="e1", engine=engine, model=MODEL, zmq_endpoint=pub.endpoint),),  # type: ignore[arg-type]
    )
    app = ListenerApp(cfg)
    await app.start()
    try:
        await pub.subscribed()
        yield pub, app
    finally:
        await app.stop()


def kstored(hashes: list[int], parent: int | None, tokens: list[int], bs: int = KB, **kw: Any) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": bs, "medium": "GPU", **kw}  # fmt: skip


def kremoved(hashes: list[int], **kw: Any) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU", **kw}


def kkeys(n_blocks: int, **kw: Any) -> set[int]:
    return set(request_block_keys(KTOKENS[: n_blocks * KB], KB, MODEL, **kw))


def kdropped(app: Any, reason: str) -> float:
    return (
        app.metrics.registry.get_sample_value("kv_listener_events_dropped_total", {"source": "e1", "reason": reason})
        or 0.0
    )


async def settle_keyed(pub: Pub, app: Any) -> None:
    """A marker chain on its own root, sent last: once its key is in the feed, everything before is applied."""
    marker = list(range(90_000, 90_000 + KB))
    h = 1_000_000 + pub.seq
    await pub.send_events(
        kstored([h], None, marker, lora_id=9, lora_name=f"marker-{pub.seq}", extra_keys=[[f"marker-{pub.seq}"]])
    )
    key = request_block_keys(marker, KB, MODEL, lora_name=f"marker-{pub.seq - 1}")[0]
    await async_wait_until(lambda: key in app.feeds["e1"].state)
    await pub.send_events(kremoved([h]))
    await async_wait_until(lambda: key not in app.feeds["e1"].state)


async def test_salt_and_lora_as_vllm_sends_them(ctx: zmq.asyncio.Context) -> None:
    async with running_keyed(ctx) as (pub, app):
        feed = app.feeds["e1"]
        await pub.send_events(kstored([1, 2], None, KTOKENS[: 2 * KB], extra_keys=[["tenant-1"], None]))
        await pub.send_events(kstored([3], 2, KTOKENS[2 * KB : 3 * KB]))
        lora = {"lora_id": 4, "lora_name": "ad"}
        await pub.send_events(
            kstored([11, 12], None, KTOKENS[: 2 * KB], extra_keys=[["ad", "tenant-1"], ["ad"]], **lora)
        )
        await pub.send_events(
            kstored([21], None, KTOKENS[:KB], extra_keys=[["mm-1"], None][:1]),
            kstored([22], 21, KTOKENS[KB : 2 * KB], extra_keys=[["mm-2"]]),
        )
        want = kkeys(3, cache_salt="tenant-1") | kkeys(2, lora_name="ad", cache_salt="tenant-1")
        want |= kkeys(1, cache_salt="mm-1")  # a lone first-block extra reads as a salt: no request has that key
        await async_wait_until(lambda: set(feed.state) == want)
        await settle_keyed(pub, app)
        assert set(feed.state) == want
        notes = app.metrics.registry.get_sample_value(
            "kv_listener_blocks_total", {"source": "e1", "reason": "multimodal"}
        )
        assert notes == 1


async def test_sglang_fields_and_page_size_one(ctx: zmq.asyncio.Context) -> None:
    async with running_keyed(ctx, engine="sglang") as (pub, app):
        feed = app.feeds["e1"]
        parent = None
        for i in range(2 * KB + 5):
            await pub.send_events(
                kstored([-(i + 1)], parent, [KTOKENS[i]], bs=1, cache_salt="t", lora_name="ad", lora_id=1)
            )
            parent = -(i + 1)
        await async_wait_until(lambda: set(feed.state) == kkeys(2, lora_name="ad", cache_salt="t"))
        await pub.send_events(kremoved([-(i + 1) for i in range(2 * KB + 4, KB - 1, -1)]))
        await async_wait_until(lambda: set(feed.state) == kkeys(1, lora_name="ad", cache_salt="t"))


async def test_groups_copies_media_and_placeholders(ctx: zmq.asyncio.Context) -> None:
    async with running_keyed(ctx) as (pub, app):
        feed = app.feeds["e1"]
        k = request_block_keys(KTOKENS[: 4 * KB], KB, MODEL)
        # vLLM block size 32: two pages, four keys; group 1 holds the same hashes
        await pub.send_events(
            kstored([1, 2], None, KTOKENS[: 4 * KB], bs=32, group_idx=0),
            kstored([1, 2], None, KTOKENS[: 4 * KB], bs=32, group_idx=1),
        )
        await async_wait_until(lambda: set(feed.state) == set(k))
        await pub.send_events(kremoved([2], group_idx=1))  # group 0 still holds it
        await pub.send_events(
            kstored([2], None, [], bs=0, medium="CPU"),
            kstored([2], 1, KTOKENS[2 * KB : 4 * KB], bs=32, medium="STORAGE"),
        )
        await pub.send_events(kremoved([2], group_idx=0))
        await async_wait_until(lambda: feed.state.get(k[3]) == "storage_warm")
        await pub.send_events(kremoved([2], medium="STORAGE"))  # still on CPU
        await settle_keyed(pub, app)
        assert feed.state == {k[0]: "gpu_hot", k[1]: "gpu_hot", k[2]: "storage_warm", k[3]: "storage_warm"}
        await pub.send_events(kremoved([2], medium="CPU"))
        await async_wait_until(lambda: set(feed.state) == set(k[:2]))


async def test_decoder_bombs_are_dropped_and_the_listener_keeps_working(ctx: zmq.asyncio.Context) -> None:
    async with running_keyed(ctx) as (pub, app):
        feed = app.feeds["e1"]
        # 3 MB of empty arrays (60 x 50,000): three million containers, each array inside every length limit
        inner = b"\xdd" + (50_000).to_bytes(4, "big") + b"\x90" * 50_000
        bomb = b"\x93\xcb" + b"\0" * 8 + b"\xdc" + (60).to_bytes(2, "big") + inner * 60 + b"\x00"
        await pub.send_raw(bomb)
        await pub.send_events(
            kremoved(list(range(1, LimitsConfig().max_event_hashes + 2)))
        )  # one event, too many hashes
        await pub.send_events(kstored([1], None, KTOKENS[:KB]))
        await async_wait_until(lambda: set(feed.state) == kkeys(1))
        assert kdropped(app, "too_large") == 2


# -- incarnation checks on a reconnection -------------------------------------------------------------------------
async def test_engine_restarted_while_disconnected_is_cleared_before_new_blocks_count(
    ctx: zmq.asyncio.Context,
) -> None:
    engine = Engine(ctx)
    try:
        app = ListenerApp(restart_config(engine, None))
        deltas = record_puts(app)
        async with started(app):
            await engine.subscribed(1)
            for i in range(10):
                await engine.publish([fake_engines.stored([1000 + i], None, fake_engines.tokens(10 + i, 1))])
            await async_wait_until(lambda: source(app).last_seq == 9 and len(app.feeds["e1"].state) == 10)
            old_keys = set(app.feeds["e1"].state)
            await engine.close()
            await async_wait_until(lambda: not source(app).connected)
            mark = len(deltas)
            engine.seq, engine.buffer = 0, {}
            await engine.open_replay()
            new_tokens = [fake_engines.tokens(50 + i, 1) for i in range(16)]
            for i in range(15):  # the new incarnation publishes past the old last seq before we reconnect
                await engine.publish([fake_engines.stored([2000 + i], None, new_tokens[i])])
            await engine.open_pub()
            await engine.subscribed(1)
            last = await engine.publish([fake_engines.stored([2015], None, new_tokens[15])])
            await async_wait_until(lambda: source(app).last_seq == last)
            expected = {k for t in new_tokens for k in request_block_keys(t, fake_engines.PAGE, MODEL)}
            assert set(app.feeds["e1"].state) == expected
            after = deltas[mark:]
            clear_at = next(i for i, (op, _) in enumerate(after) if op == "clear")
            first_put = next(i for i, (op, _) in enumerate(after) if op == "put")
            assert clear_at < first_put, "new blocks counted before the old incarnation was cleared"
            assert not {k for op, ks in after if op == "put" for k in ks} & old_keys
            assert source(app).incarnation_checks["restart"] == 1
    finally:
        await engine.close()
