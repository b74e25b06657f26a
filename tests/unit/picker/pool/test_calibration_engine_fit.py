"""The engines' own prefill cost teaches the TTFT model: vLLM's per-request prefill records (read from its
/metrics, differenced between scrapes) fit a per-token cost, which becomes the prior the first-byte fit is
pulled toward. Against a real HTTP peer serving a body rendered by prometheus_client with vLLM's names.

The tests that start a server or bind a socket: tests/integration/test_calibration_engine_fit_http.py."""

from __future__ import annotations

import random

from picker.config import parse_settings
from picker.pool.calibration import ENGINE_MIN_REQUESTS, EnginePrefillFit, TtftCalibrator, TtftSample
from picker.pool.engine_readings import PrefillTotals, prefill_totals
from picker.pool.exposition import parse_exposition
from tests.support.engine_metrics import VllmPrefillRecords


def test_prefill_totals_add_up_the_engines_of_one_server() -> None:
    rec = VllmPrefillRecords(engines=2)
    rec.finish(0.5, 1500, engine=0)
    rec.finish(0.1, 100, engine=1)
    rec.finish(0.2, 300, engine=1)
    totals = prefill_totals(parse_exposition(rec.body()))
    assert totals is not None and (totals.requests, totals.tokens) == (3.0, 1900.0)
    assert abs(totals.seconds - 0.8) < 1e-9


def test_prefill_totals_refuse_what_they_cannot_trust() -> None:
    assert prefill_totals(parse_exposition("vllm:num_requests_running 1\nvllm:num_requests_waiting 0\n")) is None
    body = (
        "vllm:request_prefill_time_seconds_count 3\nvllm:request_prefill_time_seconds_sum 1.5\n"
        "vllm:request_prefill_kv_computed_tokens_count {n}\nvllm:request_prefill_kv_computed_tokens_sum {t}\n"
    )
    assert prefill_totals(parse_exposition(body.format(n=3, t=900))) == PrefillTotals(3.0, 1.5, 900.0)
    assert prefill_totals(parse_exposition(body.format(n=2, t=900))) is None  # read between the two updates
    assert prefill_totals(parse_exposition(body.format(n=3, t="NaN"))) is None
    assert prefill_totals(parse_exposition(body.format(n=3, t=-5))) is None
    later, earlier = PrefillTotals(5.0, 2.0, 1500.0), PrefillTotals(3.0, 1.5, 900.0)
    assert later.since(earlier) == PrefillTotals(2.0, 0.5, 600.0)
    assert earlier.since(later) is None  # counters went back: a restarted engine


def engine_windows(fit: EnginePrefillFit | TtftCalibrator, rng: random.Random, n: int, ms_per_token: float) -> None:
    """``n`` scrapes, each 1-3 finished requests: cold prefills of 1.5-2k tokens and warm ones of 50-300."""
    for _ in range(n):
        k = rng.randint(1, 3)
        tokens = [rng.randint(1500, 2000) if rng.random() < 0.3 else rng.randint(50, 300) for _ in range(k)]
        seconds = sum((15.0 + ms_per_token * t) * rng.uniform(0.9, 1.1) for t in tokens) / 1000.0
        if isinstance(fit, EnginePrefillFit):
            assert fit.add(k, seconds, sum(tokens))
        else:
            fit.observe_engine_prefill(k, seconds, sum(tokens))


def test_the_engine_fit_recovers_the_per_token_cost_only_once_backed() -> None:
    fit = EnginePrefillFit()
    assert fit.ms_per_token() is None
    assert not fit.add(0, 0.0, 0) and not fit.add(1, float("nan"), 10) and not fit.add(1, -1.0, 10)
    engine_windows(fit, random.Random(5), 3, 0.35)
    assert fit.requests < ENGINE_MIN_REQUESTS and fit.ms_per_token() is None
    engine_windows(fit, random.Random(6), 60, 0.35)
    got = fit.ms_per_token()
    assert got is not None and abs(got - 0.35) < 0.03

    same = EnginePrefillFit()  # every request the same length: no slope can be told from the constant
    for _ in range(50):
        same.add(2, 2 * 0.6, 2 * 1600)
    assert same.ms_per_token() is None


def cold_first_bytes(cal: TtftCalibrator, rng: random.Random, n: int) -> None:
    """What the picker can time on a workload of shared system prompts: cold prefills of about one length,
    with a constant of 300 ms (the API server, the proxy, the KV event's way back) and 0.35 ms per token."""
    for _ in range(n):
        work = rng.randint(1600, 2100)
        cal.observe(TtftSample(work, 1), (300.0 + 0.35 * work) * rng.uniform(0.95, 1.05) / 1000.0)


def test_the_engines_cost_is_the_prior_the_first_byte_fit_keeps_where_it_cannot_tell() -> None:
    alone = TtftCalibrator(prefill_ms_per_token=0.1, prior_from_engine=True)
    cold_first_bytes(alone, random.Random(1), 40)
    # the failure seen on real vLLM: the first bytes alone leave the per-token cost near the configured prior
    assert alone.current.prefill_ms_per_token < 0.25 and alone.prior_prefill_ms_per_token == 0.1

    taught = TtftCalibrator(prefill_ms_per_token=0.1, prior_from_engine=True)
    engine_windows(taught, random.Random(2), 30, 0.35)
    assert abs(taught.prior_prefill_ms_per_token - 0.35) < 0.03
    assert abs(taught.current.prefill_ms_per_token - 0.35) < 0.03  # no first byte yet: the prior itself
    cold_first_bytes(taught, random.Random(1), 40)
    assert abs(taught.current.prefill_ms_per_token - 0.35) < 0.06
    assert 200.0 < taught.current.base_ms < 400.0  # the constant goes to the constant

    off = TtftCalibrator(prefill_ms_per_token=0.1, prior_from_engine=False)
    engine_windows(off, random.Random(2), 30, 0.35)
    assert off.prior_prefill_ms_per_token == 0.1 and off.engine.requests >= ENGINE_MIN_REQUESTS
    fixed = TtftCalibrator(prefill_ms_per_token=0.1, enabled=False)  # calibrate: false keeps the priors
    engine_windows(fixed, random.Random(2), 30, 0.35)
    assert fixed.current.prefill_ms_per_token == 0.1


def test_config_turns_the_engine_prior_off() -> None:
    cost = parse_settings({"kv_cache_index": {"scoring": {"cost": {"prior_from_engine": False}}}})
    assert TtftCalibrator.from_config(cost.kv_cache_index.scoring.cost).prior_from_engine is False
    assert TtftCalibrator.from_config(parse_settings({}).kv_cache_index.scoring.cost).prior_from_engine is True
