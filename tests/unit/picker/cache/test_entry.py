"""CacheEntry: the KVR1 codec (round trips, every refusal an EntryError), the link and origin pseudo-headers, and
the answer a hit gives (pseudo-headers never sent, the allow-list applied at replay)."""

from __future__ import annotations

import math
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from picker.cache.entry import (
    LINK_HEADER,
    MISSED_AT_HEADER,
    ORIGIN_HEADER,
    X_CACHE,
    X_CACHE_MODE,
    CacheEntry,
    EntryError,
)

# header names and values as the codec writes them: any text UTF-8 can carry (no lone surrogates)
text = st.text(st.characters(exclude_categories=("Cs",)), max_size=40)
headers = st.lists(st.tuples(text, text), max_size=6).map(tuple)


@given(headers=headers, body=st.binary(max_size=200), stream=st.booleans())
def test_an_entry_round_trips_through_its_codec(
    headers: tuple[tuple[str, str], ...], body: bytes, stream: bool
) -> None:
    entry = CacheEntry(200, headers, body, stream)
    assert CacheEntry.decode(entry.encode()) == entry


def test_the_encoding_is_the_documented_layout() -> None:
    raw = CacheEntry(200, (("ct", "é"),), b"BODY", stream=True).encode()
    assert (
        raw == b"KVR1" + struct.pack(">HBH", 200, 1, 1) + b"\x00\x02ct" + b"\x00\x00\x00\x02" + "é".encode() + b"BODY"
    )


def test_a_body_that_looks_like_headers_is_kept_whole() -> None:
    body = b"\x00\x02ab\x00\x00\x00\x01c" + b"KVR1"  # bytes after the last header are the body, whatever they are
    entry = CacheEntry(200, (), body)
    assert CacheEntry.decode(entry.encode()).body == body


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        pytest.param(b"", "magic", id="empty"),
        pytest.param(b"KVR2" + struct.pack(">HBH", 200, 0, 0), "magic", id="other-version"),
        pytest.param(b"KVR1\x00\xc8", "malformed", id="cut-in-the-fixed-part"),
        pytest.param(b"KVR1" + struct.pack(">HBH", 200, 0, 1) + b"\x00\x05ab", "malformed", id="cut-name"),
        pytest.param(
            b"KVR1" + struct.pack(">HBH", 200, 0, 1) + b"\x00\x01a\x00\x00\x00\x09xy", "truncated", id="cut-value"
        ),
        pytest.param(b"KVR1" + struct.pack(">HBH", 200, 0, 1) + b"\x00\x01a", "malformed", id="no-value-length"),
        pytest.param(
            b"KVR1" + struct.pack(">HBH", 200, 0, 1) + b"\x00\x01\xff\x00\x00\x00\x00", "malformed", id="name-not-utf8"
        ),
        pytest.param(CacheEntry(404, (), b"{}").encode(), "status 404", id="another-status"),
    ],
)
def test_bytes_that_are_not_an_entry_are_refused_with_the_reason(raw: bytes, message: str) -> None:
    with pytest.raises(EntryError, match=message):
        CacheEntry.decode(raw)


def test_only_the_stream_flag_bit_is_read() -> None:
    raw = bytearray(CacheEntry(200, (), b"x").encode())
    raw[6] = 0b11  # another flag bit set beside the stream bit
    assert CacheEntry.decode(bytes(raw)).stream is True
    raw[6] = 0b10
    assert CacheEntry.decode(bytes(raw)).stream is False


def test_link_names_the_semantic_copy_when_there_is_one() -> None:
    assert CacheEntry(200, (("content-type", "x"),), b"").link is None
    assert CacheEntry(200, ((LINK_HEADER, "sem:abc"), ("content-type", "x")), b"").link == "sem:abc"


def test_origin_needs_both_headers_and_a_finite_time() -> None:
    assert CacheEntry(200, (("content-type", "x"),), b"").origin is None  # an older version's copy
    both = CacheEntry(200, ((ORIGIN_HEADER, "k1"), (MISSED_AT_HEADER, repr(1700000000.25))), b"")
    assert both.origin == ("k1", 1700000000.25)
    for bad, message in (
        (((ORIGIN_HEADER, "k1"),), "only one"),
        (((MISSED_AT_HEADER, "1.0"),), "only one"),
        (((ORIGIN_HEADER, "k1"), (MISSED_AT_HEADER, "yesterday")), "not a number"),
        (((ORIGIN_HEADER, "k1"), (MISSED_AT_HEADER, "nan")), "not finite"),
        (((ORIGIN_HEADER, "k1"), (MISSED_AT_HEADER, "inf")), "not finite"),
    ):
        with pytest.raises(EntryError, match=message):
            _ = CacheEntry(200, bad, b"").origin


def test_a_hit_never_sends_pseudo_headers_and_says_hit() -> None:
    entry = CacheEntry(
        200,
        (("content-type", "application/json"), (LINK_HEADER, "sem:x"), (ORIGIN_HEADER, "k"), ("x-engine", "e1")),
        b'{"a":1}',
    )
    exact = entry.answer()
    assert (exact.status, exact.body, exact.details) == (200, b'{"a":1}', "kv_epp_response_cache_hit")
    assert exact.headers == (("content-type", "application/json"), ("x-engine", "e1"), (X_CACHE, "HIT"))
    semantic = entry.answer(semantic=True)
    assert semantic.details == "kv_epp_response_cache_semantic_hit"
    assert semantic.headers[-2:] == ((X_CACHE, "HIT"), (X_CACHE_MODE, "semantic"))
    assert not any(k.startswith(":") for k, _ in semantic.headers)


def test_a_hit_replays_only_the_names_allowed_now_case_insensitively() -> None:
    entry = CacheEntry(200, (("Content-Type", "text/plain"), ("x-old", "1")), b"")
    answer = entry.answer(allowed=frozenset({"content-type"}))
    assert answer.headers == (("Content-Type", "text/plain"), (X_CACHE, "HIT"))
    assert entry.answer(allowed=frozenset()).headers == ((X_CACHE, "HIT"),)


def test_a_missed_at_written_by_repr_reads_back_exactly() -> None:
    at = math.nextafter(1700000000.0, math.inf)  # a time whose shortest repr needs every digit
    entry = CacheEntry(200, ((ORIGIN_HEADER, "k"), (MISSED_AT_HEADER, repr(at))), b"")
    decoded = CacheEntry.decode(entry.encode()).origin
    assert decoded is not None and decoded[1] == at
