"""Properties of the feed format (picker.shared.feed_records): records written with ``encode_record``
and fed to ``SseParser`` split at arbitrary points come back exactly as when fed whole, and as written;
the parser's buffers are bounded (``RecordTooLarge``) however the bytes are chunked."""

from __future__ import annotations

import itertools

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from picker.shared.feed_records import CLEAR, CLOSE, DEL, KEEPALIVE, PUT, RecordTooLarge, SseParser, encode_record

PROPS = settings(max_examples=100, deadline=None)
line_text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\r\n"), max_size=20)
events = st.one_of(st.sampled_from([PUT, DEL, CLEAR, CLOSE]), line_text.filter(bool))
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
records = st.tuples(
    events, st.dictionaries(st.text(max_size=8), json_values, max_size=4), st.none() | st.integers(0, 2**63 - 1)
)


def split(blob: bytes, cuts: list[int]) -> list[bytes]:
    points = [0, *sorted(c % (len(blob) + 1) for c in cuts), len(blob)]
    return [blob[a:b] for a, b in itertools.pairwise(points)]


def parse(chunks: list[bytes], max_bytes: int = 1 << 20) -> list[tuple[str, str, str | None]]:
    parser = SseParser(max_bytes)
    out = []
    for chunk in chunks:
        out.extend(parser.feed(chunk))
    return out


@st.composite
def streams(draw: st.DrawFn) -> tuple[list[tuple[str, dict[str, object], int | None]], bytes]:
    recs = draw(st.lists(records, max_size=6))
    parts = []
    for rec in recs:
        if draw(st.booleans()):
            parts.append(KEEPALIVE)
        parts.append(encode_record(*rec))
    return recs, b"".join(parts)


@PROPS
@given(streams(), st.lists(st.integers(0, 10_000), max_size=12))
def test_any_chunking_gives_the_records_written(stream: tuple[list, bytes], cuts: list[int]) -> None:
    recs, blob = stream
    whole = parse([blob])
    assert whole == [(e, orjson.dumps(d).decode(), None if i is None else str(i)) for e, d, i in recs]
    assert parse(split(blob, cuts)) == whole
    assert parse([blob[i : i + 1] for i in range(len(blob))]) == whole  # byte by byte


@PROPS
@given(st.integers(8, 64), st.integers(1, 200), st.lists(st.integers(0, 10_000), max_size=12))
def test_record_over_the_bound_raises_however_chunked(bound: int, excess: int, cuts: list[int]) -> None:
    blob = encode_record(PUT, {"k": "x" * (bound + excess)}, 1)  # data longer than the bound
    with pytest.raises(RecordTooLarge):
        parse(split(blob, cuts), max_bytes=bound)


@PROPS
@given(st.integers(8, 64), st.integers(1, 200), st.lists(st.integers(0, 10_000), max_size=12))
def test_line_without_newline_over_the_bound_raises_however_chunked(bound: int, excess: int, cuts: list[int]) -> None:
    blob = b": " + b"c" * (bound + excess)  # a comment line that never ends: the buffer must not grow forever
    with pytest.raises(RecordTooLarge):
        parse(split(blob, cuts), max_bytes=bound)


@PROPS
@given(streams(), st.lists(st.integers(0, 10_000), max_size=12))
def test_records_within_the_bound_parse_however_chunked(stream: tuple[list, bytes], cuts: list[int]) -> None:
    _, blob = stream
    bound = max((len(line) for line in blob.split(b"\n")), default=0) + 1  # every line and record fits
    assert parse(split(blob, cuts), max_bytes=bound) == parse([blob])
