"""Workload generators and the trace format."""

from __future__ import annotations

import itertools
import json
import random
from collections import Counter
from pathlib import Path

import pytest

from benchmarks.engine_sim.tokenizer import chat_token_ids, encode
from benchmarks.trace import CHAT_PATH, TraceError, TraceRecord, read_trace, write_trace
from benchmarks.workloads import (
    chat_skew,
    hot_documents,
    multi_turn_chat,
    poisson_arrivals,
    prefix_repetition,
    ramp_arrivals,
    shared_prefix_groups,
    zipf_weights,
)


def test_prefix_repetition_follows_vllm_semantics() -> None:
    records = prefix_repetition(32, 8, 5, num_prefixes=3, prompts_per_prefix=4, rate=10.0, seed=7)
    assert len(records) == 12
    prompts = [r.body["prompt"] for r in records]
    assert all(len(encode(p)) == 40 for p in prompts)
    prefixes = Counter(" ".join(p.split()[:32]) for p in prompts)
    assert sorted(prefixes.values()) == [4, 4, 4]
    assert len({" ".join(p.split()[32:]) for p in prompts}) == 12
    assert all(r.body["max_tokens"] == 5 and r.body["temperature"] == 0 for r in records)
    times = [r.t for r in records]
    assert times == sorted(times) and times[0] > 0
    assert prefix_repetition(32, 8, 5, 3, 4, rate=10.0, seed=7) == records  # fixed seed: same trace
    unshuffled = prefix_repetition(32, 8, 5, 3, 4, seed=7, shuffle=False)
    assert [r.body["prompt"].split()[:32] for r in unshuffled[:4]].count(unshuffled[0].body["prompt"].split()[:32]) == 4


def test_shared_prefix_groups() -> None:
    records = shared_prefix_groups(3, 5, shared_len=20, unique_len=4, output_len=2, seed=1)
    assert len(records) == 15
    by_group = Counter(r.body["messages"][0]["content"] for r in records)
    assert sorted(by_group.values()) == [5, 5, 5]


def test_multi_turn_history_grows_and_is_a_token_prefix() -> None:
    records = multi_turn_chat(
        4,
        ["sys one", "sys two"],
        turns=(3, 5),
        user_len=6,
        output_len=4,
        session_rate=2.0,
        turn_gap_s=0.5,
        seed=3,
    )
    sessions: dict[str, list[TraceRecord]] = {}
    for r in records:
        assert r.session is not None and r.path == CHAT_PATH
        sessions.setdefault(r.session, []).append(r)
    assert len(sessions) == 4
    for turns in sessions.values():
        assert 3 <= len(turns) <= 5
        assert [r.turn for r in turns] == list(range(len(turns)))
        for prev, cur in itertools.pairwise(turns):
            assert cur.t == pytest.approx(prev.t + 0.5)
            pm, cm = prev.body["messages"], cur.body["messages"]
            assert len(cm) == len(pm) + 2 and cm[: len(pm)] == pm
            assert cm[len(pm)]["role"] == "assistant" and len(encode(cm[len(pm)]["content"])) == 4
            prev_ids, cur_ids = chat_token_ids(pm, add_generation_prompt=True), chat_token_ids(cm)
            assert cur_ids[: len(prev_ids)] == prev_ids  # history overlap: the cache can reuse it


def test_zipf_and_chat_skew() -> None:
    weights = zipf_weights(64, 1.1)
    assert sum(weights) == pytest.approx(1.0) and weights[0] > weights[1] > weights[63]
    records = chat_skew(num_sessions=30, num_system_prompts=8, system_len=(20, 40), user_len=3, output_len=2, seed=2)
    systems = {r.body["messages"][0]["content"] for r in records}
    assert all(20 <= len(s.split()) <= 40 for s in systems)
    firsts = [r for r in records if r.turn == 0]
    assert len(firsts) == 30
    popularity = Counter(r.extra["system_prompt"] for r in firsts)
    assert popularity.most_common(1)[0][0] in (0, 1, 2)


def test_hot_documents_shape_and_determinism() -> None:
    records = hot_documents(num_requests=400, num_docs=3, doc_len=(200, 300), zipf_s=1.2, question_len=(5, 9),
                            output_len=7, rate=20.0, seed=5)  # fmt: skip
    assert len(records) == 400
    assert records == hot_documents(400, 3, (200, 300), 1.2, (5, 9), 7, 20.0, seed=5)  # fixed seed: same trace
    assert records != hot_documents(400, 3, (200, 300), 1.2, (5, 9), 7, 20.0, seed=6)
    times = [r.t for r in records]
    assert times == sorted(times) and times[0] > 0
    assert 400 / times[-1] == pytest.approx(20.0, rel=0.25)
    docs: dict[int, set[str]] = {}
    questions = []
    for r in records:
        assert r.path == CHAT_PATH and r.body["max_tokens"] == 7 and r.body["stream"] is True
        system, user = r.body["messages"]
        assert system["role"] == "system" and user["role"] == "user"
        assert 200 <= len(encode(system["content"])) <= 300 and 5 <= len(encode(user["content"])) <= 9
        docs.setdefault(r.extra["doc"], set()).add(system["content"])
        questions.append(user["content"])
    assert sorted(docs) == [0, 1, 2] and all(len(texts) == 1 for texts in docs.values())  # one text per doc
    assert len(set(questions)) == 400  # every question is its own
    counts = Counter(r.extra["doc"] for r in records)
    assert counts[0] > counts[1] > counts[2]  # Zipf skew: rank 0 is the hottest
    assert counts[0] / 400 == pytest.approx(zipf_weights(3, 1.2)[0], abs=0.06)
    # the document is a token prefix of its requests (what a cache can reuse), the question is not
    ids = [chat_token_ids(r.body["messages"]) for r in records if r.extra["doc"] == 0][:2]
    doc_tokens = len(chat_token_ids([records[0].body["messages"][0]]))
    assert ids[0][: doc_tokens - 1] == ids[1][: doc_tokens - 1] and ids[0] != ids[1]


def test_arrivals() -> None:
    rng = random.Random(0)
    times = poisson_arrivals(2000, 50.0, rng)
    assert times == sorted(times) and 2000 / times[-1] == pytest.approx(50.0, rel=0.1)
    assert poisson_arrivals(3, float("inf"), rng) == [0.0, 0.0, 0.0]
    ramp = ramp_arrivals(4000, 10.0, 100.0, random.Random(1))
    assert ramp == sorted(ramp)
    first, last = ramp[:400], ramp[-400:]
    assert 400 / (first[-1] - first[0]) < 400 / (last[-1] - last[0])  # the rate grows


def test_trace_round_trip_and_tolerant_reading(tmp_path: Path) -> None:
    records = multi_turn_chat(2, ["s"], turns=(3, 3), user_len=2, output_len=2, seed=0)
    path = tmp_path / "trace.jsonl"
    assert write_trace(path, records) == 6
    assert read_trace(path) == records
    foreign = tmp_path / "foreign.jsonl"
    foreign.write_text(
        json.dumps({"t": 2, "body": {"prompt": "x"}, "session": 5, "note": "kept"})
        + "\n\n"
        + json.dumps({"body": {"messages": []}})
        + "\n"
    )
    first, second = read_trace(foreign)
    assert first.t == 0.0 and first.path == CHAT_PATH
    assert second.path == "/v1/completions" and second.session == "5" and second.extra == {"note": "kept"}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"t": 1, "body": {}}\n{"t": -1, "body": {}}\n')
    with pytest.raises(TraceError, match=r"bad\.jsonl:2"):
        read_trace(bad)
