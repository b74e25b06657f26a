"""The semantic cache parts: the partition digest (isolation), the bounded vector index, the embeddings
client against the real simulator and against servers that fail in each way.

The tests that start a server or bind a socket: tests/integration/test_semantic_http.py."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import aiohttp
import pytest

from benchmarks.engine_sim.embeddings import embed_text
from picker.cache.embeddings import EmbeddingsClient
from picker.cache.semantic import ENTRY_PREFIX, entry_key, partition_digest, semantic_query
from picker.cache.vectors import MAX_DIM, SemanticIndex, normalize
from picker.facts import caller_identity
from tests.support.embeddings_sim import EMB
from tests.support.semantic_index import (
    ALICE,
    NEAR,
    OTHER,
    QUESTION,
    SYSTEM,
    Clock,
    chat,
    embed,
    index,
    query,
    refused_url,
)

TOOLS = [{"type": "function", "function": {"name": "search_docs", "parameters": {"type": "object"}}}]


def digest(data: dict[str, Any], tenant: str | None = "t1", emb: str = EMB, identity: str | None = ALICE) -> str | None:
    return partition_digest(data, identity=identity, tenant_id=tenant, embedding_model=emb)


# -- the partition digest -------------------------------------------------------------------------------
def test_the_last_user_message_is_not_in_the_partition() -> None:
    a, b = query(chat(QUESTION)), query(chat(OTHER))
    assert a is not None and b is not None
    assert a.partition == b.partition and len(a.partition) == 64
    assert (a.text, b.text) == (QUESTION, OTHER)


@pytest.mark.parametrize(
    "changed",
    [
        {"messages": [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": QUESTION}]},
        {"messages": [{"role": "user", "content": QUESTION}]},  # no system prompt at all
        {
            "messages": [
                SYSTEM,
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"},
                {"role": "user", "content": QUESTION},
            ]
        },
        {"tools": TOOLS},
        {"tools": TOOLS, "tool_choice": "required"},
        {"response_format": {"type": "json_object"}},
        {"max_tokens": 16},
        {"top_p": 0.5},
        {"seed": 7},
        {"stop": ["\n"]},
        {"n": 2},
        {"logit_bias": {"50256": -100}},
        {"user": "end-user-2"},
        {"model": "m2"},
    ],
    ids=lambda c: ",".join(c),
)
def test_anything_else_that_differs_changes_the_partition(changed: dict[str, Any]) -> None:
    assert digest(chat(QUESTION, **changed)) != digest(chat(QUESTION))


def test_identity_and_embedding_model_change_the_partition() -> None:
    base = digest(chat(QUESTION))
    assert digest(chat(QUESTION), tenant="t2") != base
    assert digest(chat(QUESTION), tenant=None) != base
    assert digest(chat(QUESTION), tenant="") != digest(chat(QUESTION), tenant=None)
    assert digest(chat(QUESTION), emb="other-embedder") != base
    bob = caller_identity({"authorization": "Bearer sk-bob"}, "authorization")
    assert digest(chat(QUESTION), identity=bob) != base


def test_no_caller_identity_is_not_eligible() -> None:
    assert query(chat(QUESTION)) is not None
    assert query(chat(QUESTION), identity=None) is None
    assert query(chat(QUESTION), identity="") is None


def test_caller_identity_is_a_digest_of_the_credential_header() -> None:
    alice = caller_identity({"authorization": "Bearer sk-alice"}, "authorization")
    assert alice is not None and "sk-alice" not in alice and len(alice) == 64
    assert caller_identity({"authorization": "Bearer sk-bob"}, "authorization") != alice
    assert caller_identity({}, "authorization") is None
    assert caller_identity({"authorization": ""}, "authorization") is None
    # Anthropic's x-api-key stands in for an absent authorization, as another identity than the same value there
    key = caller_identity({"x-api-key": "Bearer sk-alice"}, "authorization")
    assert key is not None and key != alice
    assert caller_identity({"authorization": "Bearer sk-alice", "x-api-key": "k"}, "authorization") == alice
    # a configured gateway header: only it counts
    assert caller_identity({"authorization": "Bearer sk-alice"}, "x-user") is None
    assert caller_identity({"x-user": "alice"}, "x-user") not in (None, alice)


def test_same_meaning_same_partition() -> None:
    base = digest(chat(QUESTION, max_tokens=100, top_p=1))
    assert digest(chat(QUESTION, temperature=0.0, max_tokens=100.0, top_p=1.0)) == base
    assert digest(chat(QUESTION, max_tokens=100, top_p=1, stream=False, stream_options=None)) == base
    assert digest(chat(QUESTION, max_tokens=100, top_p=1, request_id="r-1", priority=3)) == base
    reordered = {"messages": chat(QUESTION)["messages"], "top_p": 1, "max_tokens": 100, "temperature": 0, "model": "m"}
    assert digest(reordered) == base


@pytest.mark.parametrize(
    ("data", "api"),
    [
        (chat(QUESTION, stream=True), "chat"),
        ({k: v for k, v in chat(QUESTION).items() if k != "temperature"}, "chat"),  # absent: engine default
        (chat(QUESTION, temperature=0.7), "chat"),
        (chat(QUESTION, temperature=False), "chat"),
        (chat(QUESTION), "anthropic"),
        (chat(QUESTION), "completions"),
        (chat(QUESTION, messages=[SYSTEM]), "chat"),  # the last turn is not a user turn
        (
            chat(QUESTION, messages=[{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "x"}]),
            "chat",
        ),
        (chat(QUESTION, messages=[{"role": "user", "content": ""}]), "chat"),
        (
            chat(
                QUESTION,
                messages=[
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "what is in this image?"},
                            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                        ],
                    }
                ],
            ),
            "chat",
        ),
        (chat(QUESTION, messages="not a list"), "chat"),
        (chat(QUESTION, model=None), "chat"),
    ],
)
def test_ineligible_requests(data: dict[str, Any], api: str) -> None:
    assert (
        semantic_query(data, path_api=api, identity=ALICE, tenant_id="t", embedding_model=EMB, max_input_bytes=8192)
        is None
    )


def test_text_parts_are_joined_and_the_byte_bound_counts_utf8() -> None:
    parts = chat(
        "", messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    )
    q = query(parts)
    assert q is not None and q.text == "a\nb"
    korean = "캐시" * 10  # 20 characters, 60 UTF-8 bytes
    assert query(chat(korean), max_input_bytes=60) is not None
    assert query(chat(korean), max_input_bytes=59) is None


def test_entry_keys_live_in_the_sem_key_space() -> None:
    p = digest(chat(QUESTION))
    assert p is not None
    k = entry_key(p, QUESTION)
    assert k.startswith(ENTRY_PREFIX) and len(k) == len(ENTRY_PREFIX) + 64
    assert entry_key(p, NEAR) != k and entry_key(p, QUESTION) == k


def test_near_duplicate_question_matches_through_the_digest() -> None:
    idx = index()
    q1 = query(chat(QUESTION))
    assert q1 is not None
    assert idx.add(q1.partition, embed_text(q1.text), entry_key(q1.partition, q1.text))
    q2 = query(chat(NEAR))
    assert q2 is not None and q2.partition == q1.partition
    match = idx.lookup(q2.partition, embed_text(q2.text))
    assert match is not None and match.key == entry_key(q1.partition, QUESTION)
    assert 0.92 <= match.similarity < 1.0
    assert idx.lookup(q2.partition, embed_text(OTHER)) is None  # unrelated question: a miss


@pytest.mark.parametrize(
    "changed",
    [
        {"messages": [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": NEAR}]},
        {"tools": TOOLS},
    ],
    ids=["system-prompt", "tool-list"],
)
def test_different_system_prompt_or_tools_never_match(changed: dict[str, Any]) -> None:
    idx = index()
    q1 = query(chat(QUESTION))
    assert q1 is not None
    idx.add(q1.partition, embed_text(q1.text), entry_key(q1.partition, q1.text))
    q2 = query(chat(NEAR, **changed))
    assert q2 is not None
    assert idx.lookup(q2.partition, embed_text(q2.text)) is None
    assert idx.lookup(q1.partition, embed_text(NEAR)) is not None  # the same question in the first partition hits


def test_best_entry_wins_and_threshold_is_inclusive() -> None:
    idx = index(threshold=0.5)
    idx.add("p", [1.0, 0.0], "far")
    idx.add("p", [1.0, 1.0], "near")
    match = idx.lookup("p", [1.0, 0.9])
    assert match is not None and match.key == "near"
    exact = index(threshold=0.6)
    exact.add("p", [0.6, 0.8], "k")
    hit = exact.lookup("p", [1.0, 0.0])  # cosine exactly 0.6
    assert hit is not None and math.isclose(hit.similarity, 0.6, abs_tol=1e-9)
    assert index(threshold=0.61).lookup("p", [1.0, 0.0]) is None


def test_max_entries_evicts_the_oldest_across_partitions() -> None:
    idx = index(max_entries=3, threshold=0.99)
    for i, p in enumerate(["a", "b", "a", "b"]):
        assert idx.add(p, [1.0, float(i)], f"k{i}")
    assert len(idx) == 3
    assert idx.lookup("a", [1.0, 0.0]) is None  # k0, the oldest, is gone
    hit = idx.lookup("a", [1.0, 2.0])
    assert hit is not None and hit.key == "k2"
    assert idx.snapshot().evicted == 1
    idx.configure(max_entries=1, ttl_seconds=300, threshold=0.99)  # a reload that shrinks evicts at once
    assert len(idx) == 1
    last = idx.lookup("b", [1.0, 3.0])
    assert last is not None and last.key == "k3"
    assert idx.snapshot().partitions == 1  # the emptied partition is dropped


def test_entries_expire_after_the_ttl() -> None:
    clock = Clock()
    idx = index(ttl=60, clock=clock)
    idx.add("p", [1.0, 0.0], "old")
    clock.now += 30
    idx.add("p", [0.0, 1.0], "new")
    assert idx.lookup("p", [1.0, 0.0]) is not None
    clock.now += 31  # "old" is 61 s old, "new" 31 s
    assert idx.lookup("p", [1.0, 0.0]) is None
    assert idx.lookup("p", [0.0, 1.0]) is not None
    assert len(idx) == 1 and idx.snapshot().expired == 1


def test_adding_a_key_again_replaces_its_vector() -> None:
    idx = index(threshold=0.99)
    idx.add("p", [1.0, 0.0], "k")
    idx.add("p", [0.0, 1.0], "k")
    assert len(idx) == 1
    assert idx.lookup("p", [1.0, 0.0]) is None
    idx.remove("k")
    assert len(idx) == 0 and idx.lookup("p", [0.0, 1.0]) is None


@pytest.mark.parametrize(
    "bad",
    [[], [0.0, 0.0], [1.0, float("nan")], [1.0, float("inf")], [True, 1.0], ["1"], "abc", None, [1.0] * (MAX_DIM + 1)],
    ids=["empty", "zero", "nan", "inf", "bool", "str-item", "str", "none", "too-long"],
)
def test_unusable_vectors_are_refused(bad: Any) -> None:
    idx = index()
    assert normalize(bad) is None
    assert not idx.add("p", bad, "k")
    assert idx.lookup("p", bad) is None
    assert len(idx) == 0


def test_vectors_of_another_dimension_are_skipped() -> None:
    idx = index(threshold=0.5)
    idx.add("p", [1.0, 0.0, 0.0], "three")
    assert idx.lookup("p", [1.0, 0.0]) is None


# -- the embeddings client ------------------------------------------------------------------------------


async def test_refused_connection_is_a_miss() -> None:
    async with aiohttp.ClientSession() as session:
        client = EmbeddingsClient(session)
        assert await embed(client, refused_url()) is None
        assert await embed(client, "not a url at all") is None
        await client.close()  # the caller's session is left open
        assert not session.closed
    assert client.stats.errors == {"connect": 2}


async def test_lookup_async_agrees_with_lookup_and_frees_the_loop() -> None:
    idx = index(max_entries=1000, threshold=0.92)
    texts = [f"{QUESTION} variant {i} about topic {i * 7}" for i in range(300)]
    for i, text in enumerate(texts):
        idx.add("p", embed_text(text), f"k{i}")
    probe = embed_text(texts[123].replace("three", "four"))
    expected = idx.lookup("p", probe)
    assert expected is not None and expected.key == "k123"

    ticks: list[int] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        while not stop.is_set():
            ticks.append(1)
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    before = len(ticks)
    try:
        got = await idx.lookup_async("p", probe, chunk=10)
    finally:
        stop.set()
        await task
    assert got == expected
    assert len(ticks) - before >= 10  # the other task ran between the 30 steps
    assert idx.snapshot().lookups == 2 and idx.snapshot().hits == 2


async def test_entries_dropped_during_an_async_scan_do_not_break_it() -> None:
    clock = Clock()
    idx = index(max_entries=100, ttl=60, threshold=0.99, clock=clock)
    for i in range(50):
        idx.add("p", [1.0, float(i)], f"k{i}")
    clock.now += 61  # all expired: the scan collects them

    async def meddle() -> None:
        await asyncio.sleep(0)
        idx.remove("k10")
        idx.add("p", [1.0, 10.0], "fresh")

    task = asyncio.create_task(meddle())
    assert await idx.lookup_async("p", [1.0, 10.0], chunk=5) is None  # the snapshot held only expired entries
    await task
    assert len(idx) == 1
    hit = idx.lookup("p", [1.0, 10.0])
    assert hit is not None and hit.key == "fresh"


# -- the index's byte and scan bounds (float32 storage) ----------------------------------------------------
def test_vectors_are_float32_and_max_bytes_evicts_the_oldest() -> None:
    dim = 1024
    idx = SemanticIndex(max_entries=100, ttl_seconds=300, threshold=0.9, max_bytes=3 * 4 * dim, clock=Clock())
    for i in range(3):
        assert idx.add("p", [1.0] * i + [2.0] + [0.0] * (dim - i - 1), f"k{i}")
    assert len(idx) == 3 and idx.nbytes == 3 * 4 * dim and idx.snapshot().bytes == 3 * 4 * dim
    assert idx.add("q", [0.0] * (dim - 1) + [1.0], "k3")  # one more: the oldest goes, whatever its partition
    assert len(idx) == 3 and idx.nbytes == 3 * 4 * dim and idx.snapshot().evicted == 1
    assert idx.lookup("p", [2.0] + [0.0] * (dim - 1)) is None  # k0 is gone
    assert idx.lookup("q", [0.0] * (dim - 1) + [1.0]) is not None
    idx.remove("k3")
    assert idx.nbytes == 2 * 4 * dim
    idx.configure(max_entries=100, ttl_seconds=300, threshold=0.9, max_bytes=4 * dim)  # smaller: evicts at once
    assert len(idx) == 1 and idx.nbytes == 4 * dim
    assert not idx.add("p", [1.0] * (dim + 1), "too-big")  # larger than the whole index: refused
    idx.clear()
    assert idx.nbytes == 0


def test_a_lookup_compares_only_the_partitions_most_recent_max_scan_entries() -> None:
    idx = SemanticIndex(max_entries=100, ttl_seconds=300, threshold=0.99, max_scan=2, clock=Clock())
    idx.add("p", [1.0, 0.0, 0.0], "old")  # the only match, but not among the 2 most recent
    idx.add("p", [0.0, 1.0, 0.0], "mid")
    idx.add("other", [1.0, 0.0, 0.0], "elsewhere")  # another partition: not counted in p's scan
    idx.add("p", [0.0, 0.0, 1.0], "new")
    assert idx.lookup("p", [1.0, 0.0, 0.0]) is None
    match = idx.lookup("p", [0.0, 0.0, 1.0])
    assert match is not None and match.key == "new"
    idx.configure(max_entries=100, ttl_seconds=300, threshold=0.99, max_scan=3)
    match = idx.lookup("p", [1.0, 0.0, 0.0])
    assert match is not None and match.key == "old" and match.similarity == pytest.approx(1.0)
