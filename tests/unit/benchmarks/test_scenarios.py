"""The hot-documents scenario: its trace, and the calibration claim behind it (one replica cannot serve
the hottest document's traffic, the pool can) checked against the simulator's own scheduler, stepped
synchronously with the simulator's step-cost formula (no clock involved)."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from benchmarks.bound import bound_hit_rate
from benchmarks.engine_sim.config import SimConfig
from benchmarks.engine_sim.prefix_cache import PagedPrefixCache
from benchmarks.engine_sim.scheduler import BatchScheduler, SimRequest, step_duration_ms
from benchmarks.engine_sim.tokenizer import chat_token_ids, request_token_ids
from benchmarks.scenarios import (
    HOT_DOCS_CALIBRATION,
    HOT_DOCS_SIM,
    SCENARIOS,
    decode_bound_capacity,
    hot_docs,
    hot_docs_calibration,
)


def test_hot_docs_scenario_shape() -> None:
    assert SCENARIOS["hot-docs"] is hot_docs
    s = hot_docs(time_scale=0.25, seed=0)
    assert s.name == "hot-docs" and s.replicas == 4 and s.target_rate == 12.0 and s.sim.time_scale == 0.25
    assert s.records == hot_docs(time_scale=0.25, seed=0).records  # seeded: the same trace every time
    assert s.records != hot_docs(seed=1).records
    docs = Counter(r.extra["doc"] for r in s.records)
    assert set(docs) == {0, 1, 2, 3} and len(s.records) == 600
    assert docs[0] > docs[1] > docs[2]
    lengths = {r.extra["doc"]: len(r.body["messages"][0]["content"].split()) for r in s.records}
    assert all(3000 <= n <= 6000 for n in lengths.values())
    # few documents, all reused: the bound is close to every prompt token but the questions and the
    # four first reads
    assert bound_hit_rate(s.records[:100], s.sim.block_size).hit_rate > 0.9
    assert s.calibration == HOT_DOCS_CALIBRATION and "req/s" in s.calibration
    assert s.params["calibration"] == hot_docs_calibration(s.params)


def test_hot_docs_calibration_one_replica_cannot_serve_the_hottest_document() -> None:
    s = hot_docs()
    c = s.params["calibration"]
    assert c["hottest_vs_one_replica"] > 1.2  # the hottest document needs a second replica
    assert c["pool_utilisation"] < 0.8  # the pool has room for it
    span = max(r.t for r in s.records)
    hottest = Counter(r.extra["doc"] for r in s.records)[0] / span
    assert hottest > 1.2 * c["replica_capacity_rps"]  # the seeded trace itself, not only the weights


def _drive(sim: SimConfig, prompts: list[list[int]], output_len: int) -> list[float]:
    """Step a BatchScheduler without sleeping; returns each request's finish time in simulated ms."""
    cfg = dataclasses.replace(sim, kv_events_enabled=False)
    sched = BatchScheduler(cfg, PagedPrefixCache(cfg.block_size, cfg.capacity_blocks))
    requests = [SimRequest(f"r{i}", ids, output_len) for i, ids in enumerate(prompts)]
    warm, rest = requests[0], requests[1:]
    sched.submit(warm)
    now, finished = 0.0, dict[str, float]()
    while not warm.finished:  # the document's first read (a miss) before the saturating burst
        decoding, prefill, loaded = sched._plan_step()
        now += step_duration_ms(cfg, prefill, len(decoding), loaded)
        sched._apply_step(decoding)
    for r in rest:
        sched.submit(r)
    now = 0.0
    while len(finished) < len(rest):
        decoding, prefill, loaded = sched._plan_step()
        now += step_duration_ms(cfg, prefill, len(decoding), loaded)
        sched._apply_step(decoding)
        for r in rest:
            if r.finished and r.request_id not in finished:
                finished[r.request_id] = now
    return sorted(finished.values())


def test_decode_bound_capacity_matches_the_simulator_scheduler() -> None:
    s = hot_docs()
    doc0 = [r for r in s.records if r.extra["doc"] == 0][:161]
    prompts = [request_token_ids(r.path, r.body) for r in doc0]
    done = _drive(HOT_DOCS_SIM, prompts, s.params["output_len"])
    # steady state, over whole batches: requests admitted together finish together, so count a multiple of
    # max_num_seqs completions (12 batches of 8 from the 40th on)
    k = 12 * HOT_DOCS_SIM.max_num_seqs
    measured = k / ((done[40 + k] - done[40]) / 1000.0)
    shared = len(chat_token_ids([doc0[0].body["messages"][0]], add_generation_prompt=False))  # the document
    uncached = sum(len(p) for p in prompts[1:]) / len(prompts[1:]) - (shared // 16) * 16
    model = decode_bound_capacity(HOT_DOCS_SIM, s.params["output_len"], uncached)
    print(f"measured {measured:.3f} req/s, model {model:.3f} (uncached {uncached:.1f} tokens)")
    assert measured == pytest.approx(model, rel=0.03)
    assert measured == pytest.approx(s.params["calibration"]["replica_capacity_rps"], rel=0.08)
