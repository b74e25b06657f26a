"""Anthropic cache_control injection: one marker on the last system block of a native Anthropic request,
untouched when the caller marked anything, bounded and total on bad input."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from picker.request.anthropic import count_markers, inject_cache_control, injection_wanted, is_native_anthropic

EPH = {"type": "ephemeral"}


def body(**fields: Any) -> bytes:
    base: dict[str, Any] = {"model": "claude-x", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]}
    base.update(fields)
    return orjson.dumps(base)


def test_native_anthropic_paths() -> None:
    assert is_native_anthropic("/v1/messages")
    assert is_native_anthropic("/anthropic/v1/messages?beta=true")
    assert not is_native_anthropic("/v1/chat/completions")
    assert not is_native_anthropic("/v1/messages/count_tokens")
    assert not is_native_anthropic("/v1/completions")


def test_flag_precedence() -> None:
    assert injection_wanted(True, False)  # the fleet flag forces injection over a backend's false
    assert injection_wanted(False, True)
    assert not injection_wanted(False, None)  # engines carry no per-backend setting: the flag decides
    assert not injection_wanted(False, False)


def test_one_marker_on_the_last_system_block() -> None:
    blocks = [{"type": "text", "text": "You are terse."}, {"type": "text", "text": "Docs: ..."}]
    out = inject_cache_control(body(system=blocks))
    assert out is not None
    data = orjson.loads(out)
    assert data["system"][0] == blocks[0]
    assert data["system"][1] == {"type": "text", "text": "Docs: ...", "cache_control": EPH}
    assert count_markers(out) == 1
    # every other field kept, in the same order
    original = orjson.loads(body(system=blocks))
    assert list(data) == list(original)
    assert {k: v for k, v in data.items() if k != "system"} == {k: v for k, v in original.items() if k != "system"}


def test_string_system_becomes_one_marked_text_block() -> None:
    out = inject_cache_control(body(system="You are a helpful assistant."))
    assert out is not None
    assert orjson.loads(out)["system"] == [
        {"type": "text", "text": "You are a helpful assistant.", "cache_control": EPH}
    ]
    assert count_markers(out) == 1


@pytest.mark.parametrize(
    "fields",
    [
        {"system": [{"type": "text", "text": "a", "cache_control": EPH}, {"type": "text", "text": "b"}]},
        {
            "system": "s",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "q", "cache_control": EPH}]}],
        },
        {"system": "s", "tools": [{"name": "t", "input_schema": {"type": "object"}, "cache_control": EPH}]},
        {"system": "s", "cache_control": EPH},  # top-level automatic caching
    ],
    ids=["system", "messages", "tools", "top-level"],
)
def test_requests_with_markers_are_untouched(fields: dict[str, Any]) -> None:
    assert inject_cache_control(body(**fields)) is None


def test_the_word_cache_control_in_text_is_not_a_marker() -> None:
    out = inject_cache_control(
        body(system="explain cache_control", messages=[{"role": "user", "content": "cache_control?"}])
    )
    assert out is not None and count_markers(out) == 1


@pytest.mark.parametrize(
    "fields",
    [{}, {"system": None}, {"system": ""}, {"system": []}, {"system": [{"type": "text", "text": ""}]}, {"system": [1]}],
    ids=["absent", "null", "empty-string", "empty-list", "empty-text-block", "not-a-block"],
)
def test_nothing_to_mark_is_unchanged(fields: dict[str, Any]) -> None:
    assert inject_cache_control(body(**fields)) is None


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"not json",
        b'{"system": "s", "model": ',
        b'["system"]',
        b'"system"',
        b'{"system":"\\ud800"}',  # lone surrogate
        b'{"system":"s","n":1e400}',
        b'{"system":"s","big":18446744073709551616}',  # beyond 64 bits: orjson would lose digits
        b"[" * 100_000 + b"]" * 100_000,  # nesting beyond orjson's limit
        b"\xff\xfe{}",
    ],
)
def test_malformed_bodies_never_raise(raw: bytes) -> None:
    assert inject_cache_control(raw) is None


def test_body_over_the_bound_is_not_parsed() -> None:
    big = body(system="s" * 10_000)
    assert inject_cache_control(big, max_body_bytes=len(big) - 1) is None
    assert inject_cache_control(big, max_body_bytes=len(big)) is not None


def test_deep_but_valid_bodies_are_walked_without_recursion() -> None:
    deep: Any = {"cache_control": EPH}
    for _ in range(100):
        deep = {"x": [deep]}
    assert inject_cache_control(body(system="s", metadata=deep)) is None
    leaf = b'"leaf"'
    for _ in range(100):
        leaf = b'{"x":[' + leaf + b"]}"
    out = inject_cache_control(b'{"model":"m","system":"s","metadata":' + leaf + b"}")
    assert out is not None and count_markers(out) == 1
    # parses (orjson reads 1024 levels) but cannot be written back (orjson writes 254): unchanged, no raise
    too_deep = b"[" * 300 + b"]" * 300
    assert inject_cache_control(b'{"model":"m","system":"s","metadata":' + too_deep + b"}") is None


def test_values_keep_their_meaning() -> None:
    raw = b'{"model":"m","system":"caf\\u00e9","temperature":1E-1,"max_tokens":1.0e3,"z":[1,2.5,-0.0,null,true]}'
    out = inject_cache_control(raw)
    assert out is not None
    before, after = orjson.loads(raw), orjson.loads(out)
    assert after["system"] == [{"type": "text", "text": "café", "cache_control": EPH}]
    del before["system"], after["system"]
    assert before == after and list(before) == list(after)
