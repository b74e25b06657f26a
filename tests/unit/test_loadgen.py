"""The load generator against in-process simulators: records, session order, engine hit rate."""

from __future__ import annotations

import itertools

from benchmarks.engine_sim import EngineSimulator, SimConfig
from benchmarks.loadgen import (
    engine_hit_rate,
    gateway_cached_share,
    parse_prometheus_text,
    run_trace,
    scrape_prefix_cache_counters,
)
from benchmarks.trace import TraceRecord
from benchmarks.workloads import multi_turn_chat, prefix_repetition


async def test_replay_measures_requests_and_hit_rate() -> None:
    sim = EngineSimulator(SimConfig(time_scale=0.001, kv_events_enabled=False))
    await sim.start()
    try:
        records = prefix_repetition(64, 8, 4, num_prefixes=3, prompts_per_prefix=3, rate=500.0, seed=1)
        records.append(TraceRecord(0.0, "/v1/completions", {"prompt": "x", "max_tokens": 0}))  # a 400
        before = await scrape_prefix_cache_counters([sim.base_url])
        # sequential: the hit rate must not depend on how the requests overlap on a busy machine
        results = await run_trace(records, sim.base_url, max_concurrency=1)
        after = await scrape_prefix_cache_counters([sim.base_url])
    finally:
        await sim.stop()
    ok = [r for r in results if r.ok]
    assert len(ok) == 9 and [r.status for r in results if not r.ok] == [400]
    for r in ok:
        assert r.ttft_s is not None and r.latency_s is not None and r.ttft_s <= r.latency_s
        assert r.prompt_tokens == 72 and r.completion_tokens == 4 and r.served_by == "sim-0"
    rate = engine_hit_rate(before, after)
    share = gateway_cached_share(results)
    assert rate is not None and share is not None
    assert rate == share  # one replica: engine counters and usage agree exactly
    assert rate > 0.5


async def test_session_turns_are_sent_in_order_after_the_previous_finished() -> None:
    sim = EngineSimulator(SimConfig(time_scale=0.001, kv_events_enabled=False))
    await sim.start()
    try:
        records = multi_turn_chat(3, ["a b c d"], turns=(3, 4), user_len=5, output_len=3, turn_gap_s=0.0, seed=4)
        results = await run_trace(records, sim.base_url, max_concurrency=2)
    finally:
        await sim.stop()
    assert all(r.ok for r in results)
    by_session: dict[str, list[tuple[int, float, float]]] = {}
    for r in results:
        assert r.session is not None and r.turn is not None and r.latency_s is not None
        by_session.setdefault(r.session, []).append((r.turn, r.start_s, r.start_s + r.latency_s))
    for turns in by_session.values():
        turns.sort()
        for (_, _, prev_end), (_, start, _) in itertools.pairwise(turns):
            assert start >= prev_end - 1e-3


def test_prometheus_parser() -> None:
    text = '# HELP x\nvllm:prefix_cache_hits_total{engine="0",model_name="m"} 12.0\nup 1\n'
    assert parse_prometheus_text(text) == [
        ("vllm:prefix_cache_hits_total", {"engine": "0", "model_name": "m"}, 12.0),
        ("up", {}, 1.0),
    ]
