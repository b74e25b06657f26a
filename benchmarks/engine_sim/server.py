"""The simulator's HTTP server and its in-process API, ``EngineSimulator``.

Endpoints (vLLM's shapes): ``POST /v1/chat/completions``, ``POST /v1/completions`` (streaming SSE and
not; ``usage.prompt_tokens_details.cached_tokens`` always in non-streaming responses, and in a final
``choices: []`` chunk when ``stream_options.include_usage`` is set), ``POST /v1/responses`` (non-streaming
only: ``instructions`` + ``input`` as a string or message items; a ``prompt`` template is refused with
400, as vLLM refuses it), ``POST /v1/embeddings`` (deterministic, similar texts similar: ``embeddings``),
``POST /tokenize``, ``POST /detokenize``, ``GET /health``, ``GET /v1/models`` (the model, then each LoRA adapter of
``lora_adapters`` with ``parent`` = the model), ``GET /metrics`` (with ``lora_adapters``: ``vllm:lora_requests_info``
as vLLM writes it, ``max_lora`` = ``max_loras``),
``POST /reset_prefix_cache``.

``POST /reset_prefix_cache`` is vLLM's dev-mode route (``VLLM_SERVER_DEV_MODE=1``;
vllm/entrypoints/serve/dev/cache/api_router.py), always on here. Query parameters
``reset_running_requests`` and ``reset_external`` (pydantic booleans: 1/0, true/false, yes/no, on/off,
t/f, y/n in any case; default false; the last of repeated values wins; an unreadable value is 400 with
vLLM's validation error body ``{"error": {"message", "type": "Bad Request", "param": "query.<name>",
"code": 400}}``); the body is ignored. It answers 200 ``{"success": true}`` once the cache is emptied,
and 200 ``{"success": false}`` with the cache untouched when running requests hold KV slots (no waiting,
no error; the caller may retry). ``reset_running_requests=true`` preempts every running request first
(back to the head of the waiting queue, recomputed when readmitted, ``num_preemptions`` counted), so it
succeeds. ``reset_external`` resets the KV connector's cache: the simulator has none, which vLLM treats
as success. The reset runs between two scheduler steps (a call made during a step answers when it
ends). ``AllBlocksCleared`` is not published at once: it leads the next step's event batch, so an idle
engine publishes nothing until it serves another request. The prefix-cache counters in ``/metrics`` are
unchanged; later requests miss until the cache fills again.

Request forms follow vLLM's CompletionRequest: ``prompt`` is a string, token ids (used as the prompt's
tokens, cached and published as given), a batch of strings or a batch of token-id lists (one engine
request per prompt, one choice per prompt with ``index`` 0..n-1 in prompt order, usage summed; streamed
chunks of the prompts interleave and each carries its choice's index). ``max_tokens`` is read as
pydantic's lax ``int`` reads it (``4.0`` → 4, ``4.5`` → 400). CORS as vLLM's defaults: a preflight
(``OPTIONS`` with ``Origin`` and ``Access-Control-Request-Method``) on any path gets 200 ``OK`` with
``Access-Control-Allow-Origin: *``, every method, ``Access-Control-Max-Age: 600`` and the requested
headers mirrored; any answer to a request with ``Origin`` carries ``Access-Control-Allow-Origin``.

KV transfer (``SimConfig.kv_connector``, see ``kv_transfer.py``): with ``nixl``, a request's ``kv_transfer_params``
(chat and completions, one prompt) are honoured as vLLM's NixlConnector honours them, and a non-streaming answer
to a ``do_remote_decode`` request carries the producer's ``kv_transfer_params``; ``POST /sim/kv_transfer/read``
and ``POST /sim/kv_transfer/done`` are the side channel consumers use (``{"remote_request_id",
"remote_engine_id"}``: 200 while the blocks are held, 404 otherwise). Malformed ``kv_transfer_params`` are 400.

Admin (simulator only): ``POST /sim/faults`` with any of ``{"error_rate": 0..1, "stall_ms": N,
"drop_event_batches": N, "event_drop_rate": 0..1}`` (returns the current fault settings),
``POST /sim/restart`` (cache cleared, ``AllBlocksCleared`` published as seq 0), ``GET /sim/state``.

Every response carries ``x-kv-sim-name: <config.name>`` so a client behind a proxy knows which replica
served it. Output length is exactly ``max_tokens`` (default ``default_max_tokens``); the text is
``tokenizer.output_words``. Prometheus counters are cumulative over the process life (a simulated
restart does not reset them), so Δ over a run stays meaningful.

Usage::

    sim = EngineSimulator(SimConfig(name="sim-0", time_scale=0.1))
    await sim.start()
    print(sim.base_url, sim.kv_events_endpoint, sim.replay_endpoint)
    ...
    await sim.stop()
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import random
import time
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from benchmarks.engine_sim.config import SimConfig
from benchmarks.engine_sim.embeddings import OFFLOAD_CHARS, EmbeddingsError, embeddings_body, input_chars
from benchmarks.engine_sim.kv_events import KvEventPublisher, KvEventsSettings
from benchmarks.engine_sim.kv_transfer import DONE_PATH, READ_PATH, KvTransferError, KvTransferParams
from benchmarks.engine_sim.prefix_cache import PagedPrefixCache
from benchmarks.engine_sim.scheduler import BatchScheduler, RequestRejected, SimRequest, StepOutput
from benchmarks.engine_sim.tokenizer import (
    OUTPUT_WORDS,
    Detokenizer,
    TemplateError,
    chat_token_ids,
    completion_prompts,
    lax_int,
    prompt_token_ids,
    responses_token_ids,
)

log = logging.getLogger(__name__)

NAME_HEADER = "x-kv-sim-name"
# Starlette's CORSMiddleware with vLLM's defaults: "*" methods stand for these; preflights cached 600 s.
CORS_ALL_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")
CORS_MAX_AGE = "600"
LORA_INFO_SERIES = 64  # label sets of vllm:lora_requests_info kept (vLLM keeps every one it ever set)


def error_response(status: int, message: str, err_type: str = "BadRequestError") -> web.Response:
    """vLLM's OpenAI-style error body."""
    body = {"object": "error", "message": message, "type": err_type, "param": None, "code": status}
    return web.json_response(body, status=status)


