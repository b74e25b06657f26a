"""listener.zmq_source over real ZMQ sockets (the engines of fake_engines): encodings, removals, replay (all reply
layouts), restart, clears, allowed publishers, topic filter and hostile payloads; the keys of what vLLM and SGLang
publish; the applier's turns; incarnation checks on a reconnection; restoring persisted state."""

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
from listener.block_chains import BlockChainTracker
from listener.config import LimitsConfig, ListenerConfig, SourceConfig
from listener.metrics import ListenerMetrics
from listener.state_file import SourceState
from listener.state_log import compact
from listener.zmq_source import ZmqEventSource, fingerprint, payload_digest, restore_chunks
from picker.shared.block_keys import request_block_keys
from tests.support import fake_engines
from tests.support.fake_engines import Engine, Pub, ReplayServer, seq8
from tests.support.listener_apps import config as restart_config
from tests.support.listener_apps import record_puts, source, started
from tests.support.listener_events import Live, src_cfg, store, toks
from tests.support.poll import async_wait_until
from tests.support.recording_sink import RecordingSink

BS = 4
MODEL = "m"
TOKENS = list(range(1000, 1032))  # 8 blocks


def stored(hashes: list[int], parent: int | None, tokens: list[int], as_map: bool = False) -> Any:
    if as_map:
        return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
                "token_ids": tokens, "block_size": BS, "medium": "GPU"}  # fmt: skip
    return ["BlockStored", hashes, parent, tokens, BS, None, "GPU", None]


def batch(*events: Any) -> bytes:
    return msgpack.packb([0.0, list(events), 0])


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


# -- keys over real sockets: the feed holds exactly the keys the picker computes ----------------------------------
# For what vLLM 0.33 and SGLang 0.5.23 publish (docs/wire.md §3-4), with the feed's default key block size (16).
KB = ListenerConfig().key_block_size  # the feed's default key block size: engines publish pages of their own
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


# -- the applier --------------------------------------------------------------------------------------------------
async def test_a_big_batch_does_not_hold_the_loop() -> None:
    """The applier yields between work units: other tasks (the /healthz handler) run during a big batch."""
    cfg = ListenerConfig(
        listen="127.0.0.1:0",
        key_block_size=BS,
        sources=(SourceConfig(backend_name="e1", model=MODEL, block_size=BS, zmq_endpoint="tcp://127.0.0.1:1"),),
    )
    app = ListenerApp(cfg)
    src = app.sources["e1"]
    assert isinstance(src, ZmqEventSource)
    events = [stored([10_000 + i], None, [i * BS + t for t in range(BS)]) for i in range(20_000)]
    payload = msgpack.packb([0.0, events, 0])
    ticks = 0
    done = False

    async def ticker() -> None:
        nonlocal ticks
        while not done:
            ticks += 1
            await asyncio.sleep(0)

    t = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    before = ticks
    await src.apply_payload(payload)
    during = ticks - before
    done = True
    await t
    assert src.tracker.tracked_blocks > 0
    assert during > 1, "the loop did not get a turn while 20 000 events were applied"


def test_payload_digest_is_stable_and_tells_payloads_apart() -> None:
    """The incarnation check compares digests across processes (the state file keeps one): not Python's hash()."""
    a, b = batch(stored([1], None, TOKENS[:4])), batch(stored([2], None, TOKENS[:4]))
    assert payload_digest(a) == payload_digest(bytes(a)) and len(payload_digest(a)) == 16
    assert payload_digest(a) != payload_digest(b)
    assert payload_digest(b"") == bytes.fromhex("cae66941d9efbd404e4d88758ea67670")  # BLAKE2b-128 of nothing


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


# -- restoring persisted state ------------------------------------------------------------------------------------
def make_source(
    limits: LimitsConfig, ctx: zmq.asyncio.Context
) -> tuple[ZmqEventSource, RecordingSink, ListenerMetrics]:
    sink, metrics = RecordingSink(), ListenerMetrics()
    cfg = src_cfg()
    tracker = BlockChainTracker(cfg, limits, sink, key_block_size=KB)
    return ZmqEventSource(cfg, limits, tracker, metrics, ctx, keep_log=True), sink, metrics


