"""The response grammar the cache judges answers by: SSE parsing and replay (``sse_events``, ``sse_replay``) and
"finished" per API (``finished_body``, ``finished_stream``: only a finished answer is stored). Pure functions.
See docs/picker.md, "The response cache".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

_OPENAI_FINISHED = frozenset({"stop", "length", "tool_calls", "function_call"})
_ANTHROPIC_FINISHED = frozenset({"end_turn", "max_tokens", "stop_sequence", "tool_use"})
_OPENAI_STREAM_END = b"[DONE]"


def sse_events(raw: bytes) -> list[tuple[str | None, bytes]] | None:
    """The events of an SSE body as (event type or None, data), per the HTML living standard's parsing: lines
    end in CRLF, LF or CR; ``data:`` lines join with LF; one leading space after the colon is dropped; comments,
    ``id`` and ``retry`` are ignored; a blank line dispatches an event with data. None when the body does not
    end with a complete event (the last event has no blank line after it) or holds no event."""
    text = raw.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    if not text.endswith(b"\n\n"):
        return None
    events: list[tuple[str | None, bytes]] = []
    data: list[bytes] = []
    kind: str | None = None
    for line in text[:-1].split(b"\n"):
        if not line:
            if data:
                events.append((kind, b"\n".join(data)))
            data, kind = [], None
            continue
        name, colon, value = line.partition(b":")
        if not name:  # a comment
            continue
        if colon and value.startswith(b" "):
            value = value[1:]
        if name == b"data":
            data.append(value)
        elif name == b"event":
            try:
                kind = value.decode()
            except UnicodeDecodeError:
                return None
    if data:  # text ended with "\n\n": the last line was blank, so nothing is pending
        return None
    return events or None


def sse_replay(events: Sequence[tuple[str | None, bytes]]) -> bytes:
    """A synthetic SSE stream of ``events``: ``event: <type>`` when typed, one ``data:`` line per data line,
    a blank line after each event."""
    out: list[bytes] = []
    for kind, data in events:
        if kind is not None:
            out.append(b"event: " + kind.encode() + b"\n")
        for line in data.split(b"\n"):
            out.append(b"data: " + line + b"\n")
        out.append(b"\n")
    return b"".join(out)


def complete_stream(api: str, events: Sequence[tuple[str | None, bytes]]) -> bool:
    """The stream ended as the API ends one: OpenAI's ``data: [DONE]``, Anthropic's ``message_stop``."""
    if api == "anthropic":
        return any(kind == "message_stop" for kind, _ in events)
    return events[-1][1].strip() == _OPENAI_STREAM_END


def _is_error(obj: Any) -> bool:
    """An in-band error object (OpenAI/vLLM ``{"error": ...}`` or ``"object": "error"``, Anthropic ``"type":
    "error"``)."""
    return isinstance(obj, dict) and ("error" in obj or obj.get("object") == "error" or obj.get("type") == "error")


def _choice_index(c: Any) -> int | None:
    """A choice's ``index`` (0 when absent, as a single-choice answer may omit it); None when the choice is not an
    object, is an error object or has an index that is not an integer."""
    if not isinstance(c, dict) or _is_error(c):
        return None
    i = c.get("index", 0)
    return i if isinstance(i, int) and not isinstance(i, bool) else None


def _named(value: Any, names: frozenset[str]) -> bool:
    """``value`` is one of ``names`` (a list or an object from a broken engine is not: never hashed)."""
    return isinstance(value, str) and value in names


def finished_body(api: str, body: bytes) -> bool:
    """A non-streamed body that is a finished answer, strictly per API. A JSON object with no error object, and:
    chat and completions: a non-empty ``choices`` list whose every choice has a ``finish_reason`` in ``stop``,
    ``length``, ``tool_calls``, ``function_call`` (absent, null, vLLM's and SGLang's ``abort``, anything else: not
    finished); Anthropic: a ``stop_reason`` in ``end_turn``, ``max_tokens``, ``stop_sequence``, ``tool_use``
    (absent, null, ``refusal``, ``pause_turn``: not finished). Any other API: never."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    if not isinstance(obj, dict) or _is_error(obj):
        return False
    if api == "anthropic":
        return _named(obj.get("stop_reason"), _ANTHROPIC_FINISHED)
    if api not in ("chat", "completions"):
        return False
    choices = obj.get("choices")
    if not isinstance(choices, list) or not choices:
        return False
    return all(_choice_index(c) is not None and _named(c.get("finish_reason"), _OPENAI_FINISHED) for c in choices)


def finished_stream(api: str, events: Sequence[tuple[str | None, bytes]]) -> bool:
    """A complete stream (``complete_stream``) that ended well, strictly per API: every event's data JSON (but
    OpenAI's ``[DONE]``), no error event or object (vLLM's in-band ``data: {"error": ...}`` before ``[DONE]``), and:
    chat and completions: at least one choice seen, and for every choice index seen, the last non-null
    ``finish_reason`` it got is in ``finished_body``'s set (a ``choices`` that is not a list, or a malformed
    choice: not finished; an event without ``choices``, such as a usage chunk with ``[]``, adds nothing);
    Anthropic: a ``message_delta`` whose last non-null ``stop_reason`` is in ``finished_body``'s set."""
    if not complete_stream(api, events):
        return False
    anthropic = api == "anthropic"
    if not anthropic and api not in ("chat", "completions"):
        return False
    reasons: dict[int, Any] = {}  # choice index -> its last non-null finish_reason (None: none yet)
    stop_reason: Any = None
    for kind, data in events:
        if kind == "error":
            return False
        if not anthropic and data.strip() == _OPENAI_STREAM_END:
            continue
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            return False
        if not isinstance(obj, dict) or _is_error(obj):
            return False
        if anthropic:
            delta = obj.get("delta")
            if obj.get("type") == "message_delta" and isinstance(delta, dict) and delta.get("stop_reason") is not None:
                stop_reason = delta["stop_reason"]
            continue
        choices = obj.get("choices")
        if choices is None:
            continue
        if not isinstance(choices, list):
            return False
        for c in choices:
            i = _choice_index(c)
            if i is None:
                return False
            reason = c.get("finish_reason")
            if reason is not None:
                reasons[i] = reason
            else:
                reasons.setdefault(i, None)
    if anthropic:
        return _named(stop_reason, _ANTHROPIC_FINISHED)
    return bool(reasons) and all(_named(r, _OPENAI_FINISHED) for r in reasons.values())
