"""A FAKE Generative Language API — a fake, for tests; not Google's service. It serves, over real HTTP (aiohttp,
on a free loopback port), the part of Google's API that kv-epp's ``type: gemini`` backends use:

- ``POST /v1beta/cachedContents`` (create), ``GET`` (list), ``GET`` / ``PATCH`` (``ttl`` or ``expireTime``,
  ``?updateMask=``) / ``DELETE /v1beta/cachedContents/{id}``: a resource holds ``systemInstruction`` and
  ``contents``; its tokens are counted as ``len(utf-8 bytes) // 4`` of their text; under ``min_cache_tokens`` a
  create is refused with 400 INVALID_ARGUMENT "Cached content is too small. total_token_count=N,
  min_total_token_count=M" as Google's is; ``ttl`` ("300s", default one hour, as Google's) or ``expireTime``.
  Expiry is real, by the fake's clock: an expired resource is gone (404 NOT_FOUND), as an unknown one;
- ``POST /v1beta/models/{model}:generateContent`` and ``:streamGenerateContent`` (``?alt=sse``: 2 or 3 events,
  CRLF-terminated as Google's, the full ``usageMetadata`` on the last; without ``alt=sse`` a JSON array). The
  answer is deterministic: ``"echo: "`` + the last user turn's text, cut to ``maxOutputTokens`` words (then
  finishReason MAX_TOKENS; 256 words without it); one candidate per ``candidateCount``. ``usageMetadata``:
  ``promptTokenCount`` = the tokens of ``systemInstruction`` + ``contents`` + the referenced cached content,
  ``cachedContentTokenCount`` = the cached content's, ``candidatesTokenCount`` = the answer's words (all
  candidates). ``cachedContent`` naming an unknown or expired resource, or one of another model, is a 400; with
  ``systemInstruction`` (or ``tools``) beside it too, as Google refuses that;
- ``POST /v1beta/openai/chat/completions``: the OpenAI-compatible endpoint, streamed or not, the same answer and
  counts; ``extra_body.google.cached_content`` is honoured as ``cachedContent`` is (with system messages beside
  it: 400), reported in ``usage.prompt_tokens_details.cached_tokens``.

Auth: the key in ``x-goog-api-key`` or ``?key=`` (on the OpenAI-compatible endpoint also ``Authorization: Bearer``).
Without one: 401 UNAUTHENTICATED; a wrong one: 403 PERMISSION_DENIED (Google answers a wrong key with 400
API_KEY_INVALID and a missing one with 403; a 4xx either way). Errors have Google's shape ``{"error": {"code",
"message", "status"}}``. Where Google answers a missing ``cachedContent`` with 403 "CachedContent not found (or
permission denied)", the fake answers 400 with that message.

Not Google's: ``/_fake/stats`` (GET: counters, the live resources, the recorded requests) and ``/_fake/control``
(POST ``{"fail_next_create": 500, "advance_s": 700, "hold_creates": true}``) inspect and steer a fake run as a
subprocess; they need no key. In-process, the same is on the ``FakeGemini`` object (``start_fake_gemini``).

As a subprocess: ``python -m tests.support.fake_gemini --port P --api-key-file F [--min-cache-tokens N]
[--tls-cert C --tls-key K]`` prints ``READY <port>`` on stdout when it listens; SIGTERM stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import itertools
import re
import signal
import socket
import ssl
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

API = "/v1beta"
MAX_REQUESTS_RECORDED = 256  # `requests` keeps the most recent ones
MAX_CACHED = 10_000  # live resources; a create past it is refused with 429 RESOURCE_EXHAUSTED
DEFAULT_TTL_S = 3600.0  # of a resource created without ttl or expireTime (Google's default)
DEFAULT_MAX_WORDS = 256  # an answer's length without maxOutputTokens
MAX_CANDIDATES = 8
MAX_BODY_BYTES = 64 << 20
READY = "READY"
_STATUS = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    409: "ALREADY_EXISTS",
    429: "RESOURCE_EXHAUSTED",
    500: "INTERNAL",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)s$")
_TIMESTAMP = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)$")
_BOTH_MESSAGE = (
    "CachedContent can not be used with GenerateContent request setting system_instruction, tools or tool_config."
    "\n\nProposed fix: move those values to CachedContent from GenerateContent request."
)


def tokens_of(text: str) -> int:
    """The fake's token count of a text: its UTF-8 bytes // 4."""
    return len(text.encode()) // 4


