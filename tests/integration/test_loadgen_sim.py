"""The load generator against in-process simulators: records, session order, engine hit rate."""

from __future__ import annotations

import asyncio
import itertools
import socket

import aiohttp

from benchmarks.engine_sim import EngineSimulator, SimConfig
from benchmarks.engine_sim.scheduler import SimRequest
from benchmarks.loadgen import (
    EngineLoadPoller,
    EngineLoadSample,
    engine_hit_rate,
    gateway_cached_share,
    run_trace,
    sample_engine_load,
    scrape_prefix_cache_counters,
)
from benchmarks.report import load_figures
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


async def test_sample_engine_load_reads_real_simulators_and_leaves_out_a_silent_one() -> None:
    queued = EngineSimulator(SimConfig(name="sim-0", time_scale=0.001, kv_events_enabled=False))
    idle = EngineSimulator(SimConfig(name="sim-1", time_scale=0.001, kv_events_enabled=False))
    await queued.start()
    await idle.start()
    refused = socket.socket()  # bound, never listening: connections to it are refused while we hold it
    refused.bind(("127.0.0.1", 0))
    try:
        scheduler = queued.scheduler
        assert scheduler is not None
        scheduler.stall(600_000)  # the step loop checks the stall before planning: nothing gets admitted
        for i in range(3):
            scheduler.submit(SimRequest(f"r{i}", [300 + i] * 20, 4))
        replicas = {
            "sim-0": queued.base_url,
            "sim-1": idle.base_url,
            "gone": f"http://127.0.0.1:{refused.getsockname()[1]}",
        }
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
            running, waiting = await sample_engine_load(http, replicas)
        assert running == {"sim-0": 0.0, "sim-1": 0.0} and waiting == {"sim-0": 3.0, "sim-1": 0.0}
        # one poll of these replicas: sim-1 is idle while sim-0 has requests waiting
        figures = load_figures([EngineLoadSample(0.0, running, waiting)], 0.1)
        assert figures["idle_while_queued"] == 1.0 and figures["busy_fraction"] == {"sim-0": 1.0, "sim-1": 0.0}
    finally:
        refused.close()
        await queued.stop()
        await idle.stop()


async def test_poller_follows_the_replica_set_and_stops_at_its_sample_bound() -> None:
    sims = [EngineSimulator(SimConfig(name=f"sim-{i}", time_scale=0.001, kv_events_enabled=False)) for i in range(2)]
    for sim in sims:
        await sim.start()
    pool = {"sim-0": sims[0].base_url}
    calls = 0

    def replicas() -> dict[str, str]:
        nonlocal calls
        calls += 1
        if calls == 3:  # a replica joins the pool before the third poll
            pool["sim-1"] = sims[1].base_url
        return pool

    try:
        poller = EngineLoadPoller(replicas, period_s=0.001, max_samples=5)
        poller.start()
        samples = await asyncio.wait_for(poller.join(), 30)
    finally:
        for sim in sims:
            await sim.stop()
    assert poller.truncated is True and len(samples) == 5 and calls == 5
    assert [set(s.running) for s in samples] == [{"sim-0"}] * 2 + [{"sim-0", "sim-1"}] * 3
    assert all(a.t_s <= b.t_s for a, b in itertools.pairwise(samples))
    assert await poller.stop() == samples  # stopping a finished poller is harmless


async def test_poller_stop_ends_polling() -> None:
    sim = EngineSimulator(SimConfig(time_scale=0.001, kv_events_enabled=False))
    await sim.start()
    try:
        poller = EngineLoadPoller(lambda: {"sim-0": sim.base_url}, period_s=0.001)
        poller.start()
        while not poller.samples:  # the first poll is immediate; wait for it to land
            await asyncio.sleep(0.001)
        task = poller._task
        samples = await poller.stop()
        assert task is not None and task.done() and poller._task is None  # the polling task has ended
        count = len(samples)
        await asyncio.sleep(0.01)
        assert len(poller.samples) == count and poller.truncated is False  # nothing after stop
        assert samples[0].running == {"sim-0": 0.0} and samples[0].waiting == {"sim-0": 0.0}
    finally:
        await sim.stop()
