"""listener.app.sources: each backend's source, tracker and feed made and wired (records and clears counted),
the source chosen by engine, state hooks handed to the persister, discovered sources' tasks (a crash recorded,
bounded), a dropped source's feed retired and its series gone, the gauges."""

from __future__ import annotations

from pathlib import Path

import pytest

from listener.app import sources as sources_mod
from listener.app.sources import GONE, SourceSet
from listener.config import ListenerConfig, SourceConfig, StateConfig
from listener.events import BlockStored
from listener.metrics import ListenerMetrics
from listener.state_store import StatePersister
from listener.trtllm_source import TrtllmHttpSource
from listener.zmq_source import ZmqEventSource
from picker.shared.feed_records import CLEAR
from tests.support.poll import async_wait_until

BS = 4
TOKENS = list(range(100, 108))


def zmq_cfg(name: str) -> SourceConfig:
    return SourceConfig(backend_name=name, model="m", zmq_endpoint="tcp://127.0.0.1:1")


def trt_cfg(name: str) -> SourceConfig:
    return SourceConfig(backend_name=name, engine="trtllm", model="m", http_endpoint="http://127.0.0.1:1")


def sample(m: ListenerMetrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, labels)


def test_a_source_its_tracker_and_its_feed_are_wired_and_counted() -> None:
    m = ListenerMetrics()
    live = SourceSet(ListenerConfig(key_block_size=BS), m)
    try:
        src = live.add(zmq_cfg("e1"), base_id=5 << 40)
        assert live.sources == {"e1": src} and set(live.feeds) == set(live.trackers) == {"e1"}
        feed = live.feeds["e1"]
        assert feed.last_id == 5 << 40 and (feed.model, feed.engine, feed.key_block_size) == ("m", "vllm", BS)
        live.trackers["e1"].apply(BlockStored((1, 2), None, TOKENS, BS))
        assert len(feed.state) == 2
        assert sample(m, "kv_listener_feed_records_total", backend="e1") == feed.last_id - (5 << 40)
        assert sample(m, "kv_listener_feed_overflows_total", backend="e1") == 0  # the series exists from the start
        live.trackers["e1"].reset("gap")
        assert feed.state == {} and feed.history[-1].kind == CLEAR
        assert sample(m, "kv_listener_backend_clears_total", source="e1", reason="gap") == 1
    finally:
        live.close()


def test_the_engine_chooses_the_source_and_zmq_sources_share_one_context(tmp_path: Path) -> None:
    cfg = ListenerConfig(state=StateConfig(path=str(tmp_path / "s.bin")))
    persister = StatePersister(cfg.state, [])
    live = SourceSet(cfg, ListenerMetrics(), persister)
    try:
        a, b, t = (
            live.add(zmq_cfg("a")),
            live.add(zmq_cfg("b").model_copy(update={"engine": "sglang"})),
            live.add(trt_cfg("t")),
        )
        assert isinstance(a, ZmqEventSource) and isinstance(b, ZmqEventSource) and isinstance(t, TrtllmHttpSource)
        assert a.ctx is b.ctx and a.keep_log  # the state file needs the log
        assert [live.persist(s) for s in (a, b, t)] == [False, False, False]  # registered; nothing read yet
        assert [s.name for s in persister.sources] == ["a", "b"]  # a TRT-LLM source keeps no state
    finally:
        live.close()
    assert a.ctx.closed
    no_state = SourceSet(ListenerConfig(), ListenerMetrics())
    src = no_state.add(zmq_cfg("a"))
    assert isinstance(src, ZmqEventSource) and not src.keep_log and no_state.persist(src) is False
    no_state.close()


async def test_dropping_a_source_retires_its_feed_and_forgets_everything_of_it(tmp_path: Path) -> None:
    m = ListenerMetrics()
    cfg = ListenerConfig(key_block_size=BS, state=StateConfig(path=str(tmp_path / "s.bin")))
    persister = StatePersister(cfg.state, [])
    live = SourceSet(cfg, m, persister)
    try:
        for name in ("a", "b"):
            live.persist(live.add(trt_cfg(name), base_id=9 << 40))
            live.spawn(name)
        live.trackers["a"].apply(BlockStored((1,), None, TOKENS[:BS], BS))
        sub = live.feeds["a"].subscribe(None)
        m.events_processed.labels("a").inc()
        epochs = await live.drop(["a"])
        assert epochs == {"a": 9} and set(live.sources) == set(live.feeds) == set(live.trackers) == {"b"}
        records = [r for batch in [b async for b in sub.batches(60)] for r in batch]
        assert [r.kind for r in records][-1] == CLEAR and sub.close_reason == GONE
        assert sample(m, "kv_listener_events_processed_total", source="a") is None
        assert sample(m, "continuum_listener_discovery_events_total", event="source_removed") == 1
        assert await live.drop([]) == {}
    finally:
        assert await live.stop_tasks() == []
        live.close()


async def test_a_crashed_discovered_source_is_recorded_within_a_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sources_mod, "MAX_SOURCE_FAILURES", 2)
    m = ListenerMetrics()
    live = SourceSet(ListenerConfig(), m)

    async def crash() -> None:
        raise RuntimeError("decoder bug")

    for name in ("a", "b", "c"):
        src = live.add(trt_cfg(name))
        monkeypatch.setattr(src, "run", crash)
        live.spawn(name)
    await async_wait_until(lambda: sample(m, "kv_listener_background_task_failures_total", task="source-c") == 1)
    assert [f.task for f in live.failures] == ["source-a", "source-b"]  # bound: the first ones
    assert "decoder bug" in live.failures[0].reason
    await live.stop_tasks()
    live.close()


def test_gauges_and_forgetting_a_source_that_never_ran() -> None:
    m = ListenerMetrics()
    live = SourceSet(ListenerConfig(key_block_size=BS), m)
    try:
        z, t = live.add(zmq_cfg("z")), live.add(trt_cfg("t"))
        live.trackers["z"].apply(BlockStored((1, 2), None, TOKENS, BS))
        live.update_gauges()
        assert sample(m, "kv_listener_tracked_blocks", source="z") == 2
        assert sample(m, "kv_listener_backlog_bytes", source="z") == 0
        assert sample(m, "kv_listener_backlog_bytes", source="t") is None  # no receive queue, no series
        live.forget("z")
        assert set(live.sources) == {"t"} and sample(m, "kv_listener_tracked_blocks", source="z") is None
        assert isinstance(z, ZmqEventSource) and not z.receiver.opened and isinstance(t, TrtllmHttpSource)
    finally:
        live.close()
