"""OpenAI chat completions ⇄ Google's Generative Language API (``generateContent``), as pure functions: no I/O, no
clock (the caller passes ``created``), nothing kept between calls except in a ``StreamConverter``.

What is converted and what is not is in docs/gemini.md ("The conversion"). In short: text chat turns, the system
prompt and the sampling parameters are converted; tool calls, tool results, images and other non-text parts, and
the OpenAI parameters whose meaning would be lost (``tools``, ``logprobs``, a ``json_schema`` response format, ...)
are not: those raise ``ConversionError`` and the caller sends the request unchanged to the OpenAI-compatible
endpoint (``/v1beta/openai/chat/completions``). Odd input never raises anything else.
"""

from __future__ import annotations

import math
import re
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import orjson

NATIVE_API_VERSION = "v1beta"
SYSTEM_ROLES = frozenset({"system", "developer"})
_ROLE = {"user": "user", "assistant": "model"}
MAX_MODEL_CHARS = 256  # as GeminiBackendConfig.models
MAX_STREAM_EVENT_BYTES = 8 << 20  # one upstream SSE event; a larger one is dropped (an error event says so)
MAX_ERROR_MESSAGE_CHARS = 2048  # an upstream error's message, as passed on in an error event
MAX_CHOICES = 128  # distinct candidate indices a stream tracks; a candidate past them is dropped (error event)
# Gemini's finishReason → OpenAI's finish_reason; any other (OTHER, MALFORMED_FUNCTION_CALL, ...) is "stop"
_FINISH = {
    "STOP": "stop",
    "MAX_TOKENS": "length",
    "SAFETY": "content_filter",
    "RECITATION": "content_filter",
    "BLOCKLIST": "content_filter",
    "PROHIBITED_CONTENT": "content_filter",
    "SPII": "content_filter",
}
# OpenAI keys whose meaning the native request cannot carry: present (not null, not empty), they refuse the conversion
_REFUSED_KEYS = ("tools", "functions", "tool_choice", "function_call", "logit_bias", "audio", "prediction")


class ConversionError(ValueError):
    """The request or response cannot be converted; the message says what and where. For a request, the caller
    sends it unchanged to the OpenAI-compatible endpoint instead."""


@dataclass(frozen=True, slots=True)
class NativeUsage:
    """Token counts of a native response's ``usageMetadata``; None where the field is absent. ``prompt`` includes
    the ``cached`` tokens (as Gemini's ``promptTokenCount`` does); ``completion`` is ``candidatesTokenCount`` plus
    ``thoughtsTokenCount``."""

    prompt: int | None = None
    cached: int | None = None
    completion: int | None = None
    total: int | None = None


# ---- requests ----------------------------------------------------------------------------------------------------


def _messages(body: Any) -> list[Any]:
    if not isinstance(body, dict):
        raise ConversionError(f"the request body must be a JSON object, not {type(body).__name__}")
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise ConversionError("the request has no 'messages' list")
    return messages


