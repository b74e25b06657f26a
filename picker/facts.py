"""Parse an inference request body once into a small typed ``RequestFacts``.

Shapes: OpenAI chat completions (``messages``), OpenAI completions (``prompt``: a string, a list of
token ids, or a batch of either, as vLLM's ``CompletionRequest`` accepts), OpenAI Responses (``input``,
``instructions``, a stored ``prompt`` object) and Anthropic messages (``system`` as a string or content
blocks). A batch is routed on its first element: one replica serves the whole batch, so the first
prompt's prefix is the one the request can share with others. Anything a client can send wrong raises
``BadRequest`` with a message naming the field; the caller answers 400 with a JSON body.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import orjson

Api = Literal["chat", "completions", "anthropic", "responses", "other"]

CHAT_PATHS = ("/v1/chat/completions", "/chat/completions")
COMPLETIONS_PATHS = ("/v1/completions", "/completions")
ANTHROPIC_PATHS = ("/v1/messages", "/anthropic/v1/messages")
RESPONSES_PATHS = ("/v1/responses", "/responses")
MAX_TOKEN_ID = 1 << 32


class BadRequest(Exception):
    """A client error: ``code`` is a short machine-readable type, the message says what was wrong."""

    def __init__(self, message: str, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.code = code

    def json_body(self) -> bytes:
        return error_body(str(self), self.code)


@dataclass(slots=True, frozen=True)
class Answer:
    """A response the picker gives itself (400 bad request, 429 overloaded, 503 no backend, a response-cache
    hit)."""

    status: int
    body: bytes
    details: str
    headers: tuple[tuple[str, str], ...] = (("content-type", "application/json"),)


def error_body(message: str, code: str, kind: str = "invalid_request_error") -> bytes:
    """The JSON error body of an answer the picker gives itself (OpenAI's error shape)."""
    return orjson.dumps({"error": {"message": message, "type": kind, "code": code}})


@dataclass(slots=True, frozen=True)
class RequestFacts:
    """What the routing pipeline needs to know about one request."""

    api: Api
    model: str | None = None
    system: str | None = None  # system prompt text (OpenAI system/developer message, Anthropic system)
    first_message: str | None = None  # first non-system message text (or the completions prompt)
    messages: tuple[dict[str, Any], ...] | None = None  # as sent, for tokenizer sources
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None  # a completions prompt given as token ids (Tier 4 keys)
    stream: bool = False
    include_usage: bool = False
    temperature: float | None = None
    max_tokens: int | None = None
    top_p: float | None = None
    session_id: str | None = None
    tenant_id: str | None = None
    identity: str | None = None  # SHA-256 (hex) of the caller's credential header (``caller_identity``), never raw
    lora_name: str | None = None
    cache_salt: str | None = None
    body_bytes: int = 0
    # the base model a gateway named (X-Gateway-Base-Model-Name): Tier 4 keys an adapter no engine lists with it
    base_model: str | None = None


def declared_length(headers: Mapping[str, str]) -> int:
    """The request's declared ``Content-Length`` (0 when absent or malformed): what a request routed at its headers
    weighs in flow control's byte bounds and llm-d's request-size histogram."""
    v = headers.get("content-length", "")
    return min(int(v), 1 << 40) if v.isascii() and v.isdigit() and len(v) <= 19 else 0


def caller_identity(headers: Mapping[str, str], header: str) -> str | None:
    """SHA-256 (hex) of the caller's identity header ``header`` (lower-case), or None when it is absent or empty.
    With ``authorization`` (the default), Anthropic's ``x-api-key`` stands in when ``authorization`` is absent.
    The header's name is hashed with its value (an equal value in another header is another identity); the raw
    value is neither kept nor logged."""
    value = headers.get(header)
    if not value and header == "authorization":
        header, value = "x-api-key", headers.get("x-api-key")
    if not value or "\ufffd" in value:  # absent, or not UTF-8 (decoded lossily: two callers could collide)
        return None
    h = hashlib.sha256(b"kv-epp caller identity v1\x00")
    h.update(header.encode("ascii", "replace") + b"\x00" + value.encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def api_for_path(path: str) -> Api:
    """Which request shape a path carries (query string ignored)."""
    p = path.split("?", 1)[0].rstrip("/")
    if p.endswith(CHAT_PATHS):
        return "chat"
    if p.endswith(COMPLETIONS_PATHS):
        return "completions"
    if p.endswith(ANTHROPIC_PATHS):
        return "anthropic"
    if p.endswith(RESPONSES_PATHS):
        return "responses"
    return "other"


def _content_text(content: Any, where: str) -> str:
    """Text of an OpenAI/Anthropic content field: a string or a list of parts/blocks."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[str] = []
        for i, part in enumerate(content):
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict):
                text = part.get("text")
                if text is not None and not isinstance(text, str):
                    raise BadRequest(f"{where}[{i}].text must be a string", "invalid_type")
                if text:
                    texts.append(text)
            else:
                raise BadRequest(f"{where}[{i}] must be an object or a string", "invalid_type")
        return "\n".join(texts)
    raise BadRequest(f"{where} must be a string or a list of content parts", "invalid_type")


def _opt_number(body: dict[str, Any], key: str) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise BadRequest(f"'{key}' must be a number", "invalid_type")
    return float(v)


def _opt_int(body: dict[str, Any], key: str) -> int | None:
    """An integer field; a float with an integral value (``4.0``) counts, as in vLLM's (pydantic) models."""
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest(f"'{key}' must be an integer", "invalid_type")
    return v


def _token_ids(ids: list[Any], where: str) -> tuple[int, ...]:
    """A non-empty list of token ids (integers in 0..2**32-1: no vocabulary is larger)."""
    if not ids:
        raise BadRequest(f"{where} must not be empty", "invalid_value")
    for i, t in enumerate(ids):
        if type(t) is not int or not 0 <= t < MAX_TOKEN_ID:  # bool is not a token id
            raise BadRequest(f"{where}[{i}] must be an integer token id in 0..{MAX_TOKEN_ID - 1}", "invalid_type")
    return tuple(ids)


def _completions_prompt(p: Any) -> tuple[str | None, tuple[int, ...] | None]:
    """(text, token ids) of a completions ``prompt``: a string, token ids, or a batch of either (its first
    element; the others are checked for their type only)."""
    if isinstance(p, str):
        return p, None
    if not isinstance(p, list):
        raise BadRequest(
            "'prompt' must be a string, a list of strings, a list of token ids or a list of token-id lists",
            "invalid_type",
        )
    if not p:
        raise BadRequest("'prompt' must not be empty", "invalid_value")
    first = p[0]
    if isinstance(first, str):
        for i, x in enumerate(p):
            if not isinstance(x, str):
                raise BadRequest(f"prompt[{i}] must be a string (a batch of strings)", "invalid_type")
        return first, None
    if isinstance(first, list):
        for i, x in enumerate(p):
            if not isinstance(x, list):
                raise BadRequest(f"prompt[{i}] must be a list of token ids (a batch of token-id lists)", "invalid_type")
        return None, _token_ids(first, "prompt[0]")
    return None, _token_ids(p, "prompt")


def _responses_fields(data: dict[str, Any]) -> tuple[str | None, str | None]:
    """(system, first message) of a Responses request. The system part is ``instructions``, else a stored
    ``prompt`` object's id and version (every request rendering that stored prompt starts with it), else a
    system/developer input item; the first message is ``input`` (a string) or its first other item."""
    system = _opt_str(data, "instructions")
    stored = data.get("prompt")
    if stored is not None:
        if not isinstance(stored, dict) or not isinstance(stored.get("id"), str) or not stored["id"]:
            raise BadRequest("'prompt' must be an object with a non-empty string 'id'", "invalid_type")
        version = stored.get("version")
        if version is not None and not isinstance(version, str):
            raise BadRequest("prompt.version must be a string", "invalid_type")
        if system is None:
            system = f"stored prompt {stored['id']} version {version or 'latest'}"
    raw = data.get("input")
    if raw is None and stored is None:
        raise BadRequest("missing required field 'input' (or a stored 'prompt')", "missing_input")
    if raw is None or isinstance(raw, str):
        return system, raw
    if not isinstance(raw, list):
        raise BadRequest("'input' must be a string or a list of input items", "invalid_type")
    first: str | None = None
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise BadRequest(f"input[{i}] must be an object", "invalid_type")
        if "content" not in item:
            continue  # a function call output, a reasoning item: no prompt text
        text = _content_text(item["content"], f"input[{i}].content")
        if item.get("role") in ("system", "developer"):
            if system is None:
                system = text
        elif first is None:
            first = text
    return system, first


def _opt_str(body: dict[str, Any], key: str) -> str | None:
    v = body.get(key)
    if v is None:
        return None
    if not isinstance(v, str):
        raise BadRequest(f"'{key}' must be a string", "invalid_type")
    return v


def parse_request(
    body: bytes,
    path: str,
    *,
    max_body_bytes: int,
    session_id: str | None = None,
    tenant_id: str | None = None,
    identity: str | None = None,
) -> RequestFacts:
    """Parse ``body`` of a request to ``path``. Raises BadRequest on anything malformed."""
    return parse_request_body(
        body, path, max_body_bytes=max_body_bytes, session_id=session_id, tenant_id=tenant_id, identity=identity
    )[0]


def parse_request_body(
    body: bytes,
    path: str,
    *,
    max_body_bytes: int,
    session_id: str | None = None,
    tenant_id: str | None = None,
    identity: str | None = None,
) -> tuple[RequestFacts, dict[str, Any] | None]:
    """``parse_request``, and the body's JSON object it parsed (None when it parsed none): a later stage that
    reads more of the body than the facts keep (the response cache's key) takes it rather than parsing the
    body again. The caller must not keep it past the request's routing, nor change it."""
    api = api_for_path(path)
    if len(body) > max_body_bytes:
        raise BadRequest(
            f"request body of {len(body)} bytes exceeds the limit of {max_body_bytes} bytes", "body_too_large"
        )
    if api == "other" and not body:
        return RequestFacts(api="other", session_id=session_id, tenant_id=tenant_id, identity=identity), None
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        if api == "other":  # e.g. a multipart upload to another endpoint: route it, do not judge it
            return RequestFacts(
                api="other", session_id=session_id, tenant_id=tenant_id, identity=identity, body_bytes=len(body)
            ), None
        raise BadRequest(f"request body is not valid JSON: {exc}", "invalid_json") from None
    if not isinstance(data, dict):
        if api == "other":
            return RequestFacts(
                api="other", session_id=session_id, tenant_id=tenant_id, identity=identity, body_bytes=len(body)
            ), None
        raise BadRequest("request body must be a JSON object", "invalid_type")
    model = data.get("model")
    if api not in ("other", "responses") and model is None:  # a stored Responses prompt may name the model
        raise BadRequest("missing required field 'model'", "missing_model")
    if model is not None and (not isinstance(model, str) or not model):
        raise BadRequest("'model' must be a non-empty string", "invalid_type")
    stream = data.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", "invalid_type")
    stream_options = data.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise BadRequest("'stream_options' must be an object", "invalid_type")
    include_usage = bool(stream_options and stream_options.get("include_usage") is True)

    system: str | None = None
    first: str | None = None
    messages: tuple[dict[str, Any], ...] | None = None
    prompt: str | None = None
    token_ids: tuple[int, ...] | None = None
    if api == "responses":
        system, first = _responses_fields(data)
    elif api in ("chat", "anthropic") or (api == "other" and "messages" in data):
        raw = data.get("messages")
        if raw is None and api != "other":
            raise BadRequest("missing required field 'messages'", "missing_messages")
        if raw is not None:
            if not isinstance(raw, list):
                raise BadRequest("'messages' must be a list", "invalid_type")
            for i, m in enumerate(raw):
                if not isinstance(m, dict):
                    raise BadRequest(f"messages[{i}] must be an object", "invalid_type")
                role = m.get("role")
                if not isinstance(role, str):
                    raise BadRequest(f"messages[{i}].role must be a string", "invalid_type")
                text = _content_text(m.get("content"), f"messages[{i}].content")
                if role in ("system", "developer") and api != "anthropic":
                    if system is None:
                        system = text
                elif first is None:
                    first = text
            messages = tuple(raw)
        if api == "anthropic" and "system" in data:
            system = _content_text(data["system"], "system") or None
    elif api == "completions":
        p = data.get("prompt")
        if p is None:
            raise BadRequest("missing required field 'prompt'", "missing_prompt")
        prompt, token_ids = _completions_prompt(p)
        first = prompt
    elif "prompt" in data:  # another path with a prompt: keyed on it when it is one, never judged
        try:
            prompt, token_ids = _completions_prompt(data["prompt"])
        except BadRequest:
            prompt, token_ids = None, None
        first = prompt

    extra = data.get("extra_body") if isinstance(data.get("extra_body"), dict) else None
    lora = None
    cache_salt = _opt_str(data, "cache_salt") or (_opt_str(extra, "cache_salt") if extra else None)
    max_tokens = _opt_int(data, "max_tokens")
    if max_tokens is None:
        max_tokens = _opt_int(data, "max_completion_tokens")
    if max_tokens is None and api == "responses":
        max_tokens = _opt_int(data, "max_output_tokens")
    facts = RequestFacts(
        api=api,
        model=model,
        system=system or None,
        first_message=first or None,
        messages=messages,
        prompt=prompt,
        prompt_token_ids=token_ids,
        stream=stream,
        include_usage=include_usage,
        temperature=_opt_number(data, "temperature"),
        max_tokens=max_tokens,
        top_p=_opt_number(data, "top_p"),
        session_id=session_id,
        tenant_id=tenant_id,
        identity=identity,
        lora_name=lora,
        cache_salt=cache_salt,
        body_bytes=len(body),
    )
    return facts, data
