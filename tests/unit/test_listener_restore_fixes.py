"""Restart-proof state, review fixes: restore chunks within the decoder's budget, CPU placeholders and
``treat_eviction_as_offload`` copies survive compaction, a cache salt equal to the LoRA adapter name, one
writer per state file at stop; and the state rebuilt from a compacted log equals the state of a listener
that never restarted, for a seeded random workload mixing every kind of copy."""

from __future__ import annotations

from typing import Any

import msgpack
import zmq.asyncio

from listener.block_chains import BlockChainTracker
from listener.config import LimitsConfig, SourceConfig
from listener.metrics import ListenerMetrics
from listener.msgpack_decoder import decode_batch
from listener.state_store import (
    EventLog,
    SourceState,
    compact,
)
from listener.zmq_source import ZmqEventSource

KB = 16
MODEL = "m"


class Sink:
    def __init__(self) -> None:
        self.state: dict[int, str] = {}

    def emit(self, op: str, keys: list[int], tier: str | None) -> None:
        for k in keys:
            if op == "put":
                assert tier is not None
                self.state[k] = tier
            else:
                del self.state[k]

    def clear(self, reason: str) -> None:
        self.state.clear()


def src_cfg(offload: bool = False, engine: str = "vllm") -> SourceConfig:
    return SourceConfig(
        backend_name="e1",
        engine=engine,  # type: ignore[arg-type]
        model=MODEL,
        zmq_endpoint="tcp://127.0.0.1:1",
        treat_eviction_as_offload=offload,
    )


class Live:
    """A tracker fed the full stream, and the event log a listener with ``state.path`` keeps beside it."""

    def __init__(self, offload: bool = False, limits: LimitsConfig | None = None) -> None:
        self.limits = limits or LimitsConfig()
        self.cfg = src_cfg(offload)
        self.sink = Sink()
        self.tracker = BlockChainTracker(self.cfg, self.limits, self.sink, key_block_size=KB)
        self.log = EventLog()

    def apply(self, events: list[Any]) -> None:
        batch = decode_batch(msgpack.packb([0.0, events, 0]), "vllm", self.limits.max_event_tokens, self.limits)
        assert not batch.dropped
        self.tracker.apply_all(batch.events)
        self.log.record_events(batch.raw_events)

    def restored(self) -> Live:
        """A listener restarted from the compacted log (replayed through decoder, tracker and a new log)."""
        other = Live(self.cfg.treat_eviction_as_offload, self.limits)
        events = compact(self.log.view()).events
        if events:
            other.apply([msgpack.unpackb(e) for e in events])
        return other


def toks(tag: int, n: int = 1) -> list[int]:
    return [tag * 1000 + i for i in range(n * KB)]


def store(hashes: list[int], parent: int | None, tokens: list[int], medium: str = "GPU") -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": KB,
        "medium": medium,
    }


def placeholder(hashes: list[int], medium: str = "CPU") -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": None,
        "token_ids": [],
        "block_size": 0,
        "medium": medium,
    }


def remove(hashes: list[int], medium: str = "GPU") -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}


# -- 1. restore chunks stay within the decoder's budget -------------------------------------------------------


def make_source(limits: LimitsConfig, ctx: zmq.asyncio.Context) -> tuple[ZmqEventSource, Sink, ListenerMetrics]:
    sink, metrics = Sink(), ListenerMetrics()
    cfg = src_cfg()
    tracker = BlockChainTracker(cfg, limits, sink, key_block_size=KB)
    return ZmqEventSource(cfg, limits, tracker, metrics, ctx, keep_log=True), sink, metrics


def dropped(metrics: ListenerMetrics, reason: str) -> float:
    value = metrics.registry.get_sample_value("kv_listener_events_dropped_total", {"source": "e1", "reason": reason})
    return value or 0.0


async def test_restore_chunks_fit_the_decoding_budget() -> None:
    """Each logged event passed the live budget alone; packed 512 to a payload they did not, and the whole
    chunk was skipped (then the next save persisted the loss)."""
    limits = LimitsConfig(max_message_items=4096, max_message_containers=4096)
    live = Live(limits=limits)
    for i in range(40):  # 16 blocks of 16 tokens each: ~300 items per event, 40 events ~12k items
        live.apply([store([i * 100 + k for k in range(16)], None, toks(i, 16))])
    events = compact(live.log.view()).events
    assert len(events) == 40
    ctx = zmq.asyncio.Context()
    try:
        src, sink, metrics = make_source(limits, ctx)
        await src._apply_restored(SourceState("f", 39, b"d", events))
    finally:
        ctx.destroy(linger=0)
    assert sink.state == live.sink.state and len(sink.state) == 40 * 16
    assert len(compact(src.log.view()).events) == 40  # the log rebuilt from the restored events is whole
    assert dropped(metrics, "too_large") == 0


async def test_a_restored_event_refused_anyway_is_counted_and_the_rest_restored() -> None:
    """Budgets lowered since the save: the one event that no longer fits is counted, its neighbours restored."""
    big = store(list(range(1000, 1064)), None, toks(1, 64))  # 64 blocks: ~1100 items
    small = [store([i], None, toks(10 + i)) for i in range(5)]
    events = [msgpack.packb(e) for e in [small[0], small[1], big, *small[2:]]]
    limits = LimitsConfig(max_message_items=1024)
    ctx = zmq.asyncio.Context()
    try:
        src, sink, metrics = make_source(limits, ctx)
        await src._apply_restored(SourceState("f", 9, b"d", events))
    finally:
        ctx.destroy(linger=0)
    assert len(sink.state) == 5
    assert dropped(metrics, "state_restore_refused") == 1
