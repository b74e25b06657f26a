"""What an engine's ``/metrics`` say, read by ``engine_readings``: which family set wins when several are there,
which KV-usage name is preferred, mirror labels taken once (the largest) and other series added, the count
bounds, and the prefill totals' mirror handling and differences."""

from __future__ import annotations

import pytest

from picker.pool.engine_readings import (
    MAX_COUNT,
    PrefillTotals,
    engine_signals,
    prefill_totals,
    read_signals,
)
from picker.pool.exposition import parse_exposition
from picker.routing.endpoints import EngineSignals


def signals(text: str) -> EngineSignals | None:
    return read_signals(text)[0]


def test_vllm_is_read_before_sglang_when_a_body_has_both() -> None:
    body = (
        "sglang:num_queue_reqs 9\nsglang:num_running_reqs 9\nsglang:token_usage 0.9\n"
        "vllm:num_requests_waiting 1\nvllm:num_requests_running 2\nvllm:kv_cache_usage_perc 0.5\n"
    )
    assert signals(body) == EngineSignals(waiting=1, running=2, kv_usage=0.5)


def test_the_current_usage_name_wins_and_the_old_one_stands_in_when_it_is_invalid() -> None:
    counts = "vllm:num_requests_waiting 0\nvllm:num_requests_running 1\n"
    both = counts + "vllm:kv_cache_usage_perc 0.25\nvllm:gpu_cache_usage_perc 0.75\n"
    assert signals(both) == EngineSignals(0, 1, 0.25)
    bad_new = counts + "vllm:kv_cache_usage_perc 7\nvllm:gpu_cache_usage_perc 0.75\n"
    assert signals(bad_new) == EngineSignals(0, 1, 0.75)


@pytest.mark.parametrize("mirror", ["tp_rank", "pp_rank", "moe_ep_rank", "pid"])
def test_series_differing_only_in_a_mirror_label_are_one_queue_its_largest(mirror: str) -> None:
    body = "".join(
        f'vllm:num_requests_waiting{{engine="0",{mirror}="{i}"}} {w}\n'
        f'vllm:num_requests_running{{engine="0",{mirror}="{i}"}} {r}\n'
        f'vllm:kv_cache_usage_perc{{engine="0",{mirror}="{i}"}} {u}\n'
        for i, (w, r, u) in enumerate([(3, 5, 0.2), (4, 5, 0.6), (2, 1, 0.4)])
    )
    assert signals(body) == EngineSignals(waiting=4, running=5, kv_usage=0.6)


def test_series_of_other_models_or_engines_add_up_and_usage_is_their_mean() -> None:
    body = (
        'vllm:num_requests_waiting{model_name="a"} 1\nvllm:num_requests_waiting{model_name="b"} 2\n'
        'vllm:num_requests_running{model_name="a"} 3\nvllm:num_requests_running{model_name="b"} 4\n'
        'vllm:kv_cache_usage_perc{model_name="a"} 0.1\nvllm:kv_cache_usage_perc{model_name="b"} 0.3\n'
    )
    s = signals(body)
    assert s is not None and (s.waiting, s.running) == (3, 7) and s.kv_usage == pytest.approx(0.2)


def test_counts_are_rounded_after_adding_and_bounded_by_max_count() -> None:
    fractional = 'vllm:num_requests_waiting{e="0"} 1.4\nvllm:num_requests_waiting{e="1"} 1.4\n'
    assert signals(fractional + "vllm:num_requests_running 0\n") == EngineSignals(3, 0)  # 2.8, not 1 + 1
    at_bound = f"vllm:num_requests_waiting {MAX_COUNT}\nvllm:num_requests_running 0\n"
    assert signals(at_bound) == EngineSignals(int(MAX_COUNT), 0)
    assert signals(f"vllm:num_requests_waiting {MAX_COUNT * 2}\nvllm:num_requests_running 0\n") is None
    assert signals("vllm:num_requests_waiting -0.0\nvllm:num_requests_running 0\n") == EngineSignals(0, 0)


def test_usage_bounds_are_inclusive_and_one_bad_series_drops_it() -> None:
    counts = "sglang:num_queue_reqs 0\nsglang:num_running_reqs 0\n"
    assert signals(counts + "sglang:token_usage 1\n") == EngineSignals(0, 0, 1.0)
    mixed = counts + 'sglang:token_usage{dp_rank="0"} 0.5\nsglang:token_usage{dp_rank="1"} +Inf\n'
    assert signals(mixed) == EngineSignals(0, 0, None)  # counts kept, usage unknown


def test_engine_signals_reads_an_exposition_parsed_in_full() -> None:
    expo = parse_exposition("other 1\nvllm:num_requests_waiting 2\nvllm:num_requests_running 3\n")
    assert engine_signals(expo) == EngineSignals(2, 3)
    _, wanted = read_signals("other 1\nvllm:num_requests_waiting 2\nvllm:num_requests_running 3\n")
    assert {s.name for s in wanted.samples} == {"vllm:num_requests_waiting", "vllm:num_requests_running"}


PREFILL = (
    'vllm:request_prefill_time_seconds_count{{tp_rank="{r}"}} {n}\n'
    'vllm:request_prefill_time_seconds_sum{{tp_rank="{r}"}} {s}\n'
    'vllm:request_prefill_kv_computed_tokens_count{{tp_rank="{r}"}} {n}\n'
    'vllm:request_prefill_kv_computed_tokens_sum{{tp_rank="{r}"}} {t}\n'
)


def test_prefill_totals_take_mirror_series_once() -> None:
    body = PREFILL.format(r=0, n=4, s=2.0, t=800) + PREFILL.format(r=1, n=4, s=2.0, t=800)
    assert prefill_totals(parse_exposition(body)) == PrefillTotals(4.0, 2.0, 800.0)
    assert prefill_totals(parse_exposition(PREFILL.format(r=0, n=4, s=2.0, t=1e15))) is None  # not a plausible count


def test_a_reading_since_an_equal_one_is_empty_not_refused() -> None:
    t = PrefillTotals(3.0, 1.5, 900.0)
    assert t.since(t) == PrefillTotals(0.0, 0.0, 0.0)
    assert PrefillTotals(3.0, 1.0, 900.0).since(PrefillTotals(2.0, 1.5, 100.0)) is None  # one counter went back
