"""Response sampling: which responses are sampled (every opted-in one, and an evenly spread ``rate`` of the others),
how the usage is read from a response's last bytes, and what a read usage books (its own counters, and the
recorder's prediction check when Tier 4 tokenized the request)."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from picker.config import ExtProcConfig, PoolConfig
from picker.extproc.sampling import ResponseSampling, read_usage
from picker.facts import RequestFacts
from picker.kv.stage import KvCommit
from picker.ops.metrics import PickerMetrics
from picker.ops.recorder import DecisionRecorder
from picker.pool.pool import Pool
from picker.request.exchange import Exchange
from picker.routing.endpoints import Decision, Endpoint


def sampling(rate: float = 0.1, header: str = "x-kv-epp-sample") -> tuple[ResponseSampling, CollectorRegistry]:
    registry = CollectorRegistry()
    cfg = ExtProcConfig(response_sample_rate=rate, response_sample_header=header)
    return ResponseSampling(cfg, registry, DecisionRecorder(PickerMetrics()), block_size=16), registry


def sse(usage: dict[str, object] | None) -> bytes:
    return f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode()


def test_the_last_usage_object_in_the_tail_is_the_one_read() -> None:
    first = sse({"prompt_tokens": 5, "prompt_tokens_details": {"cached_tokens": 1}})
    last = sse({"prompt_tokens": 120, "prompt_tokens_details": {"cached_tokens": 96}})
    assert read_usage(first + last) == (120, 96)
    # cached_tokens is found wherever the server put it in the object, before prompt_tokens too
    assert read_usage(b'{"usage" : {"prompt_tokens_details":{"cached_tokens":8},"prompt_tokens":9}}') == (9, 8)


def test_a_usage_without_prompt_tokens_or_cut_short_is_no_usage() -> None:
    assert read_usage(b'{"usage":{"completion_tokens":3}}') is None
    assert read_usage(b'..."usage":{"completion_tokens":3,"prompt_tok') is None  # the tail cut through it
    assert read_usage(b'{"usage":null}') is None
    assert read_usage(b"") is None
    # an earlier complete usage is not taken for a later one without prompt_tokens
    assert read_usage(sse({"prompt_tokens": 4}) + b'"usage":{"total":1}') is None


def test_opted_in_responses_are_always_sampled_and_take_nothing_from_the_rate() -> None:
    s, _ = sampling(rate=0.5)
    s._credit = 0.0
    assert all(s.choose(opted_in=True) for _ in range(5))
    assert [s.choose(opted_in=False) for _ in range(4)] == [False, True, False, True]


@pytest.mark.parametrize(("rate", "expected"), [(0.0, 0), (1.0, 40)])
def test_rate_zero_samples_none_and_rate_one_samples_all(rate: float, expected: int) -> None:
    s, _ = sampling(rate)
    assert sum(s.choose(opted_in=False) for _ in range(40)) == expected


@given(rate=st.floats(0.01, 1.0), n=st.integers(1, 500))
def test_a_rate_samples_that_fraction_spread_evenly(rate: float, n: int) -> None:
    s, _ = sampling(rate)  # whatever the random start phase
    picks = [s.choose(opted_in=False) for _ in range(n)]
    assert abs(sum(picks) - n * rate) <= 1 + 1e-6
    hits = [i for i, p in enumerate(picks) if p]
    gaps = [b - a for a, b in itertools.pairwise(hits)]
    assert all(abs(g - 1 / rate) < 1 + 1e-6 for g in gaps)  # systematic: never bursts or long droughts


def test_the_opt_in_header_is_matched_lower_case_and_the_rate_is_exported() -> None:
    s, registry = sampling(rate=0.25, header="X-Sample-Me")
    assert s.header == "x-sample-me"
    assert registry.get_sample_value("kv_epp_response_sample_rate") == 0.25
    s.headers_seen(sampled=True)
    s.headers_seen(sampled=False)
    s.headers_seen(sampled=False)
    assert registry.get_sample_value("kv_epp_responses_observed_total", {"observed": "sampled"}) == 1
    assert registry.get_sample_value("kv_epp_responses_observed_total", {"observed": "headers"}) == 2


def test_a_usage_is_counted_only_when_it_reports_cached_tokens() -> None:
    s, registry = sampling()

    def tokens(kind: str) -> float | None:
        return registry.get_sample_value("kv_epp_sampled_usage_tokens_total", {"kind": kind})

    s.usage(sse({"prompt_tokens": 100}))  # cached unknown: not zero, not counted
    s.usage(b"no usage here")
    assert registry.get_sample_value("kv_epp_sampled_usage_responses_total") == 0
    assert (tokens("prompt"), tokens("cached")) == (0, 0)
    s.usage(sse({"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": 48}}))
    assert registry.get_sample_value("kv_epp_sampled_usage_responses_total") == 1
    assert (tokens("prompt"), tokens("cached")) == (100, 48)
    assert s.recorder.predictions == {}  # no exchange: nothing to check a prediction against


def exchange(kv: KvCommit | None) -> Exchange:
    pool = Pool(PoolConfig(backends=[{"name": "a", "address": "10.0.0.1:80"}]))
    ep = Endpoint("a", "10.0.0.1:80")
    ex = Exchange(RequestFacts(api="chat"), Decision(ep, "KvCost", "kv_cost"), pool.acquire(ep), (), ())
    ex.kv = kv
    return ex


def test_a_usage_of_a_tokenized_request_books_the_prediction_against_what_was_delivered() -> None:
    s, _ = sampling()
    usage = sse({"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": 0}})
    s.usage(usage, exchange(KvCommit(prompt_tokens=100, predicted_cached=64, available_cached=80)))
    assert s.recorder.predictions == {"kv_cost": [0, 1, 0, 0]}  # 64 predicted, none delivered: stale
    assert s.recorder.cached == {"kv_cost": [0, 0, 0, 100, 80, 64, 0]}  # observed scope only
    s.usage(usage, exchange(None))  # not tokenized: no prediction to check
    assert s.recorder.predictions == {"kv_cost": [0, 1, 0, 0]}
