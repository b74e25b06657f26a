"""Requests for a ``type: gemini`` backend: which backend (the request's ``model``), where on Google's API it goes,
the headers and the body it goes with, and the converter of its response. Runs on the request path: no I/O (the
API keys are read when the config is applied, and again in the background), the context cache's lookup is
synchronous. See docs/gemini.md.

- Chat completions go to the OpenAI-compatible endpoint (``/v1beta/openai/chat/completions``), or, with
  ``gemini_context_cache.prefer_native_api``, to the native ``generateContent`` / ``streamGenerateContent``; the
  picker then converts the response to the OpenAI shape (``ResponseConverter``). A chat request the native API
  cannot carry (tools, images: ``ConversionError``) goes to the OpenAI-compatible endpoint unchanged.
- Every other request for a gemini model (Responses API, embeddings, images) passes through unchanged to the
  OpenAI-compatible endpoint of the same name (``/v1/embeddings`` → ``/v1beta/openai/embeddings``).
- With the context cache on, a chat request whose system prompt is long enough references its ``cachedContents``
  resource on a hit (native: ``cachedContent``; OpenAI-compatible: ``extra_body.google.cached_content``) without
  the duplicated system prompt; a miss goes as sent while the resource is created in the background.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

import orjson

from picker.config import GeminiBackendConfig, Settings
from picker.facts import RequestFacts
from picker.gemini.context_cache import DISABLED, GeminiContextCache, Lookup
from picker.gemini.convert import (
    ConversionError,
    NativeUsage,
    StreamConverter,
    from_native_response,
    native_path,
    native_usage,
    openai_compat_with_cache,
    system_text,
    to_native_request,
)
from picker.gemini.keys import read_key_file
from picker.gemini.names import external_cluster_name

log = logging.getLogger("kv_epp.gemini")

COMPAT_PREFIX = "/v1beta/openai"  # Google's OpenAI-compatible API
API_KEY_HEADER = "x-goog-api-key"
CLIENT_CREDENTIALS = ("authorization", "x-api-key")  # the client's own never travel to Google
KEY_REFRESH_SECONDS = 60.0  # a rotated key file (a Secret's new content) is used within this
MAX_JSON_RESPONSE_BYTES = 16 << 20  # a non-streamed native answer held for its conversion; more passes as an error


class ApiKeys:
    """The API key of each gemini backend, read from its ``api_key_file`` when the config is applied
    (``load``) and again by ``refresh`` (a background task: a rotated Secret is picked up). Never logged."""

    def __init__(self) -> None:
        self._keys: dict[str, str] = {}  # api_key_file -> key; bound: the configured backends
        self._errors: dict[str, str] = {}  # api_key_file -> why it could not be read

    def load(self, backends: tuple[GeminiBackendConfig, ...]) -> None:
        keys: dict[str, str] = {}
        errors: dict[str, str] = {}
        for b in backends:
            path = b.api_key_file
            if path in keys or path in errors:
                continue
            try:
                keys[path] = read_key_file(path)
            except ValueError as exc:
                errors[path] = f"{path}: {exc}"
                log.warning("event=gemini_api_key_unreadable backend=%s error=%r", b.name, str(exc))
        self._keys, self._errors = keys, errors

    def key(self, backend: GeminiBackendConfig) -> str | None:
        return self._keys.get(backend.api_key_file)

    def error(self, backend: GeminiBackendConfig) -> str | None:
        return self._errors.get(backend.api_key_file)


class ResponseConverter:
    """A native answer → the OpenAI chat-completions shape, as its body passes through the picker: a stream
    event by event (``StreamConverter``), a JSON answer whole at its end (held up to ``MAX_JSON_RESPONSE_BYTES``).
    Only a 2xx answer is converted (``start``); an error passes as Google sent it."""

    def __init__(self, model: str, stream: bool, include_usage: bool) -> None:
        self.model = model
        self.stream = stream
        self.active = False
        self.response_id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._sse = StreamConverter(model, self.response_id, self.created, include_usage) if stream else None
        self._held: list[bytes] = []
        self._held_bytes = 0
        self._usage: NativeUsage | None = None

    @property
    def content_type(self) -> str:
        return "text/event-stream" if self.stream else "application/json"

    def start(self, status: int | None) -> bool:
        """The answer's status: convert it (2xx) or let it pass (an error, Envoy's own reply)."""
        self.active = status is not None and 200 <= status < 300
        return self.active

    @property
    def usage(self) -> NativeUsage | None:
        return self._sse.usage if self._sse is not None else self._usage

    def feed(self, chunk: bytes, end: bool) -> bytes:
        if not self.active:
            return chunk
        if self._sse is not None:
            out = self._sse.feed(chunk)
            return out + self._sse.finish() if end else out
        if self._held_bytes + len(chunk) > MAX_JSON_RESPONSE_BYTES:
            self.active = False  # too large to hold: what is held and the rest pass as sent
            held = b"".join(self._held) + chunk
            self._held.clear()
            log.warning("event=gemini_response_not_converted reason=too_large bytes=%d", self._held_bytes)
            return held
        self._held.append(chunk)
        self._held_bytes += len(chunk)
        if not end:
            return b""
        raw = b"".join(self._held)
        self._held.clear()
        try:
            native = orjson.loads(raw)
            if not isinstance(native, dict):
                raise ConversionError("the answer is not a JSON object")
            self._usage = native_usage(native)
            converted = from_native_response(
                native, model=self.model, response_id=self.response_id, created=self.created
            )
        except (orjson.JSONDecodeError, ConversionError) as exc:
            log.warning("event=gemini_response_not_converted reason=%r", str(exc)[:200])
            return raw
        return orjson.dumps(converted)


@dataclass(slots=True)
class ExternalRoute:
    """Where a request for an external backend goes and what it carries."""

    backend: GeminiBackendConfig
    cluster: str
    path: str
    set_headers: tuple[tuple[str, str], ...]
    remove_headers: tuple[str, ...]
    body: bytes | None  # the body to send instead of the client's (None: unchanged)
    converter: ResponseConverter | None  # the native API's answer → OpenAI (None: passes unchanged)
    cache: Lookup  # the context cache's answer (``DISABLED`` when off or not consulted)
    api: str  # "native", "openai" (the compatible endpoint) or "passthrough"


class GeminiRouter:
    """Chooses the gemini backend of a request by its model and builds its ``ExternalRoute``."""

    def __init__(self, settings: Settings, cache: GeminiContextCache | None, keys: ApiKeys | None = None) -> None:
        self.cache = cache
        self.keys = keys or ApiKeys()
        # restart-required: Envoy's clusters and routes for them are fixed when its config is generated, and a
        # request for a backend Envoy has no route for would take the pool's route, the API key with it
        self.backends = settings.pool.gemini
        self.by_model = {m: b for b in self.backends for m in b.models}
        self.configure(settings)

    def configure(self, settings: Settings) -> None:
        """Apply the config; a reload that changes the gemini backends is logged and not applied."""
        if settings.pool.gemini != self.backends:
            log.warning(
                "event=config_restart_required keys=%r reason=%r", "pool.backends (type: gemini)",
                "Envoy's routes to gemini backends come from its generated config: restart with the new "
                "envoy-config to add, remove or change them",
            )  # fmt: skip
        self.prefer_native = settings.gemini_context_cache.prefer_native_api
        self.keys.load(self.backends)

    def refresh_keys(self) -> None:
        """Read the key files again (a rotated Secret): run off the request path."""
        self.keys.load(self.backends)

    async def refresh_keys_forever(self) -> None:
        """Every ``KEY_REFRESH_SECONDS``, the key files again, in a worker thread (a background task)."""
        while True:
            await asyncio.sleep(KEY_REFRESH_SECONDS)
            if self.backends:
                await asyncio.to_thread(self.refresh_keys)

    def backend_for(self, model: str | None) -> GeminiBackendConfig | None:
        return self.by_model.get(model) if model else None

    def route(
        self,
        facts: RequestFacts,
        backend: GeminiBackendConfig,
        path: str,
        data: dict[str, Any] | None,
        *,
        responses_readable: bool = True,
    ) -> ExternalRoute | None:
        """The route, or None when the backend's API key could not be read. ``responses_readable``: the answer's
        body reaches the picker (Envoy's response mode ``full``); without it the native API is not used, since
        its answer could not be converted."""
        key = self.keys.key(backend)
        if key is None:
            return None
        cluster = external_cluster_name(backend.name)
        headers = [(API_KEY_HEADER, key)]
        remove = list(CLIENT_CREDENTIALS)
        if facts.api != "chat" or data is None:
            return ExternalRoute(
                backend, cluster, compat_path(path), tuple(headers), tuple(remove), None, None, DISABLED,
                "passthrough",
            )  # fmt: skip
        model = facts.model or ""
        try:
            system = system_text(data)
        except ConversionError:  # a system message with non-text parts: sent as it came, not cached
            system = None
        lookup = DISABLED
        if self.cache is not None and not _uses_tools(data):  # Google refuses a cachedContent beside tools
            lookup = self.cache.lookup(backend, model, system)
        ref = lookup.cached_content if lookup.result == "hit" else None
        if self.prefer_native and responses_readable:
            try:
                native = to_native_request(data, cached_content=ref)
                npath = native_path(model, facts.stream)
            except ConversionError as exc:
                log.debug("event=gemini_not_native reason=%r", str(exc)[:200])
            else:
                include_usage = bool((data.get("stream_options") or {}).get("include_usage")) if facts.stream else False
                conv = ResponseConverter(model, facts.stream, include_usage)
                headers.append(("content-type", "application/json"))
                remove.append("accept-encoding")  # the converter reads the answer: uncompressed
                return ExternalRoute(
                    backend, cluster, npath, tuple(headers), tuple(remove), orjson.dumps(native), conv, lookup,
                    "native",
                )  # fmt: skip
        body = orjson.dumps(openai_compat_with_cache(data, ref)) if ref is not None else None
        headers.append(("authorization", f"Bearer {key}"))  # the OpenAI-compatible API's own scheme (replaces the
        remove.remove("authorization")  # client's, so it is set rather than removed)
        return ExternalRoute(
            backend, cluster, compat_path(path), tuple(headers), tuple(remove), body, None, lookup, "openai"
        )


def _uses_tools(data: dict[str, Any]) -> bool:
    return any(data.get(k) for k in ("tools", "functions", "tool_choice", "function_call"))


def compat_path(path: str) -> str:
    """The client's OpenAI path on Google's OpenAI-compatible API: ``/v1/x`` → ``/v1beta/openai/x`` (the query
    string kept, less a ``key`` parameter: only the picker's key goes to Google)."""
    p, sep, query = path.partition("?")
    if query:
        query = "&".join(kv for kv in query.split("&") if kv.split("=", 1)[0] != "key")
        sep = "?" if query else ""
    if p.startswith("/v1/"):
        p = p[3:]
    elif p == "/v1":
        p = ""
    if not p.startswith("/"):
        p = "/" + p
    return f"{COMPAT_PREFIX}{p}{sep}{query}"
