"""benchmarks.response_cache's arithmetic: Prometheus text parsing, histogram_quantile, paired medians, verdicts."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.response_cache import (
    FINISHED_ANSWER,
    histogram_buckets,
    histogram_quantile,
    report,
    sample,
    summarize,
)
from picker.cache.grammar import finished_body

TEXT = """# HELP continuum_cache_redis_latency_seconds Time
# TYPE continuum_cache_redis_latency_seconds histogram
continuum_cache_redis_latency_seconds_bucket{le="0.0001",operation="get"} 10.0
continuum_cache_redis_latency_seconds_bucket{le="0.001",operation="get"} 90.0
continuum_cache_redis_latency_seconds_bucket{le="0.01",operation="get"} 100.0
continuum_cache_redis_latency_seconds_bucket{le="+Inf",operation="get"} 100.0
continuum_cache_redis_latency_seconds_bucket{le="0.0001",operation="set"} 3.0
continuum_cache_redis_latency_seconds_bucket{le="+Inf",operation="set"} 3.0
continuum_cache_fallback_active 1.0
continuum_response_cache_requests_total{result="hit"} 7.0
continuum_response_cache_requests_total{result="miss"} 2.0
"""


def test_samples_and_buckets() -> None:
    assert sample(TEXT, "continuum_cache_fallback_active") == 1.0
    assert sample(TEXT, "continuum_response_cache_requests_total", result="miss") == 2.0
    assert sample(TEXT, "continuum_response_cache_requests_total", result="skip") == 0.0
    buckets = histogram_buckets(TEXT, "continuum_cache_redis_latency_seconds", operation="get")
    assert buckets == [(0.0001, 10.0), (0.001, 90.0), (0.01, 100.0), (float("inf"), 100.0)]


def test_histogram_quantile_interpolates_within_the_bucket() -> None:
    buckets = histogram_buckets(TEXT, "continuum_cache_redis_latency_seconds", operation="get")
    p50 = histogram_quantile(0.5, buckets)
    assert p50 is not None and p50[1] == 0.001
    assert p50[0] == pytest.approx(0.0001 + 0.0009 * (50 - 10) / 80)
    p99 = histogram_quantile(0.99, buckets)
    assert p99 is not None and p99[1] == 0.01 and p99[0] == pytest.approx(0.001 + 0.009 * 9 / 10)
    assert histogram_quantile(0.99, [(0.001, 0.0), (float("inf"), 0.0)]) is None
    assert histogram_quantile(0.99, [(0.001, 1.0), (float("inf"), 100.0)]) == (0.001, float("inf"))


def _phase(rps: float = 1000.0, p50: float = 1.0, **extra: Any) -> dict[str, Any]:
    return {"rps": rps, "p50_ms": p50, "failed": 0, "upstream_rq": 0, **extra}


def _rounds(valkey_hit_rps: float, valkey_miss_p50: list[float]) -> tuple[list[Any], list[Any]]:
    hit = [
        {
            "floor": _phase(1000),
            "floor_none": _phase(1100),
            "picker_memory": _phase(1200, cache={"hit": 10, "miss": 0, "skip": 0}),
            "picker_valkey": _phase(valkey_hit_rps, cache={"hit": 10, "miss": 0, "skip": 0}),
        }
        for _ in valkey_miss_p50
    ]
    miss = [
        {
            "envoy_only": _phase(p50=0.1),
            "picker_memory": _phase(p50=1.0, cache={"hit": 0, "miss": 5, "skip": 0}),
            "picker_valkey": _phase(p50=v, cache={"hit": 0, "miss": 5, "skip": 0}),
        }
        for v in valkey_miss_p50
    ]
    return hit, miss


def test_targets_met_and_not_met_are_printed() -> None:
    hit, miss = _rounds(1150, [1.2, 1.9, 1.3])  # paired differences 0.2, 0.9, 0.3: median 0.3
    res = summarize(hit, miss, [], None, None, 0.0, 3.0, 8, False)
    assert res["valkey_minus_memory_p50_ms"] == pytest.approx(0.3)
    assert res["miss_p50_added_ms"]["picker_memory"] == pytest.approx(0.9)
    assert res["targets"]["hit picker_valkey/floor >= 1"] is True
    assert res["targets"]["hit picker_valkey/floor_none >= 1"] is True
    assert res["problems"] == []
    assert "NOT MET" not in report(res)

    hit, miss = _rounds(900, [1.6, 1.7, 1.8])
    res = summarize(hit, miss, [], None, None, 0.0, 3.0, 8, False)
    text = report(res)
    assert res["targets"]["hit picker_valkey/floor >= 1"] is False
    assert "0.900x floor (NOT MET)" in text
    assert "Valkey's added p50 over the memory store: +0.700 ms" in text and "0.5 ms: NOT MET" in text


def test_a_phase_that_did_not_measure_what_it_claims_is_flagged() -> None:
    hit, miss = _rounds(1150, [1.2])
    hit[0]["picker_memory"]["cache"]["miss"] = 3  # a "hit" phase that reached the engines
    miss[0]["picker_valkey"]["cache"]["hit"] = 2  # a "miss" phase whose bodies wrapped round
    miss[0]["envoy_only"]["failed"] = 1
    res = summarize(hit, miss, [], None, None, 1.0, 3.0, 8, False)
    assert len(res["problems"]) == 4
    assert report(res).count("CHECK FAILED") == 4


def test_the_benchmark_upstream_answer_is_one_the_cache_stores() -> None:
    """The hit phases prime the cache with the trivial upstream's answer: it must be a finished one."""
    assert finished_body("chat", FINISHED_ANSWER.encode())
    assert not finished_body("chat", b'{"ok":true}')  # what benchmarks.overhead's upstream answers