def restore_dropped(metrics: ListenerMetrics, reason: str) -> float:
    value = metrics.registry.get_sample_value("kv_listener_events_dropped_total", {"source": "e1", "reason": reason})
    return value or 0.0


def test_restore_chunks_stay_under_the_budget_and_512_events() -> None:
    limits = LimitsConfig(max_message_items=4096, max_message_containers=8192)
    cap = 4096 // 2
    events = [b"x" * 100] * 50 + [b"y" * 5000] + [b"z"] * 600
    chunks = list(restore_chunks(events, limits))
    assert [e for c in chunks for e in c] == events  # every event, in order
    for c in chunks:
        assert len(c) <= 512
        assert len(c) == 1 or sum(map(len, c)) <= cap  # a larger event goes alone
    assert [b"y" * 5000] in chunks


async def test_restore_chunks_fit_the_decoding_budget(ctx: zmq.asyncio.Context) -> None:
    """Each logged event passed the live budget alone; packed 512 to a payload they did not, and the whole
    chunk was skipped (then the next save persisted the loss)."""
    limits = LimitsConfig(max_message_items=4096, max_message_containers=4096)
    live = Live(limits=limits)
    for i in range(40):  # 16 blocks of 16 tokens each: ~300 items per event, 40 events ~12k items
        live.apply([store([i * 100 + k for k in range(16)], None, toks(i, 16))])
    events = compact(live.log.view()).events
    assert len(events) == 40
    src, sink, metrics = make_source(limits, ctx)
    await src._apply_restored(SourceState("f", 39, b"d", events))
    assert sink.state == live.sink.state and len(sink.state) == 40 * 16
    assert len(compact(src.log.view()).events) == 40  # the log rebuilt from the restored events is whole
    assert restore_dropped(metrics, "too_large") == 0


async def test_a_restored_event_refused_anyway_is_counted_and_the_rest_restored(ctx: zmq.asyncio.Context) -> None:
    """Budgets lowered since the save: the one event that no longer fits is counted, its neighbours restored."""
    big = store(list(range(1000, 1064)), None, toks(1, 64))  # 64 blocks: ~1100 items
    small = [store([i], None, toks(10 + i)) for i in range(5)]
    events = [msgpack.packb(e) for e in [small[0], small[1], big, *small[2:]]]
    src, sink, metrics = make_source(LimitsConfig(max_message_items=1024), ctx)
    await src._apply_restored(SourceState("f", 9, b"d", events))
    assert len(sink.state) == 5
    assert restore_dropped(metrics, "state_restore_refused") == 1


def test_source_passes_treat_eviction_as_offload_to_its_log(ctx: zmq.asyncio.Context) -> None:
    cfg = src_cfg(offload=True)
    tracker = BlockChainTracker(cfg, LimitsConfig(), RecordingSink(), key_block_size=KB)
    src = ZmqEventSource(cfg, LimitsConfig(), tracker, ListenerMetrics(), ctx, keep_log=True)
    assert src.log.treat_eviction_as_offload


def test_state_of_another_engine_or_without_a_seq_is_not_restored(ctx: zmq.asyncio.Context) -> None:
    src, _, _ = make_source(LimitsConfig(), ctx)
    assert src.fingerprint() == fingerprint(src.cfg) == "vllm|tcp://127.0.0.1:1||m"
    for state in (
        SourceState("vllm|tcp://127.0.0.1:2||m", 3, b"d", []),
        SourceState(src.fingerprint(), None, b"d", []),
    ):
        src.restore(state)
        assert src.persisted() == (None, None, None) and src.status(60)["restoring"] is False
    src.restore(SourceState(src.fingerprint(), 3, b"d", [b"e"]))
    assert src.persisted() == (3, b"d", [b"e"]) and src.status(60)["restoring"] is True  # saved as read until verified
