"""benchmarks.pd's pure parts: the seeded workload, the figures from the client's results and the picker's and
engines' counters, the ratios, the sweep's values and the arms' picker configs."""

from __future__ import annotations

import pytest

from benchmarks.loadgen import RequestResult
from benchmarks.pd import (
    NEVER,
    Arm,
    ArmRun,
    PdWorkload,
    figures,
    markdown,
    parse_sweep,
    picker_config,
    ratios,
    summary,
)


def test_the_workload_is_seeded_and_has_both_classes() -> None:
    w = PdWorkload(duration_s=30.0)
    a, b, other = w.records(0), w.records(0), w.records(1)
    assert [r.to_json() for r in a] == [r.to_json() for r in b]
    assert [r.t for r in a] != [r.t for r in other]
    assert [r.t for r in a] == sorted(r.t for r in a) and a[-1].t < 30.0
    for r in a:
        lo, hi = w.stream_prompt if r.extra["class"] == "stream" else w.long_prompt
        assert lo <= len(r.body["prompt"].split()) <= hi  # one word = one simulator token
        out_lo, out_hi = w.stream_output if r.extra["class"] == "stream" else w.long_output
        assert out_lo <= r.body["max_tokens"] <= out_hi and r.body["stream"] is True
    streams = sum(r.extra["class"] == "stream" for r in a)
    longs = len(a) - streams
    assert streams == pytest.approx(w.stream_rate * 30, rel=0.3) and longs == pytest.approx(w.long_rate * 30, rel=0.5)


def _result(
    i: int, ttft: float, gaps: list[float], tokens: int = 3, start: float = 0.0, sched: float = 0.0
) -> RequestResult:
    r = RequestResult(i, None, None, "/v1/completions", sched, start, 200, ttft_s=ttft, latency_s=ttft + sum(gaps))
    r.completion_tokens = tokens
    r.token_gaps_s = gaps
    return r


def test_figures_pool_the_gaps_and_count_the_decisions() -> None:
    w = PdWorkload(duration_s=5.0)
    records = w.records(0)[:3]
    results = [
        _result(0, 0.05, [0.01, 0.01]),
        _result(1, 0.50, [0.2, 0.01], start=1.1, sched=1.0),
        _result(2, 0.05, [0.01, 0.01]),
    ]
    counters = (
        "kv_sim_steps_total",
        "kv_sim_decode_steps_with_prefill_total",
        "kv_sim_prefill_tokens_in_decode_steps_total",
    )
    engines = {
        "sim-0": dict.fromkeys(counters, 0.0),
        "sim-1": dict(zip(counters, (100.0, 4.0, 5000.0), strict=True)),
    }
    results[1].prefill = "remote"  # the sidecar said so: one of three took a prefill leg
    decisions = {"prefill-decode/cost": 1.0, "decode-only/below_threshold": 2.0}
    run = ArmRun(
        Arm("pd", 1, 512), 0, records, results, 2.0, decisions, engines, {"sim-0": "prefill", "sim-1": "decode"}
    )
    f = figures(run)
    assert f["itl_ms"]["gaps"] == 6 and f["itl_ms"]["p50"] == 10.0 and f["itl_ms"]["p99"] > 150
    assert f["ttft_ms"]["p50"] == 50.0
    assert f["ttft_from_arrival_ms"]["p99"] == pytest.approx(589.0, abs=0.5)  # of 50, 50, 600 ms (0.1 s late)
    assert f["prefill_leg_share"] == pytest.approx(1 / 3, abs=1e-3)
    assert f["prefilled_remotely_share"] == pytest.approx(1 / 3, abs=1e-3)
    assert figures(run, time_scale=0.5)["ttft_ms"]["p50"] == 100.0  # simulated ms: wall ms / time_scale
    assert f["decode_steps_with_prefill_share"] == 0.04 and f["prefill_tokens_beside_decodes"] == 5000  # decoders
    assert f["output_tokens_per_s"] == 4.5 and f["success_rate"] == 1.0
    half = ratios({**f, "itl_ms": {**f["itl_ms"], "p99": f["itl_ms"]["p99"] / 2}}, f)
    assert half["itl_p99"] == 0.5 and half["ttft_p99"] == 1.0
    doc = {"seeds": {"0": {"aggregated": f, "pd": f, "ratios": ratios(f, f)}}, "sweep": {"inf": f}}
    doc["summary"] = summary(doc)
    md = markdown(doc)
    assert "| P/D, seed 0 | 10.0 |" in md and "| min_uncached_tokens=inf |" in md and "TTFT p99 ≤ 1.2x: met" in md


def test_the_summary_checks_the_targets_on_the_worst_seed() -> None:
    base = {"itl_p50": 1.0, "ttft_from_arrival_p99": 1.0, "output_tokens_per_s": 1.0}
    doc = {
        "seeds": {
            "0": {"ratios": {**base, "itl_p99": 0.3, "ttft_p99": 1.1}},
            "1": {"ratios": {**base, "itl_p99": 0.5, "ttft_p99": 1.3}},
        }
    }
    s = summary(doc)
    assert s["itl_p99"] == {"seeds": [0.3, 0.5], "median": 0.4, "min": 0.3, "max": 0.5}
    assert s["targets"] == {"itl_p99_at_most_0.6x": True, "ttft_p99_at_most_1.2x": False}


def test_sweep_values_and_picker_configs() -> None:
    assert parse_sweep("0, 512,inf") == [0, 512, NEVER]
    assert "disaggregation" not in picker_config(Arm("aggregated"))
    pd = picker_config(Arm("pd", 2, 1024))
    assert pd["disaggregation"] == {
        "enabled": True, "min_uncached_tokens": 1024, "decide": "cost", "decode_stall_weight": 1.0,
    }  # fmt: skip
    assert picker_config(Arm("pd", 2, 0, "threshold"))["disaggregation"]["decide"] == "threshold"
    assert pd["kv_cache_index"]["scoring"]["mode"] == "cost"  # the same scorer in both arms