class EngineSimulator:
    """One simulated vLLM replica: HTTP server + scheduler + prefix cache + KV event publisher."""

    def __init__(self, config: SimConfig | None = None, kv_events: KvEventsSettings | None = None) -> None:
        self.config = config or SimConfig()
        self.kv_settings = kv_events or KvEventsSettings()
        self.cache = PagedPrefixCache(self.config.block_size, self.config.capacity_blocks, self.config.hash_seed)
        self.publisher: KvEventPublisher | None = (
            KvEventPublisher(self.kv_settings, drop_seed=self.config.seed) if self.config.kv_events_enabled else None
        )
        self.scheduler: BatchScheduler | None = None
        self.detokenizer = Detokenizer()
        self.detokenizer.remember(" ".join(OUTPUT_WORDS))
        self.error_rate = self.config.error_rate
        self.lora_adapters = frozenset(a.strip() for a in self.config.lora_adapters.split(",") if a.strip())
        # vllm:lora_requests_info as vLLM keeps it: one series per label set ever set, valued by when it was last
        # set; bounded here (the oldest label set goes first)
        self._lora_info: dict[tuple[str, str], float] = {}
        self._error_rng = random.Random(self.config.seed)
        self._ids = itertools.count()
        self._runner: web.AppRunner | None = None
        self.port: int = 0
        self.http_status_counts: dict[int, int] = {}

    # -- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        """Open the ZMQ sockets, start the scheduler and the HTTP server."""
        if self.publisher is not None:
            self.publisher.set_drops(drop_rate=self.config.event_drop_rate)
            await self.publisher.start()
        self.scheduler = BatchScheduler(self.config, self.cache, self.publisher)
        self.scheduler.start()
        self._runner = web.AppRunner(self.build_app(), access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        await site.start()
        server = site._server
        assert server is not None
        self.port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
        self.scheduler.side_channel = (self.config.kv_side_channel_host or self.config.host, self.port)
        log.info(
            "sim_started name=%s url=%s kv_events=%s replay=%s",
            self.config.name,
            self.base_url,
            self.kv_events_endpoint,
            self.replay_endpoint,
        )

    async def stop(self) -> None:
        """Stop serving, fail in-flight requests, close sockets."""
        if self.scheduler is not None:
            await self.scheduler.stop()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self.publisher is not None:
            await self.publisher.close()
        log.info("sim_stopped name=%s", self.config.name)

    async def __aenter__(self) -> EngineSimulator:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def base_url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    @property
    def kv_events_endpoint(self) -> str | None:
        return self.publisher.endpoint if self.publisher else None

    @property
    def replay_endpoint(self) -> str | None:
        return self.publisher.replay_endpoint if self.publisher else None

    async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_external: bool = False) -> bool:
        """vLLM's ``reset_prefix_cache`` (see the module docstring); True when the cache was emptied.
        ``reset_external`` asks to reset the KV connector's cache too: the simulator has no connector,
        which vLLM's ``reset_connector_cache`` counts as success."""
        assert self.scheduler is not None
        log.info(
            "reset_prefix_cache name=%s reset_running_requests=%s reset_external=%s",
            self.config.name,
            reset_running_requests,
            reset_external,
        )
        return await self.scheduler.reset_prefix_cache(reset_running_requests)

    # -- faults ------------------------------------------------------------------------------------
    async def restart(self) -> None:
        """Simulated restart (see ``BatchScheduler.restart``)."""
        assert self.scheduler is not None
        await self.scheduler.restart()

    def set_faults(
        self,
        error_rate: float | None = None,
        stall_ms: float | None = None,
        drop_event_batches: int | None = None,
        event_drop_rate: float | None = None,
    ) -> dict[str, Any]:
        """Change fault switches; returns the current settings."""
        assert self.scheduler is not None
        if error_rate is not None:
            self.error_rate = min(1.0, max(0.0, error_rate))
        if stall_ms is not None:
            self.scheduler.stall(stall_ms)
        if self.publisher is not None:
            self.publisher.set_drops(drop_event_batches, event_drop_rate)
        return {
            "error_rate": self.error_rate,
            "drop_event_batches": self.publisher._drop_next if self.publisher else 0,
            "event_drop_rate": self.publisher._drop_rate if self.publisher else 0.0,
        }

    # -- HTTP --------------------------------------------------------------------------------------
    def build_app(self) -> web.Application:
        """The aiohttp application (routes only; ``start`` runs it)."""
        app = web.Application(
            middlewares=[self._name_header_middleware, self._cors_middleware], client_max_size=64 * 1024**2
        )
        app.on_response_prepare.append(_cors_simple_headers)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/responses", self._responses)
        app.router.add_post("/v1/embeddings", self._embeddings)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/detokenize", self._detokenize)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/reset_prefix_cache", self._reset_prefix_cache)
        app.router.add_post("/sim/faults", self._faults)
        app.router.add_post("/sim/restart", self._restart)
        app.router.add_get("/sim/state", self._state)
        app.router.add_post(READ_PATH, self._kv_transfer_read)
        app.router.add_post(DONE_PATH, self._kv_transfer_done)
        return app

    @web.middleware
    async def _name_header_middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        response: web.StreamResponse = await handler(request)
        if not response.prepared:
            response.headers[NAME_HEADER] = self.config.name
        self.http_status_counts[response.status] = self.http_status_counts.get(response.status, 0) + 1
        return response

    @web.middleware
    async def _cors_middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """A preflight (OPTIONS with ``Origin`` and ``Access-Control-Request-Method``) on any path is
        answered here, before routing, as vLLM's CORS middleware answers it."""
        if (
            request.method == "OPTIONS"
            and "Origin" in request.headers
            and "Access-Control-Request-Method" in request.headers
        ):
            return cors_preflight(request)
        response: web.StreamResponse = await handler(request)
        return response

    async def _json_body(self, request: web.Request) -> dict[str, Any] | web.Response:
        try:
            body = await request.json(loads=json.loads)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return error_response(400, f"request body is not valid JSON: {exc}")
        if not isinstance(body, dict):
            return error_response(400, "request body must be a JSON object")
        model = body.get("model")
        if (
            model is not None
            and model != self.config.model
            and not (isinstance(model, str) and model in self.lora_adapters)
        ):
            return error_response(404, f"The model `{model}` does not exist.", "NotFoundError")
        return body

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completions")

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "responses")

    async def _embeddings(self, request: web.Request) -> web.Response:
        body = await self._json_body(request)
        if isinstance(body, web.Response):
            return body
        try:
            if input_chars(body) > OFFLOAD_CHARS:  # seconds of hashing: not on the loop that serves the engine
                answer = await asyncio.to_thread(embeddings_body, body, self.config.model)
            else:
                answer = embeddings_body(body, self.config.model)
            return web.json_response(answer)
        except EmbeddingsError as exc:
            return error_response(400, str(exc))

    def _parse_generation(self, body: Mapping[str, Any], api: str) -> tuple[list[list[int]], int]:
        """The prompts (token ids, one list per prompt) and ``max_tokens`` of a request; TemplateError."""
        if api == "chat":
            if not isinstance(body.get("messages"), list):
                raise TemplateError("'messages' must be a list")
            prompts = [chat_token_ids(body["messages"], add_generation_prompt=True)]
            max_tokens = lax_int(body.get("max_tokens"), "max_tokens")
            if max_tokens is None:
                max_tokens = lax_int(body.get("max_completion_tokens"), "max_completion_tokens")
        elif api == "responses":
            prompts = [responses_token_ids(body)]
            max_tokens = lax_int(body.get("max_output_tokens"), "max_output_tokens")
        else:
            if body.get("prompt") is None:
                raise TemplateError("At least one of `prompt` or `prompt_embeds` must be set.")
            prompts = completion_prompts(body["prompt"])
            max_tokens = lax_int(body.get("max_tokens"), "max_tokens")
        if any(not ids for ids in prompts):
            raise TemplateError("the prompt is empty")
        if max_tokens is None:
            max_tokens = self.config.default_max_tokens
        if max_tokens < 1:
            raise TemplateError(f"max_tokens must be at least 1, got {max_tokens}")
        return prompts, max_tokens

    async def _generate(self, request: web.Request, api: str) -> web.StreamResponse:
        body = await self._json_body(request)
        if isinstance(body, web.Response):
            return body
        try:
            prompts, max_tokens = self._parse_generation(body, api)
        except TemplateError as exc:
            return error_response(400, str(exc))
        stream = bool(body.get("stream", False))
        if stream and api == "responses":
            return error_response(400, "the simulator's /v1/responses does not stream (set stream: false)")
        stream_options = body.get("stream_options") or {}
        include_usage = isinstance(stream_options, Mapping) and bool(stream_options.get("include_usage"))
        scheduler = self.scheduler
        assert scheduler is not None
        kv_params: KvTransferParams | None = None
        if self.config.kv_connector != "none":
            try:
                kv_params = KvTransferParams.parse(body.get("kv_transfer_params"))
            except KvTransferError as exc:
                return error_response(400, str(exc))
            if kv_params is not None and len(prompts) > 1:
                log.warning(
                    "kv_transfer_params_ignored name=%s reason=batch prompts=%d", self.config.name, len(prompts)
                )
                kv_params = None  # one transfer per engine request: a batch's prompts cannot share one
        try:
            for ids in prompts:
                scheduler.check(len(ids), max_tokens)
        except RequestRejected as exc:
            return error_response(400, str(exc))
        if self.error_rate > 0 and self._error_rng.random() < self.error_rate:
            return error_response(500, "injected fault: internal server error", "InternalServerError")
        prefix = {"chat": "chatcmpl", "completions": "cmpl", "responses": "resp"}[api]
        base_id = f"{prefix}-{self.config.name}-{next(self._ids)}"
        # One engine request per prompt (vLLM: ``{request_id}-{i}``), each cached and published on its own.
        model = body.get("model")
        lora = model if isinstance(model, str) and model in self.lora_adapters else None
        salt = body.get("cache_salt")
        salt = salt if isinstance(salt, str) and salt else None
        batch = [
            SimRequest(
                base_id if len(prompts) == 1 else f"{base_id}-{i}",
                ids,
                max_tokens,
                lora_name=lora,
                cache_salt=salt,
                kv_params=kv_params,
            )
            for i, ids in enumerate(prompts)
        ]
        for sim_request in batch:
            scheduler.submit(sim_request)
        try:
            if stream:
                return await self._stream(request, base_id, batch, api == "chat", include_usage)
            return await self._collect(base_id, batch, api)
        finally:
            for sim_request in batch:
                scheduler.abort(sim_request)  # no-op when it finished

    def _usage(self, batch: list[SimRequest]) -> dict[str, Any]:
        """Usage summed over the prompts of a request (vLLM sums prompt and completion tokens; the
        simulator sums ``cached_tokens`` too, where vLLM reports a single prompt's)."""
        prompt = sum(r.prompt_tokens for r in batch)
        completion = sum(r.generated for r in batch)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(r.cached_tokens for r in batch)},
        }

    async def _collect(self, base_id: str, batch: list[SimRequest], api: str) -> web.Response:
        texts: list[str] = []
        for r in batch:  # the scheduler runs them together; each queue is read to its end in turn
            words: list[str] = []
            while True:
                item = await r.outputs.get()
                if item.kind == "token":
                    words.append(item.text)
                elif item.kind == "error":
                    return engine_error_response(item)
                else:
                    break
            texts.append(" ".join(words))
        created = int(time.time())
        if api == "responses":
            return web.json_response(self._responses_body(base_id, batch[0], texts[0], created))
        choices: list[dict[str, Any]] = []
        for index, text in enumerate(texts):
            choice: dict[str, Any] = {"index": index, "finish_reason": "length", "logprobs": None}
            if api == "chat":
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choices.append(choice)
        answer: dict[str, Any] = {
            "id": base_id,
            "object": "chat.completion" if api == "chat" else "text_completion",
            "created": created,
            "model": self.config.model,
            "choices": choices,
            "usage": self._usage(batch),
        }
        if batch[0].kv_transfer_out is not None:  # a NIXL producer's prefill: where the consumer reads its KV
            answer["kv_transfer_params"] = batch[0].kv_transfer_out
        return web.json_response(answer)

    def _responses_body(self, base_id: str, r: SimRequest, text: str, created: int) -> dict[str, Any]:
        """vLLM's Responses API answer (``object: response``) for one finished request."""
        return {
            "id": base_id,
            "object": "response",
            "created_at": created,
            "model": self.config.model,
            "status": "completed",
            "output": [
                {
                    "id": f"msg_{base_id}",
                    "type": "message",
                    "role": "assistant",
                    "status": "completed",
                    "content": [{"type": "output_text", "text": text, "annotations": []}],
                }
            ],
            "usage": {
                "input_tokens": r.prompt_tokens,
                "input_tokens_details": {"cached_tokens": r.cached_tokens},
                "output_tokens": r.generated,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": r.prompt_tokens + r.generated,
            },
        }

    async def _stream(
        self, request: web.Request, base_id: str, batch: list[SimRequest], chat: bool, include_usage: bool
    ) -> web.StreamResponse:
        merged = _MergedOutputs(batch)
        try:
            return await self._write_stream(request, base_id, batch, merged, chat, include_usage)
        finally:
            merged.close()

    async def _write_stream(
        self,
        request: web.Request,
        base_id: str,
        batch: list[SimRequest],
        merged: _MergedOutputs,
        chat: bool,
        include_usage: bool,
    ) -> web.StreamResponse:
        # vLLM and SGLang answer a stream with a StreamingResponse whose generator submits the request to the
        # engine: the headers go out before prefill (``admitted``); ``first_token`` waits for the first token,
        # so an engine failure before it can still be a status code
        admitted = self.config.stream_headers == "admitted"
        if not admitted:
            index, item = await merged.get()
            if item.kind == "error":
                return engine_error_response(item)
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                NAME_HEADER: self.config.name,
            }
        )
        await response.prepare(request)
        if admitted:
            index, item = await merged.get()
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
            data: dict[str, Any] = {
                "id": base_id,
                "object": obj,
                "created": created,
                "model": self.config.model,
                "choices": choices,
            }
            if usage is not None:
                data["usage"] = usage
            return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"

        def piece(i: int, text: str, finish: str | None) -> dict[str, Any]:
            if chat:
                return {"index": i, "delta": {"content": text}, "logprobs": None, "finish_reason": finish}
            return {"index": i, "text": text, "logprobs": None, "finish_reason": finish}

        if chat:
            role = {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            await response.write(chunk([role]))
        emitted = [0] * len(batch)  # tokens written per choice (a space precedes every word but the first)
        finished = 0
        while True:
            if item.kind == "error":
                break  # engine restarted/stopped: end the stream without [DONE]
            if item.kind == "done":
                last = {"index": index, "delta": {}, "logprobs": None, "finish_reason": "length"}
                await response.write(chunk([last] if chat else [piece(index, "", "length")]))
                finished += 1
                if finished == len(batch):
                    if include_usage:
                        await response.write(chunk([], self._usage(batch)))
                    await response.write(b"data: [DONE]\n\n")
                    break
            else:
                text = item.text if emitted[index] == 0 else " " + item.text
                await response.write(chunk([piece(index, text, None)]))
                emitted[index] += 1
            index, item = await merged.get()
        await response.write_eof()
        return response

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await self._json_body(request)
        if isinstance(body, web.Response):
            return body
        try:
            if "messages" in body:
                messages = body["messages"]
                if not isinstance(messages, list):
                    raise TemplateError("'messages' must be a list")
                ids = chat_token_ids(messages, bool(body.get("add_generation_prompt", True)))
                for m in messages:
                    if isinstance(m, Mapping) and isinstance(m.get("content"), str):
                        self.detokenizer.remember(m["content"])
            elif "prompt" in body:
                prompt = body["prompt"]
                if not isinstance(prompt, str | list):
                    raise TemplateError("'prompt' must be a string or a list of token ids")
                ids = prompt_token_ids(prompt)
                if isinstance(prompt, str):
                    self.detokenizer.remember(prompt)
            else:
                raise TemplateError("expected 'prompt' or 'messages'")
        except TemplateError as exc:
            return error_response(400, str(exc))
        return web.json_response({"count": len(ids), "max_model_len": self.config.max_model_len, "tokens": ids})

    async def _detokenize(self, request: web.Request) -> web.Response:
        body = await self._json_body(request)
        if isinstance(body, web.Response):
            return body
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            return error_response(400, "'tokens' must be a list of integers")
        return web.json_response({"prompt": self.detokenizer.decode(tokens)})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _models(self, request: web.Request) -> web.Response:
        """vLLM's shape: the base model (``parent`` null), then each adapter with ``parent`` = the base model."""
        model = {
            "id": self.config.model,
            "object": "model",
            "created": 0,
            "owned_by": "kv-sim",
            "root": self.config.model,
            "parent": None,
            "max_model_len": self.config.max_model_len,
        }
        adapters = [
            {"id": a, "object": "model", "created": 0, "owned_by": "kv-sim", "root": a, "parent": self.config.model}
            for a in sorted(self.lora_adapters)
        ]
        return web.json_response({"object": "list", "data": [model, *adapters]})

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=self.render_metrics(), content_type="text/plain", charset="utf-8")

    def render_metrics(self) -> str:
        """Prometheus text exposition with vLLM's metric names and labels."""
        scheduler = self.scheduler
        assert scheduler is not None
        c = scheduler.counters
        labels = f'engine="{self.config.engine_label}",model_name="{self.config.model}"'
        lines: list[str] = []

        def metric(name: str, kind: str, help_text: str, value: float, extra: str = "") -> None:
            family = name.removesuffix("_total") if kind == "counter" else name
            lines.append(f"# HELP {family} {help_text}")
            lines.append(f"# TYPE {family} {kind}")
            lines.append(f"{name}{{{labels}{extra}}} {float(value)!r}")

        metric(
            "vllm:num_requests_running",
            "gauge",
            "Requests in model execution batches.",
            len(scheduler.running),
        )
        metric("vllm:num_requests_waiting", "gauge", "Requests waiting to be processed.", scheduler.num_waiting)
        metric(
            "vllm:kv_cache_usage_perc",
            "gauge",
            "KV-cache usage. 1 means 100 percent usage.",
            self.cache.usage_fraction,
        )
        metric(
            "vllm:prefix_cache_queries_total",
            "counter",
            "Prefix cache queries, in tokens.",
            c.prefix_cache_queries,
        )
        metric("vllm:prefix_cache_hits_total", "counter", "Prefix cache hits, in tokens.", c.prefix_cache_hits)
        metric("vllm:num_preemptions_total", "counter", "Cumulative number of preemptions.", c.preemptions)
        metric("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.", c.prompt_tokens)
        metric(
            "vllm:generation_tokens_total",
            "counter",
            "Number of generation tokens processed.",
            c.generation_tokens,
        )
        for family, help_text, total in (
            ("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.",
             c.prefill_seconds),
            ("vllm:request_prefill_kv_computed_tokens",
             "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
             float(c.prefill_computed_tokens)),
        ):  # fmt: skip
            lines.append(f"# HELP {family} {help_text}")
            lines.append(f"# TYPE {family} histogram")
            lines.append(f'{family}_bucket{{{labels},le="+Inf"}} {float(c.prefill_requests)!r}')
            lines.append(f"{family}_count{{{labels}}} {float(c.prefill_requests)!r}")
            lines.append(f"{family}_sum{{{labels}}} {float(total)!r}")
        lines.append("# HELP vllm:request_success Count of successfully processed requests.")
        lines.append("# TYPE vllm:request_success counter")
        lines.append(f'vllm:request_success_total{{{labels},finished_reason="length"}} {float(c.requests_finished)!r}')
        lines.append(f'vllm:request_success_total{{{labels},finished_reason="abort"}} {float(c.requests_aborted)!r}')
        metric("kv_sim_restarts_total", "counter", "Simulated engine restarts.", c.restarts)
        metric("kv_sim_steps_total", "counter", "Scheduler steps.", c.steps)
        metric(
            "kv_sim_decode_steps_with_prefill_total",
            "counter",
            "Steps in which running streams decoded beside prefill tokens (their tokens waited for the prefill).",
            c.decode_steps_with_prefill,
        )
        metric(
            "kv_sim_prefill_tokens_in_decode_steps_total",
            "counter",
            "Prefill tokens computed in steps that also decoded running streams.",
            c.prefill_tokens_in_decode_steps,
        )
        if self.config.kv_connector != "none":
            metric(
                "vllm:external_prefix_cache_queries_total",
                "counter",
                "External prefix cache queries from KV connector cross-instance cache sharing, in terms of number "
                "of queried tokens.",
                c.external_prefix_cache_queries,
            )
            metric(
                "vllm:external_prefix_cache_hits_total",
                "counter",
                "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of "
                "cached tokens.",
                c.external_prefix_cache_hits,
            )
            metric("kv_sim_kv_loads_total", "counter", "KV loads through the connector completed.", c.kv_loads)
            metric(
                "kv_sim_kv_load_failures_total", "counter", "KV loads through the connector failed.", c.kv_load_failures
            )
            metric(
                "kv_sim_kv_transfers_held_total",
                "counter",
                "NIXL producer: finished prefills whose blocks were held for a consumer.",
                c.kv_transfers_held,
            )
            metric(
                "kv_sim_kv_tokens_written_total", "counter", "Shared storage: KV tokens written.", c.kv_tokens_written
            )
        if self.lora_adapters:
            lines.extend(self._lora_requests_info(scheduler))
        return "\n".join(lines) + "\n"

    def _lora_requests_info(self, scheduler: BatchScheduler) -> list[str]:
        """vLLM's ``lora_requests_info``: both adapter labels list every adapter with a request in flight (as vLLM's
        v1 scheduler stats do), the value is the time the label set was last set, and earlier label sets stay."""
        in_flight = ",".join(
            dict.fromkeys(r.lora_name for r in (*scheduler.running, *scheduler.waiting) if r.lora_name is not None)
        )
        key = (in_flight, in_flight)
        self._lora_info.pop(key, None)
        self._lora_info[key] = time.time()
        while len(self._lora_info) > LORA_INFO_SERIES:
            del self._lora_info[next(iter(self._lora_info))]
        out = [
            "# HELP vllm:lora_requests_info Running stats on lora requests.",
            "# TYPE vllm:lora_requests_info gauge",
        ]
        for (running, waiting), at in self._lora_info.items():
            out.append(
                f'vllm:lora_requests_info{{max_lora="{self.config.max_loras}",running_lora_adapters="{running}",'
                f'waiting_lora_adapters="{waiting}"}} {at!r}'
            )
        return out

    async def _faults(self, request: web.Request) -> web.Response:
        body = await self._json_body(request)
        if isinstance(body, web.Response):
            return body
        try:
            current = self.set_faults(
                error_rate=_opt_float(body, "error_rate"),
                stall_ms=_opt_float(body, "stall_ms"),
                drop_event_batches=_opt_int(body, "drop_event_batches"),
                event_drop_rate=_opt_float(body, "event_drop_rate"),
            )
        except ValueError as exc:
            return error_response(400, str(exc))
        log.info("faults_set name=%s %s", self.config.name, json.dumps(body, sort_keys=True))
        return web.json_response(current)

    async def _reset_prefix_cache(self, request: web.Request) -> web.Response:
        flags: dict[str, bool] = {}
        errors: list[dict[str, str]] = []
        for name in ("reset_running_requests", "reset_external"):
            values = request.query.getall(name, [])
            if not values:
                flags[name] = False
                continue
            value = _query_bool(values[-1])  # FastAPI reads the last of repeated values
            if value is None:
                errors.append(
                    {
                        "type": "bool_parsing",
                        "loc": f"query.{name}",
                        "msg": "Input should be a valid boolean, unable to interpret input",
                        "input": values[-1],
                    }
                )
            else:
                flags[name] = value
        if errors:
            return validation_error_response(errors)
        success = await self.reset_prefix_cache(flags["reset_running_requests"], flags["reset_external"])
        return web.json_response({"success": success})

    async def _restart(self, request: web.Request) -> web.Response:
        await self.restart()
        return web.json_response({"restarted": True, "next_seq": self.publisher.next_seq if self.publisher else None})

    async def _state(self, request: web.Request) -> web.Response:
        scheduler = self.scheduler
        assert scheduler is not None
        return web.json_response(
            {
                "name": self.config.name,
                "cached_blocks": len(self.cache),
                "evictable_blocks": self.cache.evictable_blocks,
                "used_slots": self.cache.used_slots,
                "capacity_blocks": self.cache.capacity_blocks,
                "running": len(scheduler.running),
                "waiting": scheduler.num_waiting,
                "kv_role": self.config.kv_role if self.config.kv_connector != "none" else None,
                "kv_connector": self.config.kv_connector,
                "kv_transfers_held": len(scheduler.held),
                "next_event_seq": self.publisher.next_seq if self.publisher else None,
                "event_batches_dropped": self.publisher.batches_dropped if self.publisher else 0,
            }
        )

    async def _kv_transfer_read(self, request: web.Request) -> web.Response:
        """NIXL side channel: a consumer asks for a held prefill's blocks (200) or learns they are gone (404)."""
        body = await self._json_body(request)
        if isinstance(body, web.Response):
            return body
        scheduler = self.scheduler
        assert scheduler is not None
        held = scheduler.held.get(str(body.get("remote_request_id")))
        if held is None or body.get("remote_engine_id") != scheduler.engine_id:
            return error_response(
                404, f"no KV held for request {body.get('remote_request_id')!r} on engine {scheduler.engine_id}",
                "NotFoundError",
            )  # fmt: skip
        return web.json_response({"tokens": held.tokens, "remote_block_ids": list(held.block_ids)})

    async def _kv_transfer_done(self, request: web.Request) -> web.Response:
        """NIXL side channel: the consumer has read the blocks; they are freed."""
        body = await self._json_body(request)
        if isinstance(body, web.Response):
            return body
        scheduler = self.scheduler
        assert scheduler is not None
        if body.get("remote_engine_id") != scheduler.engine_id:
            return web.json_response({"released": False})
        return web.json_response({"released": scheduler.held.done(str(body.get("remote_request_id")))})


