"""The load generator's Prometheus parsing and engine-load sums (against running simulators:
tests/integration/test_loadgen_sim.py)."""

from __future__ import annotations

from benchmarks.loadgen import (
    engine_load,
    parse_prometheus_text,
)


def test_prometheus_parser() -> None:
    text = '# HELP x\nvllm:prefix_cache_hits_total{engine="0",model_name="m"} 12.0\nup 1\n'
    assert parse_prometheus_text(text) == [
        ("vllm:prefix_cache_hits_total", {"engine": "0", "model_name": "m"}, 12.0),
        ("up", {}, 1.0),
    ]


def test_engine_load_sums_the_gauges_over_label_sets() -> None:
    text = (
        '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 2.0\n'
        'vllm:num_requests_waiting{engine="0",model_name="m"} 4.0\nvllm:kv_cache_usage_perc{engine="0"} 0.5\n'
    )
    assert engine_load(text) == (5.0, 4.0)
    assert engine_load("") == (0.0, 0.0)
