"""ResponseStorer driven directly (headers, body chunks, end) over a real MemoryCacheStore: what is stored and
how (allow-listed headers, a stream's replay, the semantic copy and its link), why a response is not stored,
and the shared buffer count returning to zero whatever the outcome."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import pytest

from picker.cache import CacheStoreError, storing
from picker.cache.entry import CacheEntry
from picker.cache.state import CacheState, SemanticPending
from picker.cache.store import MemoryCacheStore
from picker.cache.storing import ResponseStorer
from picker.cache.vectors import SemanticIndex, normalize
from picker.config import ResponseCacheConfig
from picker.facts import RequestFacts

OK = b'{"choices":[{"index":0,"message":{"content":"hi"},"finish_reason":"stop"}]}'
STREAM = b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\r\n\r\ndata: [DONE]\r\n\r\n'
HEADERS = (("content-type", "application/json"), ("x-request-id", "r1"), ("set-cookie", "s=1"))


@dataclass
class Ex:
    """A CachedExchange: the request's facts and its cache state."""

    facts: RequestFacts
    cache: CacheState | None


class RecordingStore(MemoryCacheStore):
    def __init__(self) -> None:
        super().__init__(100)
        self.ttls: dict[str, float] = {}
        self.fail = False
        self.gate: asyncio.Event | None = None

    async def set(self, key: str, value: bytes, ttl_seconds: float) -> None:
        if self.gate is not None:
            await self.gate.wait()
        if self.fail:
            raise CacheStoreError("down")
        self.ttls[key] = ttl_seconds
        await super().set(key, value, ttl_seconds)


def cfg(**kw: object) -> ResponseCacheConfig:
    return ResponseCacheConfig.model_validate({"enabled": True, **kw})


def exchange(stream: bool = False, headers: tuple[tuple[str, str], ...] = HEADERS, **state: object) -> Ex:
    return Ex(
        RequestFacts(api="chat", model="m", stream=stream), CacheState("MISS", key="k1", headers=headers, **state)
    )


def respond(storer: ResponseStorer, ex: Ex, chunks: list[bytes], status: int = 200, completed: bool = True) -> None:
    storer.on_headers(ex, status)
    for i, c in enumerate(chunks):
        storer.on_body(ex, c, i == len(chunks) - 1)
    storer.on_end(ex, completed)


async def test_a_finished_200_is_stored_with_the_allow_listed_headers_only() -> None:
    store = RecordingStore()
    storer = ResponseStorer(cfg(ttl=42), store)
    ex = exchange()
    respond(storer, ex, [OK[:10], OK[10:]])
    await storer.flush()
    raw = await store.get("k1")
    assert raw is not None
    assert CacheEntry.decode(raw) == CacheEntry(200, (("content-type", "application/json"),), OK)
    assert store.ttls == {"k1": 42.0} and storer.stored == 1
    assert storer.miss_bodies == {"reached": 1, "missing": 0} and storer.buffered == 0


async def test_a_stream_is_stored_as_its_standard_replay() -> None:
    store = RecordingStore()
    storer = ResponseStorer(cfg(), store)
    respond(storer, exchange(stream=True), [STREAM])
    await storer.flush()
    raw = await store.get("k1")
    assert raw is not None
    entry = CacheEntry.decode(raw)
    assert entry.stream and entry.body == STREAM.replace(b"\r\n", b"\n")


@pytest.mark.parametrize(
    ("headers", "why"),
    [
        pytest.param((("content-encoding", "br"),), "encoded", id="encoded"),
        pytest.param((("cache-control", "public, NO-STORE"),), "no_store", id="no-store"),
        pytest.param((("cache-control", 'private="x-user"'),), "no_store", id="private-with-a-value"),
        pytest.param((("content-length", "101"),), "too_large", id="declared-too-large"),
    ],
)
async def test_responses_refused_at_their_headers_are_never_buffered(
    headers: tuple[tuple[str, str], ...], why: str
) -> None:
    storer = ResponseStorer(cfg(max_response_size=100), RecordingStore())
    ex = exchange(headers=headers)
    storer.on_headers(ex, 200)
    assert ex.cache is not None and ex.cache.buf is None
    assert storer.not_stored == {why: 1}


async def test_identity_encoding_and_a_cacheable_control_are_stored() -> None:
    store = RecordingStore()
    storer = ResponseStorer(cfg(), store)
    respond(storer, exchange(headers=(("content-encoding", " Identity "), ("cache-control", "max-age=60"))), [OK])
    await storer.flush()
    assert await store.get("k1") is not None and storer.not_stored == {}