class _MergedOutputs:
    """The outputs of a request's prompts as ``(prompt index, item)`` in the order the scheduler makes
    them (vLLM merges its per-prompt generators the same way). One prompt is read directly; a batch
    gets one forwarding task per prompt, cancelled by ``close``. Bound: each forwarder stops after its
    request's done/error item, so the merged queue holds at most the batch's total output items."""

    def __init__(self, batch: list[SimRequest]) -> None:
        self._batch = batch
        self._queue: asyncio.Queue[tuple[int, StepOutput]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        if len(batch) > 1:
            self._tasks = [asyncio.create_task(self._forward(i, r)) for i, r in enumerate(batch)]

    async def _forward(self, index: int, r: SimRequest) -> None:
        while True:
            item = await r.outputs.get()
            self._queue.put_nowait((index, item))
            if item.kind != "token":
                return

    async def get(self) -> tuple[int, StepOutput]:
        if not self._tasks:
            return 0, await self._batch[0].outputs.get()
        return await self._queue.get()

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()


def engine_error_response(item: StepOutput) -> web.Response:
    """A request the engine failed: 500 (vLLM's answer to an error finish, e.g. a failed KV load) or 503
    (the engine stopped or restarted)."""
    if item.status == 500:
        return error_response(500, item.text, "InternalServerError")
    return error_response(item.status, item.text, "ServiceUnavailableError")


def cors_preflight(request: web.Request) -> web.Response:
    """A CORS preflight answered as vLLM answers it with its default settings: Starlette's
    CORSMiddleware with ``allow_origins=["*"]``, ``allow_methods=["*"]``, ``allow_headers=["*"]``,
    ``allow_credentials=False`` (vllm/entrypoints/openai/cli_args.py, api_server.py)."""
    headers = {
        "Access-Control-Allow-Origin": "*",
        "Access-Control-Allow-Methods": ", ".join(CORS_ALL_METHODS),
        "Access-Control-Max-Age": CORS_MAX_AGE,
    }
    requested_headers = request.headers.get("Access-Control-Request-Headers")
    if requested_headers is not None:
        headers["Access-Control-Allow-Headers"] = requested_headers  # every header allowed: mirrored
    if request.headers["Access-Control-Request-Method"] not in CORS_ALL_METHODS:
        return web.Response(status=400, text="Disallowed CORS method", headers=headers)
    return web.Response(status=200, text="OK", headers=headers)


async def _cors_simple_headers(request: web.Request, response: web.StreamResponse) -> None:
    """``Access-Control-Allow-Origin`` on every answer to a request with ``Origin`` (Starlette's simple
    response: ``*``, or the origin itself with ``Vary: Origin`` when the request carries cookies)."""
    origin = request.headers.get("Origin")
    if origin is None:
        return
    if "Cookie" in request.headers:
        response.headers["Access-Control-Allow-Origin"] = origin
        vary = response.headers.get("Vary")
        response.headers["Vary"] = f"{vary}, Origin" if vary else "Origin"
    else:
        response.headers["Access-Control-Allow-Origin"] = "*"


_QUERY_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_QUERY_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})
_MAX_ERROR_INPUT_CHARS = 200  # vLLM bounds the input echoed in a validation error