def rfc3339(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_rfc3339(v: Any) -> float | None:
    m = _TIMESTAMP.match(v) if isinstance(v, str) else None
    if m is None:
        return None
    zone = "+00:00" if m.group(3) == "Z" else m.group(3)
    base = datetime.datetime.fromisoformat(m.group(1) + zone).timestamp()
    return base + (float(m.group(2)) if m.group(2) else 0.0)


def parse_duration(v: Any) -> float | None:
    m = _DURATION.match(v) if isinstance(v, str) else None
    return float(m.group(1)) if m else None


class ApiError(Exception):
    """An error answer in Google's shape."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def response(self) -> web.Response:
        body = {"error": {"code": self.code, "message": self.message, "status": _STATUS.get(self.code, "UNKNOWN")}}
        return web.json_response(body, status=self.code, dumps=lambda o: orjson.dumps(o).decode())


@dataclass
class CachedResource:
    """One live ``cachedContents`` resource (times by the fake's clock, in epoch seconds)."""

    name: str
    model: str  # "models/..."
    tokens: int
    create_time: float
    update_time: float
    expire_time: float
    display_name: str | None = None

    def json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "model": self.model,
            "createTime": rfc3339(self.create_time),
            "updateTime": rfc3339(self.update_time),
            "expireTime": rfc3339(self.expire_time),
            "usageMetadata": {"totalTokenCount": self.tokens},
        }
        if self.display_name is not None:
            out["displayName"] = self.display_name
        return out


@dataclass(frozen=True)
class RecordedRequest:
    """A request the fake received (the ``key`` query parameter left out; the body parsed, or None)."""

    method: str
    path: str
    query: dict[str, str]
    body: Any


def _content_text(content: Any, where: str) -> str:
    """The concatenated text parts of a ``Content`` (``{"role", "parts": [{"text"}]}``); other parts count 0."""
    if not isinstance(content, dict):
        raise ApiError(400, f"Invalid value at '{where}': a Content object is expected")
    parts = content.get("parts")
    if not isinstance(parts, list) or not parts:
        raise ApiError(400, f"* {where}.parts: contents.parts must not be empty.")
    texts = []
    for p in parts:
        if not isinstance(p, dict):
            raise ApiError(400, f"Invalid value at '{where}.parts': a Part object is expected")
        if isinstance(p.get("text"), str):
            texts.append(p["text"])
    return "".join(texts)


def _contents(v: Any, where: str) -> list[tuple[str, str]]:
    """(role, text) of each ``Content`` of a list."""
    if v is None:
        return []
    if not isinstance(v, list):
        raise ApiError(400, f"Invalid value at '{where}': a list of Content is expected")
    out = []
    for i, c in enumerate(v):
        text = _content_text(c, f"{where}[{i}]")
        role = c.get("role") or "user"
        if role not in ("user", "model"):
            raise ApiError(400, f"Please use a valid role: user, model. (at {where}[{i}].role)")
        out.append((role, text))
    return out


def _answer(last_user: str, max_words: int | None) -> tuple[list[str], bool]:
    """The answer's words and whether they were cut."""
    words = ["echo:", *last_user.split()]
    limit = DEFAULT_MAX_WORDS if max_words is None else max_words
    return words[:limit], len(words) > limit


def _pieces(text: str) -> list[str]:
    """``text`` in 2 or 3 consecutive pieces for a stream, cut after word boundaries."""
    cuts = [m.start() for m in re.finditer(r" ", text)]
    if not cuts:
        return [text, ""]
    if len(cuts) == 1:
        return [text[: cuts[0]], text[cuts[0] :]]
    a, b = cuts[0], cuts[len(cuts) // 2]
    return [text[:a], text[a:b], text[b:]]


def _positive_int(v: Any, where: str, upper: int) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= upper:
        raise ApiError(400, f"Invalid value at '{where}': an integer from 1 to {upper} is expected")
    return v


class FakeGemini:
    """The fake's state and its aiohttp app. Counters count requests that passed auth: ``creates`` every
    ``POST /v1beta/cachedContents`` (refused ones too), ``deletes`` every DELETE, ``patches`` every PATCH.
    ``fail_next_create = 503`` makes the next create answer 503 (then it resets to None). ``advance(s)`` moves
    the fake's clock on; ``hold_creates()`` / ``release_creates()`` keep creates waiting (single-flight tests)."""

    def __init__(self, *, api_key: str, min_cache_tokens: int = 2048, clock: Callable[[], float] = time.time) -> None:
        if not api_key:
            raise ValueError("the fake needs an API key")
        self.api_key = api_key
        self.min_cache_tokens = min_cache_tokens
        self._clock = clock
        self.clock_offset = 0.0
        self.creates = 0
        self.deletes = 0
        self.patches = 0
        self.generates = 0  # native generateContent / streamGenerateContent calls
        self.openai_calls = 0  # OpenAI-compatible chat completions calls
        self.fail_next_create: int | None = None
        self.requests: deque[RecordedRequest] = deque(maxlen=MAX_REQUESTS_RECORDED)
        self._cached: dict[str, CachedResource] = {}
        self._ids = itertools.count(1)
        self._creates_open = asyncio.Event()
        self._creates_open.set()
        self.base_url = ""
        self.port = 0
        self._runner: web.AppRunner | None = None
        self.app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._middleware])
        self.app.add_routes(
            [
                web.post(f"{API}/cachedContents", self._create),
                web.get(f"{API}/cachedContents", self._list),
                web.get(f"{API}/cachedContents/{{id}}", self._get),
                web.patch(f"{API}/cachedContents/{{id}}", self._patch),
                web.delete(f"{API}/cachedContents/{{id}}", self._delete),
                web.post(f"{API}/models/{{call}}", self._generate),
                web.post(f"{API}/openai/chat/completions", self._openai),
                web.get("/_fake/stats", self._stats),
                web.post("/_fake/control", self._control),
            ]
        )

    # ---- inspection and control ----

    def now(self) -> float:
        """The fake's clock: the given clock plus what ``advance`` added."""
        return self._clock() + self.clock_offset

    def advance(self, seconds: float) -> None:
        self.clock_offset += seconds

    def hold_creates(self) -> None:
        self._creates_open.clear()

    def release_creates(self) -> None:
        self._creates_open.set()

    @property
    def cached(self) -> dict[str, CachedResource]:
        """The live resources by name (expired ones are removed first)."""
        now = self.now()
        for name in [n for n, r in self._cached.items() if r.expire_time <= now]:
            del self._cached[name]
        return self._cached

    def _lookup(self, name: str) -> CachedResource | None:
        return self.cached.get(name)

    async def stop(self) -> None:
        self.release_creates()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ---- plumbing ----

    def _authorized(self, request: web.Request) -> None:
        key = request.headers.get("x-goog-api-key") or request.query.get("key")
        if not key and request.path.startswith(f"{API}/openai/"):
            auth = request.headers.get("authorization", "")
            key = auth[7:] if auth.lower().startswith("bearer ") else None
        if not key:
            raise ApiError(
                401,
                "Method doesn't allow unregistered callers (callers without established identity). Please use API "
                "Key or other form of API consumer identity to call this API.",
            )
        if key != self.api_key:
            raise ApiError(403, "API key not valid. Please pass a valid API key.")

    @web.middleware
    async def _middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        try:
            if request.path.startswith("/_fake/"):
                return await handler(request)
            self._authorized(request)
            raw = await request.read()
            try:
                body = orjson.loads(raw) if raw else None
            except orjson.JSONDecodeError:
                body = None
            query = {k: v for k, v in request.query.items() if k != "key"}
            self.requests.append(RecordedRequest(request.method, request.path, query, body))
            if raw and body is None:
                raise ApiError(400, "Invalid JSON payload received.")
            return await handler(request)
        except ApiError as e:
            return e.response()
        except web.HTTPNotFound:
            return ApiError(404, f"Method not found: {request.path}").response()
        except web.HTTPMethodNotAllowed:
            return ApiError(404, f"Method not found: {request.method} {request.path}").response()

    async def _body(self, request: web.Request) -> dict[str, Any]:
        raw = await request.read()
        body = orjson.loads(raw) if raw else {}
        if not isinstance(body, dict):
            raise ApiError(400, "Invalid JSON payload received. A JSON object is expected.")
        return body

    @staticmethod
    def _json(obj: Any, status: int = 200) -> web.Response:
        return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")

    def _resource(self, request: web.Request) -> CachedResource:
        name = f"cachedContents/{request.match_info['id']}"
        res = self._lookup(name)
        if res is None:
            raise ApiError(404, f"CachedContent not found (or permission denied): {name}")
        return res

    # ---- cachedContents ----

    def _expiry(self, body: dict[str, Any], now: float, *, default: float | None) -> float | None:
        ttl, expire = body.get("ttl"), body.get("expireTime")
        if ttl is not None and expire is not None:
            raise ApiError(400, "Only one of ttl and expire_time may be set.")
        if ttl is not None:
            seconds = parse_duration(ttl)
            if seconds is None:
                raise ApiError(400, f"Invalid value at 'cached_content.ttl' (type.googleapis.com/google.protobuf."
                                    f"Duration), Field 'ttl', Illegal duration format; {ttl!r}")  # fmt: skip
            return now + seconds
        if expire is not None:
            at = parse_rfc3339(expire)
            if at is None:
                raise ApiError(400, f"Invalid value at 'cached_content.expire_time': {expire!r}")
            return at
        return None if default is None else now + default

    async def _create(self, request: web.Request) -> web.Response:
        self.creates += 1
        body = await self._body(request)
        await self._creates_open.wait()
        if self.fail_next_create is not None:
            code, self.fail_next_create = self.fail_next_create, None
            raise ApiError(code, f"fake failure of a create (HTTP {code})")
        model = body.get("model")
        if not isinstance(model, str) or not model.startswith("models/") or len(model) <= len("models/"):
            raise ApiError(400, "* CreateCachedContentRequest.cached_content.model: model is required (models/...)")
        system = body.get("systemInstruction")
        tokens = tokens_of(_content_text(system, "cached_content.system_instruction")) if system is not None else 0
        tokens += tokens_of("".join(t for _, t in _contents(body.get("contents"), "cached_content.contents")))
        if tokens < self.min_cache_tokens:
            raise ApiError(400, f"Cached content is too small. total_token_count={tokens}, "
                                f"min_total_token_count={self.min_cache_tokens}")  # fmt: skip
        if len(self.cached) >= MAX_CACHED:
            raise ApiError(429, "Quota exceeded for cached contents (the fake's MAX_CACHED)")
        now = self.now()
        expire = self._expiry(body, now, default=DEFAULT_TTL_S)
        assert expire is not None
        name = f"cachedContents/fake{next(self._ids):012d}"
        display = body.get("displayName")
        res = CachedResource(name, model, tokens, now, now, expire, display if isinstance(display, str) else None)
        self._cached[name] = res
        return self._json(res.json())

    async def _list(self, request: web.Request) -> web.Response:
        return self._json({"cachedContents": [r.json() for r in self.cached.values()]})

    async def _get(self, request: web.Request) -> web.Response:
        return self._json(self._resource(request).json())

    async def _patch(self, request: web.Request) -> web.Response:
        self.patches += 1
        body = await self._body(request)
        res = self._resource(request)
        mask = request.query.get("updateMask") or request.query.get("update_mask")
        if mask is not None:  # only the fields it names are updated
            fields = {"expireTime" if f.strip() == "expire_time" else f.strip() for f in mask.split(",") if f.strip()}
            if fields - {"ttl", "expireTime"}:
                raise ApiError(400, f"Invalid update mask: {mask!r} (only ttl or expire_time may be updated)")
            body = {k: v for k, v in body.items() if k in fields}
        now = self.now()
        expire = self._expiry(body, now, default=None)
        if expire is None:
            raise ApiError(400, "Nothing to update: give ttl or expireTime")
        res.expire_time, res.update_time = expire, now
        return self._json(res.json())

    async def _delete(self, request: web.Request) -> web.Response:
        self.deletes += 1
        res = self._resource(request)
        del self._cached[res.name]
        return self._json({})

    # ---- generation ----

    def _cached_tokens(self, name: Any, model: str) -> int:
        if not isinstance(name, str):
            raise ApiError(400, "cachedContent must be a string (cachedContents/...)")
        res = self._lookup(name)
        if res is None:
            raise ApiError(400, "CachedContent not found (or permission denied)")
        if res.model != model:
            raise ApiError(400, f"Model used by GenerateContent request ({model}) and CachedContent ({res.model}) "
                                "has to be the same.")  # fmt: skip
        return res.tokens

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        model_id, _, method = request.match_info["call"].rpartition(":")
        if not model_id or method not in ("generateContent", "streamGenerateContent"):
            raise ApiError(404, f"Method not found: {request.path}")
        self.generates += 1
        model = f"models/{model_id}"
        body = await self._body(request)
        contents = _contents(body.get("contents"), "contents")
        if not contents:
            raise ApiError(400, "* GenerateContentRequest.contents: contents is not specified")
        system = body.get("systemInstruction")
        system_tokens = tokens_of(_content_text(system, "system_instruction")) if system is not None else 0
        cached = 0
        if body.get("cachedContent") is not None:
            if system is not None or body.get("tools") or body.get("toolConfig"):
                raise ApiError(400, _BOTH_MESSAGE)
            cached = self._cached_tokens(body["cachedContent"], model)
        cfg = body.get("generationConfig") or {}
        if not isinstance(cfg, dict):
            raise ApiError(400, "Invalid value at 'generation_config': an object is expected")
        max_words = _positive_int(cfg.get("maxOutputTokens"), "generation_config.max_output_tokens", 1 << 20)
        n = _positive_int(cfg.get("candidateCount"), "generation_config.candidate_count", MAX_CANDIDATES) or 1
        last_user = next((t for role, t in reversed(contents) if role == "user"), "")
        words, cut = _answer(last_user, max_words)
        text = " ".join(words)
        prompt = system_tokens + tokens_of("".join(t for _, t in contents)) + cached
        usage: dict[str, Any] = {
            "promptTokenCount": prompt,
            "candidatesTokenCount": len(words) * n,
            "totalTokenCount": prompt + len(words) * n,
            "promptTokensDetails": [{"modality": "TEXT", "tokenCount": prompt}],
        }
        if cached:
            usage["cachedContentTokenCount"] = cached
            usage["cacheTokensDetails"] = [{"modality": "TEXT", "tokenCount": cached}]
        reason = "MAX_TOKENS" if cut else "STOP"
        response_id = f"fake-{next(self._ids)}"

        def event(piece: str, last: bool) -> dict[str, Any]:
            cands = []
            for i in range(n):
                cand: dict[str, Any] = {"content": {"role": "model", "parts": [{"text": piece}]}, "index": i}
                if last:
                    cand["finishReason"] = reason
                cands.append(cand)
            meta = usage if last else {"promptTokenCount": prompt, "totalTokenCount": prompt}
            return {"candidates": cands, "usageMetadata": meta, "modelVersion": model_id, "responseId": response_id}

        if method == "generateContent":
            return self._json(event(text, True))
        pieces = _pieces(text)
        events = [event(p, i == len(pieces) - 1) for i, p in enumerate(pieces)]
        if request.query.get("alt") != "sse":
            return self._json(events)  # Google's streamed JSON array, sent whole
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for e in events:
            await resp.write(b"data: " + orjson.dumps(e) + b"\r\n\r\n")
        await resp.write_eof()
        return resp

    async def _openai(self, request: web.Request) -> web.StreamResponse:
        self.openai_calls += 1
        body = await self._body(request)
        model_id = body.get("model")
        if not isinstance(model_id, str) or not model_id:
            raise ApiError(400, "model is required")
        model_id = model_id.removeprefix("models/")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "messages is required")
        system, other, last_user = [], [], ""
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise ApiError(400, f"messages[{i}] must be an object")
            content = m.get("content")
            if isinstance(content, list):
                text = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
            else:
                text = content if isinstance(content, str) else ""
            if m.get("role") in ("system", "developer"):
                system.append(text)
            else:
                other.append(text)
                if m.get("role") == "user":
                    last_user = text
        cached = 0
        extra = body.get("extra_body")
        google = extra.get("google") if isinstance(extra, dict) else None
        name = google.get("cached_content") if isinstance(google, dict) else None
        if name is not None:
            if system or body.get("tools"):
                raise ApiError(400, _BOTH_MESSAGE)
            cached = self._cached_tokens(name, f"models/{model_id}")
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        max_words = _positive_int(limit, "max_tokens", 1 << 20)
        n = _positive_int(body.get("n"), "n", MAX_CANDIDATES) or 1
        words, cut = _answer(last_user, max_words)
        text = " ".join(words)
        prompt = (tokens_of("\n".join(system)) if system else 0) + tokens_of("".join(other)) + cached
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": len(words) * n,
            "total_tokens": prompt + len(words) * n,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        reason = "length" if cut else "stop"
        head = {"id": f"fake-{next(self._ids)}", "created": int(self.now()), "model": model_id}
        if not body.get("stream"):
            choices = [{"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": reason}
                       for i in range(n)]  # fmt: skip
            return self._json({**head, "object": "chat.completion", "choices": choices, "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        pieces = _pieces(text)
        for j, piece in enumerate(pieces):
            last = j == len(pieces) - 1
            choices = [
                {
                    "index": i,
                    "delta": {"role": "assistant", "content": piece} if j == 0 else {"content": piece},
                    "finish_reason": reason if last else None,
                }
                for i in range(n)
            ]
            chunk = {**head, "object": "chat.completion.chunk", "choices": choices}
            await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        options = body.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage"):
            chunk = {**head, "object": "chat.completion.chunk", "choices": [], "usage": usage}
            await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    # ---- the fake's own endpoints ----

    async def _stats(self, request: web.Request) -> web.Response:
        return self._json(
            {
                "creates": self.creates,
                "deletes": self.deletes,
                "patches": self.patches,
                "generates": self.generates,
                "openai_calls": self.openai_calls,
                "cached": {n: r.json() for n, r in self.cached.items()},
                "requests": [
                    {"method": r.method, "path": r.path, "query": r.query, "body": r.body} for r in self.requests
                ],
            }
        )

    async def _control(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if "fail_next_create" in body:
            code = body["fail_next_create"]
            self.fail_next_create = int(code) if code is not None else None
        if "advance_s" in body:
            self.advance(float(body["advance_s"]))
        if "hold_creates" in body:
            (self.hold_creates if body["hold_creates"] else self.release_creates)()
        return self._json({"ok": True})


async def start_fake_gemini(
    port: int = 0,
    *,
    api_key: str,
    min_cache_tokens: int = 2048,
    tls: ssl.SSLContext | None = None,
    host: str = "127.0.0.1",
    clock: Callable[[], float] = time.time,
) -> FakeGemini:
    """Start the fake on ``host:port`` (0: a free port) in this event loop; ``await fake.stop()`` ends it.
    ``clock`` is the fake's clock in epoch seconds (expiry, timestamps)."""
    fake = FakeGemini(api_key=api_key, min_cache_tokens=min_cache_tokens, clock=clock)
    runner = web.AppRunner(fake.app, access_log=None)
    await runner.setup()
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        await web.SockSite(runner, sock, ssl_context=tls).start()
    except BaseException:
        sock.close()
        await runner.cleanup()
        raise
    fake._runner = runner
    fake.port = sock.getsockname()[1]
    netloc = f"[{host}]" if ":" in host else host
    fake.base_url = f"{'https' if tls else 'http'}://{netloc}:{fake.port}"
    return fake


async def _serve(args: argparse.Namespace) -> None:
    with open(args.api_key_file, encoding="utf-8") as f:
        api_key = f.read().strip()
    tls = None
    if args.tls_cert:
        tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        tls.load_cert_chain(args.tls_cert, args.tls_key)
    fake = await start_fake_gemini(
        args.port, api_key=api_key, min_cache_tokens=args.min_cache_tokens, tls=tls, host=args.host
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"{READY} {fake.port}", flush=True)
    await stop.wait()
    await fake.stop()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tests.support.fake_gemini", description=__doc__.split("\n")[0])
    p.add_argument("--port", type=int, default=0, help="0: any free port (printed on the READY line)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--api-key-file", required=True)
    p.add_argument("--min-cache-tokens", type=int, default=2048)
    p.add_argument("--tls-cert", help="serve HTTPS with this certificate (PEM) ...")
    p.add_argument("--tls-key", help="... and this key")
    args = p.parse_args(argv)
    if bool(args.tls_cert) != bool(args.tls_key):
        p.error("--tls-cert and --tls-key go together")
    asyncio.run(_serve(args))


if __name__ == "__main__":
    main()