async def test_why_a_response_is_not_stored_and_the_buffer_count_returns_to_zero() -> None:
    storer = ResponseStorer(cfg(max_response_size=len(OK)), RecordingStore())
    respond(storer, exchange(), [OK], status=500)
    respond(storer, exchange(), [OK, b" "])  # one byte over the bound
    respond(storer, exchange(), [b'{"choices":[{"index":0,"finish_reason":null}]}'])
    cut = exchange()
    storer.on_headers(cut, 200)
    storer.on_body(cut, OK, False)  # no end_of_stream: body mode none, or cut
    storer.on_end(cut, True)
    aborted = exchange()
    storer.on_headers(aborted, 200)
    storer.on_body(aborted, OK, True)
    storer.on_end(aborted, False)  # the client went away: tells nothing about the body mode
    await storer.flush()
    assert storer.not_stored == {"status": 1, "too_large": 1, "unfinished": 1, "incomplete": 2}
    assert storer.miss_bodies == {"reached": 3, "missing": 1}  # every whole body reached; the cut one did not
    assert storer.buffered == 0 and storer.stored == 0


async def test_exchanges_without_an_eligible_miss_are_ignored() -> None:
    storer = ResponseStorer(cfg(), RecordingStore())
    for ex in (Ex(RequestFacts(api="chat", model="m"), None), Ex(RequestFacts(api="chat"), CacheState("BYPASS"))):
        respond(storer, ex, [OK])
    assert storer.not_stored == {} and storer.miss_bodies == {"reached": 0, "missing": 0}


async def test_a_semantic_miss_stores_a_linked_copy_then_indexes_its_vector() -> None:
    store = RecordingStore()
    index = SemanticIndex(max_entries=10, ttl_seconds=60, threshold=0.9)
    storer = ResponseStorer(cfg(ttl=300, semantic={"ttl": 120}), store, index)
    vector = normalize([1.0, 2.0])
    assert vector is not None
    missed_at = time.time()
    sem = SemanticPending("part", vector, "sem:abc", missed_at)
    respond(storer, exchange(semantic=sem), [OK])
    await storer.flush()
    exact, copy = await store.get("k1"), await store.get("sem:abc")
    assert exact is not None and copy is not None
    assert CacheEntry.decode(exact).link == "sem:abc"
    assert CacheEntry.decode(copy).origin == ("k1", missed_at)
    assert CacheEntry.decode(copy).answer(semantic=True).body == OK
    assert store.ttls["k1"] == 300.0 and 0 < store.ttls["sem:abc"] <= 120.0  # the copy lives 120 s from the miss
    match = index.lookup("part", vector)
    assert match is not None and match.key == "sem:abc"


async def test_a_semantic_copy_whose_ttl_passed_since_the_miss_is_not_written() -> None:
    store = RecordingStore()
    index = SemanticIndex(max_entries=10, ttl_seconds=60, threshold=0.9)
    storer = ResponseStorer(cfg(semantic={"ttl": 60}), store, index)
    sem = SemanticPending("part", (1.0,), "sem:old", time.time() - 61)
    respond(storer, exchange(semantic=sem), [OK])
    await storer.flush()
    assert await store.get("sem:old") is None and len(index) == 0
    assert await store.get("k1") is not None and storer.not_stored == {"expired": 1}


async def test_a_failed_copy_write_indexes_nothing_and_a_stream_gets_no_copy() -> None:
    store = RecordingStore()
    index = SemanticIndex(max_entries=10, ttl_seconds=60, threshold=0.9)
    storer = ResponseStorer(cfg(), store, index)
    store.fail = True
    respond(storer, exchange(semantic=SemanticPending("p", (1.0,), "sem:a")), [OK])
    await storer.flush()
    assert len(index) == 0 and storer.not_stored == {"store_error": 2}  # the copy, then the exact entry
    store.fail = False
    respond(storer, exchange(stream=True, semantic=SemanticPending("p", (1.0,), "sem:b")), [STREAM])
    await storer.flush()
    raw = await store.get("k1")
    assert raw is not None and CacheEntry.decode(raw).link is None and await store.get("sem:b") is None


async def test_writes_in_flight_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(storing, "MAX_PENDING_WRITES", 2)
    store = RecordingStore()
    store.gate = asyncio.Event()
    storer = ResponseStorer(cfg(), store)
    for _ in range(3):
        respond(storer, exchange(), [OK])
    assert storer.not_stored == {"writes_full": 1} and storer.buffered > 0  # two values held until written
    store.gate.set()
    await storer.flush()
    assert storer.stored == 2 and storer.buffered == 0


async def test_configure_applies_new_bounds_and_headers() -> None:
    store = RecordingStore()
    storer = ResponseStorer(cfg(), store)
    storer.configure(cfg(max_response_size=10, stored_headers=["x-request-id"]))
    respond(storer, exchange(), [OK])
    assert storer.not_stored == {"too_large": 1}
    storer.configure(cfg(stored_headers=["x-request-id"]))
    respond(storer, exchange(), [OK])
    await storer.flush()
    raw = await store.get("k1")
    assert raw is not None and CacheEntry.decode(raw).headers == (("x-request-id", "r1"),)


def test_the_semantic_ttl_defaults_to_the_ttl() -> None:
    assert ResponseStorer(cfg(ttl=77), RecordingStore()).semantic_ttl == 77.0
    assert ResponseStorer(cfg(ttl=77, semantic={"ttl": 5}), RecordingStore()).semantic_ttl == 5.0
