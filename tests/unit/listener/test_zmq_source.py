"""listener.zmq_source over real ZMQ sockets (the engines of fake_engines): encodings, removals, replay (all reply
layouts), restart, clears, allowed publishers, topic filter and hostile payloads; the keys of what vLLM and SGLang
publish; the applier's turns; incarnation checks on a reconnection; restoring persisted state.

The tests that start a server or bind a socket: tests/integration/test_listener_zmq_source.py."""

from __future__ import annotations

import asyncio

import msgpack
import zmq
import zmq.asyncio

from listener.app import ListenerApp
from listener.block_chains import BlockChainTracker
from listener.config import LimitsConfig, ListenerConfig, SourceConfig
from listener.metrics import ListenerMetrics
from listener.state_file import SourceState
from listener.state_log import compact
from listener.zmq_source import ZmqEventSource, fingerprint, payload_digest, restore_chunks
from tests.support.listener_events import Live, src_cfg, store, toks
from tests.support.recording_sink import RecordingSink
from tests.support.zmq_batches import BS, KB, MODEL, TOKENS, batch, stored


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