def _query_bool(raw: str) -> bool | None:
    """A query value read as pydantic's lax ``bool`` reads a string (no stripping); None if unreadable."""
    lowered = raw.lower()
    if lowered in _QUERY_TRUE:
        return True
    if lowered in _QUERY_FALSE:
        return False
    return None


def validation_error_response(errors: list[dict[str, str]]) -> web.Response:
    """vLLM's answer to a FastAPI RequestValidationError (vllm/entrypoints/serve/exception_handling/
    handlers/validation.py): 400 with ``{"error": {message, type, param, code}}``, the message listing
    each error as a Python dict, ``param`` the first error's location."""
    shown = []
    for err in errors:
        entry = dict(err)
        if len(entry["input"]) > _MAX_ERROR_INPUT_CHARS:
            entry["input"] = entry["input"][:_MAX_ERROR_INPUT_CHARS] + "...[truncated]"
        shown.append(entry)
    label = "error" if len(errors) == 1 else "errors"
    message = f"{len(errors)} validation {label}:\n" + "\n".join(f"  {entry}" for entry in shown)
    body = {"error": {"message": message, "type": "Bad Request", "param": errors[0]["loc"], "code": 400}}
    return web.json_response(body, status=400)


def _opt_float(body: Mapping[str, Any], key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ValueError(f"'{key}' must be a number")
    return float(value)


def _opt_int(body: Mapping[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"'{key}' must be an integer")
    return value


async def run_until_cancelled(sim: EngineSimulator) -> None:
    """Serve until the task is cancelled, then stop."""
    await sim.start()
    try:
        await asyncio.Event().wait()
    finally:
        await sim.stop()