def _text_of(content: Any, where: str) -> str:
    """The text of a message's ``content``: a string, or the ``text`` parts of a list, concatenated (OpenAI joins
    them without a separator). A non-text part (``image_url``, ``input_audio``, ``file``, ...) is refused."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ConversionError(f"{where}.content must be a string or a list of parts")
    texts: list[str] = []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise ConversionError(f"{where}.content[{j}] must be an object")
        kind = part.get("type")
        if kind != "text":
            raise ConversionError(f"{where}.content[{j}] is a {kind!r} part: only text parts are converted")
        text = part.get("text")
        if not isinstance(text, str):
            raise ConversionError(f"{where}.content[{j}].text must be a string")
        texts.append(text)
    return "".join(texts)


def system_text(body: dict[str, Any]) -> str | None:
    """The request's system prompt: the text of its ``system`` and ``developer`` messages (wherever they stand),
    joined with ``"\\n"``; None when it has no such message or they hold no text. A message's text is its string
    ``content`` or its ``text`` parts; a non-text part raises ``ConversionError``. See docs/gemini.md."""
    texts: list[str] = []
    for i, m in enumerate(_messages(body)):
        if isinstance(m, dict) and m.get("role") in SYSTEM_ROLES:
            texts.append(_text_of(m.get("content"), f"messages[{i}]"))
    text = "\n".join(texts)
    return text if text else None


def _number(body: dict[str, Any], key: str, *, integer: bool = False) -> float | int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float) or (integer and not isinstance(v, int)):
        raise ConversionError(f"'{key}' must be {'an integer' if integer else 'a number'}")
    if isinstance(v, float) and not math.isfinite(v):
        raise ConversionError(f"'{key}' must be finite")
    return v


def _generation_config(body: dict[str, Any]) -> dict[str, Any]:
    cfg: dict[str, Any] = {}
    for key, native, integer in (
        ("temperature", "temperature", False),
        ("top_p", "topP", False),
        ("top_k", "topK", True),
        ("n", "candidateCount", True),
        ("seed", "seed", True),
        ("presence_penalty", "presencePenalty", False),
        ("frequency_penalty", "frequencyPenalty", False),
    ):
        v = _number(body, key, integer=integer)
        if v is not None:
            cfg[native] = v
    # max_completion_tokens supersedes the deprecated max_tokens (OpenAI's rule)
    limit = _number(body, "max_completion_tokens", integer=True)
    if limit is None:
        limit = _number(body, "max_tokens", integer=True)
    if limit is not None:
        cfg["maxOutputTokens"] = limit
    stop = body.get("stop")
    if isinstance(stop, str):
        cfg["stopSequences"] = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        if stop:
            cfg["stopSequences"] = list(stop)
    elif stop is not None:
        raise ConversionError("'stop' must be a string or a list of strings")
    fmt = body.get("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_object":
            cfg["responseMimeType"] = "application/json"
        elif kind != "text":
            raise ConversionError(f"response_format {kind!r} is not converted (only 'text' and 'json_object')")
    return cfg


def _refuse_unconvertible(body: dict[str, Any]) -> None:
    for key in _REFUSED_KEYS:
        v = body.get(key)
        if v is not None and v != [] and v != {} and v != "none":
            raise ConversionError(f"'{key}' is not converted to the native API")
    if body.get("logprobs") or body.get("top_logprobs"):
        raise ConversionError("'logprobs' is not converted to the native API")
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise ConversionError("'modalities' other than ['text'] is not converted to the native API")


def _check_cached_content(name: Any) -> str:
    if not isinstance(name, str) or not name.startswith("cachedContents/") or len(name) <= len("cachedContents/"):
        raise ConversionError(f"a cached content name must be 'cachedContents/ID', not {name!r}")
    return name


def _content(text: str) -> dict[str, Any]:
    return {"parts": [{"text": text}]}


def to_native_request(body: dict[str, Any], *, cached_content: str | None = None) -> dict[str, Any]:
    """An OpenAI chat-completions body → the body of ``POST /v1beta/models/{model}:generateContent`` (or
    ``:streamGenerateContent``; the model and ``stream`` go in the path, see ``native_path``).

    - ``systemInstruction`` = ``{"parts": [{"text": system_text(body)}]}``; with ``cached_content`` it is left out
      and the top-level ``cachedContent`` names the resource instead (Google refuses a request that has both: the
      resource holds the system instruction).
    - ``contents``: the ``user`` and ``assistant`` messages in order, as roles ``user`` and ``model``, each one
      text part. An empty turn, a ``tool`` message, an assistant message with ``tool_calls``, a non-text part
      (``image_url``, ...), or a conversation with no user or assistant turn raises ``ConversionError``.
    - ``generationConfig``: temperature, top_p → topP, top_k → topK, max_completion_tokens (else max_tokens) →
      maxOutputTokens, stop (string or list) → stopSequences, n → candidateCount, seed, presence_penalty →
      presencePenalty, frequency_penalty → frequencyPenalty, response_format json_object → responseMimeType
      ``application/json``. Omitted when empty.
    - Keys that only steer the transport or the bookkeeping (model, stream, stream_options, user, metadata, store,
      ...) are dropped; keys whose meaning would be lost (tools, functions, tool_choice other than "none",
      logprobs, logit_bias, audio, a json_schema response_format, ...) raise ``ConversionError``.

    See docs/gemini.md."""
    messages = _messages(body)
    _refuse_unconvertible(body)
    contents: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ConversionError(f"{where} must be an object")
        role = m.get("role")
        if role in SYSTEM_ROLES:
            continue
        if role not in _ROLE:
            raise ConversionError(
                f"{where} has role {role!r}: only system, developer, user and assistant are converted"
            )
        if role == "assistant" and (m.get("tool_calls") or m.get("function_call")):
            raise ConversionError(f"{where} is an assistant message with tool calls: not converted")
        text = _text_of(m.get("content"), where)
        if not text:
            raise ConversionError(f"{where} has no text (Google refuses an empty text part)")
        contents.append({"role": _ROLE[role], "parts": [{"text": text}]})
    if not contents:
        raise ConversionError("the request has no user or assistant message")
    native: dict[str, Any] = {"contents": contents}
    if cached_content is not None:
        native["cachedContent"] = _check_cached_content(cached_content)
    else:
        system = system_text(body)
        if system is not None:
            native["systemInstruction"] = _content(system)
    cfg = _generation_config(body)
    if cfg:
        native["generationConfig"] = cfg
    return native


def _model_segment(model: Any) -> str:
    if not isinstance(model, str) or not model or len(model) > MAX_MODEL_CHARS:
        raise ConversionError(f"a model must be a string of 1 to {MAX_MODEL_CHARS} characters")
    if "/" in model or "?" in model:
        raise ConversionError(f"the model {model!r} contains '/' or '?': not a Gemini model id")
    return urllib.parse.quote(model, safe="-._~")


def cache_create_body(model: str, system: str, ttl_s: float) -> dict[str, Any]:
    """The body of ``POST /v1beta/cachedContents``: ``{"model": "models/<model>", "systemInstruction": {"parts":
    [{"text": system}]}, "ttl": "<whole seconds>s"}`` (the resource holds the system prompt alone; Google refuses one
    under the model's minimum cacheable token count with HTTP 400). ``ttl_s`` is rounded down to whole seconds and
    must be at least 1. See docs/gemini.md."""
    _model_segment(model)
    if not isinstance(system, str) or not system:
        raise ConversionError("the system text to cache must be a non-empty string")
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, int | float) or not math.isfinite(ttl_s) or ttl_s < 1:
        raise ConversionError(f"the TTL must be at least 1 second, not {ttl_s!r}")
    return {"model": f"models/{model}", "systemInstruction": _content(system), "ttl": f"{int(ttl_s)}s"}


def openai_compat_with_cache(body: dict[str, Any], cached_content: str) -> dict[str, Any]:
    """The body for the OpenAI-compatible endpoint (``POST /v1beta/openai/chat/completions``) referencing a cached
    system prompt: a copy without its ``system`` / ``developer`` messages (the resource holds them; Google refuses a
    request with both), with ``extra_body.google.cached_content`` = the resource name, merged into an existing
    ``extra_body`` (its other keys, e.g. ``google.thinking_config``, are kept). The input is not modified. On the
    wire ``extra_body`` is a top-level key of the JSON body. See docs/gemini.md."""
    messages = _messages(body)
    name = _check_cached_content(cached_content)
    extra = body.get("extra_body")
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        raise ConversionError("'extra_body' must be an object")
    google = extra.get("google")
    if google is None:
        google = {}
    if not isinstance(google, dict):
        raise ConversionError("'extra_body.google' must be an object")
    out = dict(body)
    out["messages"] = [m for m in messages if not (isinstance(m, dict) and m.get("role") in SYSTEM_ROLES)]
    out["extra_body"] = {**extra, "google": {**google, "cached_content": name}}
    return out


def native_path(model: str, stream: bool) -> str:
    """The request path of the native API for ``model``: ``/v1beta/models/{model}:generateContent``, or with
    ``stream`` ``/v1beta/models/{model}:streamGenerateContent?alt=sse`` (server-sent events; without ``alt=sse``
    Google streams one JSON array instead). The model is percent-encoded (a ``:`` too); one holding ``/`` or ``?``
    raises ``ConversionError``. See docs/gemini.md."""
    segment = _model_segment(model)
    if stream:
        return f"/{NATIVE_API_VERSION}/models/{segment}:streamGenerateContent?alt=sse"
    return f"/{NATIVE_API_VERSION}/models/{segment}:generateContent"


# ---- responses ---------------------------------------------------------------------------------------------------


def _count(meta: dict[str, Any], key: str) -> int | None:
    v = meta.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def native_usage(resp: dict[str, Any]) -> NativeUsage:
    """The token counts of a native response (or stream event): its ``usageMetadata``'s ``promptTokenCount``
    (includes the cached tokens), ``cachedContentTokenCount`` (from an explicit ``cachedContent`` or Gemini 2.5+'s
    implicit caching), ``candidatesTokenCount`` plus ``thoughtsTokenCount`` (a thinking model's hidden tokens,
    billed as output) and ``totalTokenCount``. A missing or malformed field is None. See docs/gemini.md."""
    meta = resp.get("usageMetadata") if isinstance(resp, dict) else None
    if not isinstance(meta, dict):
        return NativeUsage()
    candidates, thoughts = _count(meta, "candidatesTokenCount"), _count(meta, "thoughtsTokenCount")
    completion = None if candidates is None and thoughts is None else (candidates or 0) + (thoughts or 0)
    return NativeUsage(
        prompt=_count(meta, "promptTokenCount"),
        cached=_count(meta, "cachedContentTokenCount"),
        completion=completion,
        total=_count(meta, "totalTokenCount"),
    )


def openai_usage(usage: NativeUsage) -> dict[str, Any]:
    """OpenAI's ``usage`` from native counts: ``prompt_tokens`` includes the cached tokens, which
    ``prompt_tokens_details.cached_tokens`` repeats (0 when none); ``total_tokens`` is Gemini's total, or the sum
    when it is absent. See docs/gemini.md, "Usage"."""
    prompt, completion = usage.prompt or 0, usage.completion or 0
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": usage.total if usage.total is not None else prompt + completion,
        "prompt_tokens_details": {"cached_tokens": usage.cached or 0},
    }


def finish_reason(native: Any) -> str:
    """Gemini's ``finishReason`` → OpenAI's ``finish_reason``: STOP → stop, MAX_TOKENS → length, SAFETY,
    RECITATION, BLOCKLIST, PROHIBITED_CONTENT, SPII → content_filter, anything else → stop."""
    return _FINISH.get(native, "stop") if isinstance(native, str) else "stop"


def _candidate_text(candidate: dict[str, Any]) -> str:
    """The concatenated ``text`` parts of a candidate's ``content``; thought summaries (``"thought": true``) and
    non-text parts are left out."""
    content = candidate.get("content")
    parts = content.get("parts") if isinstance(content, dict) else None
    if not isinstance(parts, list):
        return ""
    return "".join(
        p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str) and not p.get("thought")
    )


def _candidates(resp: dict[str, Any]) -> Iterable[tuple[int, dict[str, Any]]]:
    """(choice index, candidate) pairs; a candidate's ``index`` may be omitted (proto3 leaves out a 0)."""
    cands = resp.get("candidates")
    if not isinstance(cands, list):
        return
    for pos, c in enumerate(cands):
        if isinstance(c, dict):
            idx = c.get("index", pos)
            yield (idx if isinstance(idx, int) and not isinstance(idx, bool) and idx >= 0 else pos), c


def _blocked(resp: dict[str, Any]) -> bool:
    feedback = resp.get("promptFeedback")
    return isinstance(feedback, dict) and bool(feedback.get("blockReason"))


def _error_of(resp: dict[str, Any]) -> dict[str, Any] | None:
    err = resp.get("error")
    return err if isinstance(err, dict) else ({"message": str(err)} if err is not None else None)


def from_native_response(resp: dict[str, Any], *, model: str, response_id: str, created: int) -> dict[str, Any]:
    """A ``generateContent`` response → an OpenAI ``chat.completion``: one choice per candidate (its concatenated
    text parts; ``finish_reason`` by ``finish_reason``), ``usage`` by ``openai_usage``. A prompt blocked by
    Google (``promptFeedback.blockReason``, no candidates) is one choice with empty content and finish_reason
    ``content_filter``; no candidates without a block reason is one empty choice with ``stop``. An error body
    (``{"error": ...}``) raises ``ConversionError``. See docs/gemini.md."""
    if not isinstance(resp, dict):
        raise ConversionError(f"the native response must be a JSON object, not {type(resp).__name__}")
    err = _error_of(resp)
    if err is not None and not resp.get("candidates"):
        raise ConversionError(f"the native response is an error: {str(err.get('message'))[:MAX_ERROR_MESSAGE_CHARS]}")
    choices: list[dict[str, Any]] = [
        {
            "index": idx,
            "message": {"role": "assistant", "content": _candidate_text(c)},
            "logprobs": None,
            "finish_reason": finish_reason(c.get("finishReason")),
        }
        for idx, c in sorted(_candidates(resp), key=lambda ic: ic[0])
    ]
    if not choices:
        reason = "content_filter" if _blocked(resp) else "stop"
        choices = [{"index": 0, "message": {"role": "assistant", "content": ""}, "logprobs": None,
                    "finish_reason": reason}]  # fmt: skip
    return {
        "id": response_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": openai_usage(native_usage(resp)),
    }


# ---- streams -----------------------------------------------------------------------------------------------------

_LINE_END = re.compile(rb"\r\n|\r|\n")
_DONE = b"data: [DONE]\n\n"


def _sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def error_event(message: str, *, code: Any = None, kind: str = "upstream_error") -> bytes:
    """An OpenAI-style error event in a stream: ``data: {"error": {"message", "type", "code"}}``."""
    return _sse({"error": {"message": message[:MAX_ERROR_MESSAGE_CHARS], "type": kind[:64], "code": code}})


class StreamConverter:
    """The native stream of ``streamGenerateContent?alt=sse`` → OpenAI ``chat.completion.chunk`` events.

    Input: server-sent events (``data: {json}`` lines, each event ended by a blank line: ``\\r\\n\\r\\n`` as Google
    sends, or ``\\n\\n``), split anywhere across ``feed`` calls, a UTF-8 character too (bytes are decoded only
    per whole event). Output, as ``data: {...}\\n\\n`` events: per candidate, the first chunk carries
    ``delta.role: "assistant"``; then text deltas; the finish_reason rides on the chunk of the event that carries
    Gemini's ``finishReason`` (its last); with ``include_usage`` every chunk has ``"usage": null`` and ``finish``
    adds one chunk with ``choices: []`` and the usage of the last ``usageMetadata`` seen (none seen: no such
    chunk), then ``data: [DONE]``. A native error event (``{"error": {...}}``) or an unparseable one becomes an
    OpenAI-style error event and the stream goes on. Bounded: one event over ``MAX_STREAM_EVENT_BYTES`` is
    dropped with an error event. See docs/gemini.md."""

    def __init__(self, model: str, response_id: str, created: int, include_usage: bool) -> None:
        self._head = {"id": response_id, "object": "chat.completion.chunk", "created": created, "model": model}
        self._include_usage = include_usage
        self._buf = bytearray()
        self._scanned = 0  # bytes of _buf known to hold no line end
        self._data: list[bytes] = []  # the data lines of the event being read
        self._event_bytes = 0
        self._discarding = False  # the rest of an oversized event is skipped up to its blank line
        self._line_dropped = False  # bytes of the current line were dropped (so its end is no blank line)
        self._started: set[int] = set()  # choice indices whose role chunk was sent; at most MAX_CHOICES
        self._usage: NativeUsage | None = None
        self._finished = False

    @property
    def usage(self) -> NativeUsage | None:
        """The counts of the last ``usageMetadata`` seen, or None."""
        return self._usage

    @property
    def buffered(self) -> int:
        """Bytes held for an event not yet complete (its data lines and its partial line); bounded by
        ``MAX_STREAM_EVENT_BYTES`` plus one fed chunk."""
        return self._event_bytes + len(self._buf)

    def feed(self, chunk: bytes) -> bytes:
        """Bytes of the native stream in; the OpenAI events they complete out (maybe none)."""
        if self._finished:
            raise ConversionError("feed() after finish()")
        out: list[bytes] = []
        self._buf += chunk
        self._scan(out, final=False)
        return b"".join(out)

    def finish(self) -> bytes:
        """The end of the native stream: a last event without its blank line is still converted; then the usage
        chunk (``include_usage``) and ``data: [DONE]``. Later calls return nothing."""
        if self._finished:
            return b""
        out: list[bytes] = []
        self._scan(out, final=True)
        if self._buf and not self._discarding:
            self._line(bytes(self._buf), False, out)
        self._buf.clear()
        self._dispatch(out)
        self._finished = True
        if self._include_usage and self._usage is not None:
            out.append(_sse({**self._head, "choices": [], "usage": openai_usage(self._usage)}))
        out.append(_DONE)
        return b"".join(out)

    def _scan(self, out: list[bytes], *, final: bool) -> None:
        buf = self._buf
        pos = 0
        while True:
            m = _LINE_END.search(buf, max(pos, self._scanned))
            if m is None or (m.group() == b"\r" and m.end() == len(buf) and not final):
                break  # no line end yet, or a CR at the end that may be the first half of a CRLF
            line = bytes(buf[pos : m.start()])
            pos = m.end()
            blank = not line and not self._line_dropped
            self._line_dropped = False
            if self._discarding:
                self._discarding = not blank  # the blank line ends the dropped event
            else:
                self._line(line, blank, out)
        del buf[:pos]
        if not self._discarding and self._event_bytes + len(buf) > MAX_STREAM_EVENT_BYTES:
            self._overflow(out)  # one line of the event alone is too long
        if self._discarding and buf and buf != b"\r":
            # a dropped event's partial line is not kept; an unresolved CR at its end is, to see the line end
            cr = buf.endswith(b"\r")
            del buf[: len(buf) - 1 if cr else len(buf)]
            self._line_dropped = True
        self._scanned = len(buf) - (1 if buf.endswith(b"\r") else 0)

    def _overflow(self, out: list[bytes]) -> None:
        out.append(error_event(f"an upstream stream event exceeds {MAX_STREAM_EVENT_BYTES} bytes; it was dropped"))
        self._data.clear()
        self._event_bytes = 0
        self._discarding = True

    def _line(self, line: bytes, blank: bool, out: list[bytes]) -> None:
        if blank:
            self._dispatch(out)
            return
        if line.startswith(b":"):
            return  # a comment
        field, _, value = line.partition(b":")
        if field != b"data":
            return  # event:, id:, retry: mean nothing here
        if value.startswith(b" "):
            value = value[1:]
        self._event_bytes += len(value) + 1
        if self._event_bytes > MAX_STREAM_EVENT_BYTES:
            self._overflow(out)
            return
        self._data.append(value)

    def _dispatch(self, out: list[bytes]) -> None:
        if not self._data:
            return
        data = b"\n".join(self._data)
        self._data.clear()
        self._event_bytes = 0
        if data.strip() == b"[DONE]":
            return
        try:
            event = orjson.loads(data)
        except orjson.JSONDecodeError:
            out.append(error_event("an upstream stream event is not valid JSON", kind="upstream_protocol_error"))
            return
        if not isinstance(event, dict):
            out.append(error_event("an upstream stream event is not a JSON object", kind="upstream_protocol_error"))
            return
        self._event(event, out)

    def _chunk(self, idx: int, delta: dict[str, Any], reason: str | None) -> bytes:
        chunk: dict[str, Any] = {
            **self._head,
            "choices": [{"index": idx, "delta": delta, "logprobs": None, "finish_reason": reason}],
        }
        if self._include_usage:
            chunk["usage"] = None
        return _sse(chunk)

    def _event(self, event: dict[str, Any], out: list[bytes]) -> None:
        err = _error_of(event)
        if err is not None:
            message = err.get("message")
            out.append(
                error_event(
                    str(message) if message is not None else "upstream error",
                    code=err.get("code") if isinstance(err.get("code"), int | str) else None,
                    kind=str(err.get("status") or "upstream_error"),
                )
            )
            return
        if isinstance(event.get("usageMetadata"), dict):
            self._usage = native_usage(event)
        seen = False
        for idx, cand in _candidates(event):
            seen = True
            self._candidate(idx, cand, out)
        if not seen and _blocked(event):
            self._candidate(0, {"finishReason": "PROHIBITED_CONTENT"}, out)

    def _candidate(self, idx: int, cand: dict[str, Any], out: list[bytes]) -> None:
        first = idx not in self._started
        if first and len(self._started) >= MAX_CHOICES:
            out.append(error_event(f"more than {MAX_CHOICES} candidates; candidate {idx} dropped"))
            return
        text = _candidate_text(cand)
        native_reason = cand.get("finishReason")
        reason = finish_reason(native_reason) if native_reason else None
        if not first and not text and reason is None:
            return
        delta: dict[str, Any] = {}
        if first:
            self._started.add(idx)
            delta["role"] = "assistant"
        if text or first:
            delta["content"] = text
        out.append(self._chunk(idx, delta, reason))
