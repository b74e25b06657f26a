"""The response grammar as pure functions: SSE parsing per the living standard (line endings, field forms, event
types that reset), the replay's round trip, and "finished" per API with choices tracked by index."""

from __future__ import annotations

import orjson
from hypothesis import given
from hypothesis import strategies as st

from picker.cache.grammar import complete_stream, finished_body, finished_stream, sse_events, sse_replay

# an event type: one line of text; data: lines of bytes without CR or LF (joined with LF: multi-line data)
kinds = st.none() | st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\r\n"), max_size=10)
data_lines = st.lists(st.binary(max_size=12).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b"")), min_size=1)
events = st.lists(st.tuples(kinds, data_lines.map(b"\n".join)), min_size=1, max_size=5)


@given(evs=events)
def test_a_replayed_stream_parses_back_to_its_events(evs: list[tuple[str | None, bytes]]) -> None:
    assert sse_events(sse_replay(evs)) == evs


@given(evs=events, ending=st.sampled_from([b"\r\n", b"\r"]))
def test_every_line_ending_parses_alike(evs: list[tuple[str | None, bytes]], ending: bytes) -> None:
    assert sse_events(sse_replay(evs).replace(b"\n", ending)) == evs


def test_field_forms_and_what_is_ignored() -> None:
    raw = (
        b":comment\n"
        b"id: 1\nretry: 10\nunknown: x\n"
        b"data\n"  # no colon: the field's value is empty
        b"data:no-space\n"
        b"data:  two spaces\n\n"  # only one leading space is dropped
    )
    assert sse_events(raw) == [(None, b"\nno-space\n two spaces")]


def test_an_event_type_without_data_is_not_dispatched_and_does_not_leak() -> None:
    assert sse_events(b"event: ping\n\ndata: x\n\n") == [(None, b"x")]
    assert sse_events(b"event: a\nevent: b\ndata: x\n\n") == [("b", b"x")]  # the last type wins


def test_bodies_that_are_not_a_complete_stream() -> None:
    assert sse_events(b"") is None
    assert sse_events(b": only a comment\n\n") is None  # no event at all
    assert sse_events(b"data: x\n\ndata: y") is None  # the last event is cut
    assert sse_events(b"data: x\n") is None
    assert sse_events(b"event: \xff\ndata: x\n\n") is None  # an event type that is not UTF-8


def test_replay_writes_one_data_line_per_line() -> None:
    assert sse_replay([("delta", b"a\nb"), (None, b"")]) == b"event: delta\ndata: a\ndata: b\n\ndata: \n\n"


def test_a_stream_is_complete_only_as_its_api_ends_one() -> None:
    done = [(None, b"{}"), (None, b" [DONE] ")]
    assert complete_stream("chat", done) and complete_stream("completions", done)
    assert not complete_stream("chat", [(None, b"[DONE]"), (None, b"{}")])  # [DONE] must be last
    assert not complete_stream("anthropic", done)
    assert complete_stream("anthropic", [("message_stop", b"{}"), ("ping", b"{}")])


def chunk(*choices: dict[str, object]) -> tuple[None, bytes]:
    return (None, orjson.dumps({"choices": list(choices)}))


DONE = (None, b"[DONE]")


def test_a_stream_tracks_each_choice_index_by_its_last_non_null_reason() -> None:
    stop0 = chunk({"index": 0, "finish_reason": "stop"})
    null0 = chunk({"index": 0, "finish_reason": None})
    assert finished_stream("chat", [null0, stop0, null0, DONE])  # a null after the reason does not undo it
    assert not finished_stream("chat", [stop0, chunk({"index": 1, "finish_reason": None}), DONE])
    assert finished_stream("chat", [chunk({"finish_reason": "length"}), DONE])  # no index: choice 0
    assert not finished_stream("chat", [chunk({"index": True, "finish_reason": "stop"}), DONE])
    assert not finished_stream("chat", [stop0, chunk("not a choice"), DONE])  # type: ignore[arg-type]
    assert not finished_stream("chat", [stop0, (None, b'{"choices":{"0":{}}}'), DONE])
    assert not finished_stream("chat", [stop0, (None, b"[1]"), DONE])  # an event that is not an object
    assert not finished_stream("chat", [stop0, ("error", b"{}"), DONE])
    assert not finished_stream("responses", [stop0, DONE])


def test_an_anthropic_stream_needs_a_finished_message_delta() -> None:
    stop = ("message_stop", b'{"type":"message_stop"}')
    delta = ("message_delta", b'{"type":"message_delta","delta":{"stop_reason":"stop_sequence"}}')
    assert finished_stream("anthropic", [delta, stop])
    wrong_type = ("message_delta", b'{"type":"content_block_delta","delta":{"stop_reason":"end_turn"}}')
    assert not finished_stream("anthropic", [wrong_type, stop])  # only a message_delta object counts
    assert not finished_stream("anthropic", [delta, (None, b"not json"), stop])
    assert not finished_stream("anthropic", [delta])  # no message_stop: not complete


def test_a_body_is_finished_per_api() -> None:
    ok = {"choices": [{"index": 0, "finish_reason": "stop"}, {"finish_reason": "tool_calls"}]}
    assert finished_body("chat", orjson.dumps(ok))
    assert not finished_body("chat", orjson.dumps({**ok, "error": None}))  # an error key at all is an error object
    assert not finished_body("chat", orjson.dumps({"choices": [{"index": 0, "finish_reason": "stop", "error": "x"}]}))
    assert not finished_body("chat", orjson.dumps({"choices": [{"index": 0.0, "finish_reason": "stop"}]}))
    assert finished_body("anthropic", b'{"stop_reason":"tool_use"}')
    assert not finished_body("anthropic", b'{"stop_reason":"end_turn","type":"error"}')
    assert not finished_body("other", orjson.dumps(ok))
    assert not finished_body("chat", b"")
