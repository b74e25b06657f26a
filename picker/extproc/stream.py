"""One ext_proc stream (one HTTP request): Envoy's messages in, the request path's results out. The stream's state
is an explicit ``Phase``; body and response modes, the in-flight slot's release and the routing-latency sample
are this module's; the work is the request path's.
See docs/picker.md, "The Envoy protocol".
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from enum import Enum

from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from picker.extproc.messages import (
    BUFFERED,
    BUFFERED_PARTIAL,
    DEST_HEADER,
    FULL_DUPLEX,
    MAX_STREAMED_CHUNK,
    RESPONSE_NONE,
    STREAMED,
    external_pick_response,
    header_value,
    immediate,
    pick_response,
    response_headers_answer,
    sampled_headers_answer,
    served_endpoint,
    streamed_chunks,
    streamed_response_body,
    subset_hint,
)
from picker.extproc.sampling import ResponseSampling
from picker.facts import Answer, BadRequest, error_body
from picker.ops.metrics import STATUS_OUTCOMES, RouteSeconds
from picker.ops.usage import keep_tail
from picker.request.exchange import Exchange
from picker.request.external import ExternalExchange
from picker.request.path import Inbound, RequestPath, ResponseCache
from picker.routing.endpoints import Decision

__all__ = ["MAX_STREAMED_CHUNK", "RESPONSE_PHASES", "Phase", "RequestStream", "error_body", "immediate"]

_mono = time.monotonic
RESPONSE_PHASES = frozenset({"response_headers", "response_body", "response_trailers"})
ROUTE_AT_HEADERS_MODES = frozenset({processing_mode_pb2.ProcessingMode.NONE, STREAMED, BUFFERED_PARTIAL})
_NOTHING: tuple[pb.ProcessingResponse, ...] = ()
_HEADERS_OK = pb.ProcessingResponse(response_headers=pb.HeadersResponse())
_TRAILERS_OK = pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
_RESPONSE_TRAILERS_OK = pb.ProcessingResponse(response_trailers=pb.TrailersResponse())
_BODY_OK = pb.ProcessingResponse(request_body=pb.BodyResponse())
_RESPONSE_BODY_OK = pb.ProcessingResponse(response_body=pb.BodyResponse())
_STRIP_DEST = pb.ProcessingResponse(
    request_headers=pb.HeadersResponse(
        response=pb.CommonResponse(header_mutation=pb.HeaderMutation(remove_headers=[DEST_HEADER]))
    )
)


class Phase(Enum):
    HEADERS = "headers"  # waiting for the request headers
    BODY = "body"  # buffering the request body before the pick
    ROUTED = "routed"  # the pick is sent; the request passes through, the response is awaited
    RESPONSE = "response"  # response headers seen; the response body passes through
    DONE = "done"  # the picker answered the request itself, or the response ended


def with_bypass(cache: ResponseCache | None, headers: Sequence[tuple[str, str]]) -> Sequence[tuple[str, str]]:
    """The picker's own answers (400, 429, 503) carry ``x-cache: BYPASS`` when the response cache is on:
    nothing was looked up."""
    if cache is not None and cache.enabled and not any(k == "x-cache" for k, _ in headers):
        return (*headers, ("x-cache", "BYPASS"))
    return headers


class RequestStream:
    """State of one ext_proc stream (one HTTP request). Its collaborators: the request path (``stages``), the
    routing-latency histogram and the response sampling (None: no response is sampled, nothing is counted)."""

    __slots__ = (
        "answer", "body", "body_len", "exchange", "headers", "headers_at", "mode", "opted_in", "path", "phase",
        "reserved", "resp_mode", "route_seconds", "sampled", "sampling", "stages", "subset", "tail",
    )  # fmt: skip

    def __init__(
        self, stages: RequestPath, route_seconds: RouteSeconds, sampling: ResponseSampling | None = None
    ) -> None:
        self.stages = stages
        self.route_seconds = route_seconds
        self.sampling = sampling  # None: no response is sampled, nothing is counted
        self.opted_in = False  # the request carries the sampling opt-in header
        self.sampled = False  # this response's body streams through the picker for its usage
        self.tail = b""  # the last bytes of a sampled response body
        self.phase = Phase.HEADERS
        self.headers: dict[str, str] = {}
        self.path = "/"
        self.body: list[bytes] = []
        self.body_len = 0
        self.reserved = 0  # body bytes this stream holds of admission's shared budget (released once)
        self.mode = FULL_DUPLEX if stages.settings.extproc.default_body_mode == "FULL_DUPLEX_STREAMED" else BUFFERED
        self.resp_mode = self.mode
        self.subset: list[str] | None = None
        self.exchange: Exchange | None = None
        self.headers_at = 0.0  # monotonic time the request headers arrived; 0.0 once the routing answer is counted
        self.answer: str | None = None  # the outcome of a routing answer built and not yet sent (ROUTE_OUTCOMES)

    @property
    def done(self) -> bool:
        return self.phase is Phase.DONE

    @property
    def decision(self) -> Decision | None:
        return self.exchange.decision if self.exchange is not None else None

    @property
    def answered_itself(self) -> bool:
        """The picker sent an ImmediateResponse: nothing more will come on this stream."""
        return self.phase is Phase.DONE and self.exchange is None

    # -- dispatch ---------------------------------------------------------------------------------
    async def handle(self, req: pb.ProcessingRequest) -> Sequence[pb.ProcessingResponse]:
        """Any message. The servicer calls ``respond`` directly for response phases (no coroutine)."""
        phase = req.WhichOneof("request")
        if phase in RESPONSE_PHASES:
            return self.respond(req, phase)
        return await self.request(req, phase)

    async def request(self, req: pb.ProcessingRequest, phase: str | None) -> Sequence[pb.ProcessingResponse]:
        """A request-phase message (headers, body, trailers): the only ones that may wait on routing."""
        if req.HasField("protocol_config"):  # Envoy announces its modes on the stream's first message
            self.mode = req.protocol_config.request_body_mode
            self.resp_mode = req.protocol_config.response_body_mode
        if req.HasField("metadata_context"):
            hint = subset_hint(req)
            if hint is not None:
                self.subset = hint
        if phase == "request_headers":
            return await self._request_headers(req.request_headers)
        if phase == "request_body":
            return await self._request_body(req.request_body)
        if phase == "request_trailers":
            return await self._request_trailers()
        return _NOTHING

    def respond(self, req: pb.ProcessingRequest, phase: str | None) -> Sequence[pb.ProcessingResponse]:
        """A response-phase message: synchronous, it runs for every response chunk."""
        if phase == "response_body":
            return self._response_body(req.response_body)
        if phase == "response_headers":
            return self._response_headers(req.response_headers, served_endpoint(req))
        self._end_response()  # response_trailers
        return (_RESPONSE_TRAILERS_OK,)

    def answer_sent(self) -> None:
        """The servicer handed the routing answer to gRPC: one ``continuum_picker_route_seconds`` sample, once
        per request (a later answer, e.g. an error after the pick, adds none)."""
        outcome = self.answer
        self.answer = None
        if outcome is not None and self.headers_at:
            self.route_seconds.observe(outcome, _mono() - self.headers_at)
            self.headers_at = 0.0

    # -- request phases ---------------------------------------------------------------------------
    async def _request_headers(self, msg: pb.HttpHeaders) -> Sequence[pb.ProcessingResponse]:
        self.headers_at = _mono()
        wanted = self.stages.wanted_headers
        opt_in = self.sampling.header if self.sampling is not None else None
        for h in msg.headers.headers:
            key = h.key  # Envoy hands header names lower-cased (HTTP/2 requires it; HTTP/1 is normalised)
            if key in wanted:  # decode only what routing reads
                self.headers[key] = header_value(h)
            elif key == opt_in:
                self.opted_in = True
        self.path = self.headers.get(":path", "/")
        if msg.end_of_stream:
            return await self._route(b"", at_headers=True)
        if self.mode in ROUTE_AT_HEADERS_MODES:
            return await self._route(None, at_headers=True)
        self.phase = Phase.BODY
        refused = self._reserve_declared_body()
        if refused is not None:
            return (refused,)
        if self.mode == FULL_DUPLEX:
            return _NOTHING  # deferred until the body is complete
        return (_STRIP_DEST,)

    async def _request_body(self, msg: pb.HttpBody) -> Sequence[pb.ProcessingResponse]:
        if self.phase is not Phase.BODY:  # routed at the headers phase: chunks pass through
            if self.phase is Phase.DONE:
                return _NOTHING
            return (_BODY_OK,) if self.mode in ROUTE_AT_HEADERS_MODES else _NOTHING
        if msg.body:
            self.body_len += len(msg.body)
            limit = self.stages.max_body_bytes
            if self.body_len > limit:
                self.body.clear()
                return (self._too_large(limit),)
            if self.body_len > self.reserved:  # beyond the declared length (or none declared): reserve it
                need = self.body_len - self.reserved
                if not self.stages.admission.reserve(need):
                    self.body.clear()
                    return (self._answer_itself(self.stages.overloaded("the request-body buffer is full")),)
                self.reserved += need
            self.body.append(msg.body)
        if not msg.end_of_stream and self.mode == FULL_DUPLEX:
            return _NOTHING
        return await self._route(self._take_body(), at_headers=False)

    async def _request_trailers(self) -> Sequence[pb.ProcessingResponse]:
        out: list[pb.ProcessingResponse] = []
        if self.phase is Phase.BODY:  # the body ended without end_of_stream: the trailers end it
            out.extend(await self._route(self._take_body(), at_headers=False, body_eos=False))
        if self.phase is not Phase.DONE:
            out.append(_TRAILERS_OK)
        return out

    def _reserve_declared_body(self) -> pb.ProcessingResponse | None:
        """Admission at the headers phase: a declared ``Content-Length`` that does not fit in the shared body
        budget is a 429 before a byte of the body is buffered. A body over the per-stream limit is answered
        400 in the body phase, once it passes the limit: answering at the headers while the client is still
        uploading megabytes makes Envoy close the connection under the upload, and the client sees a reset
        instead of the JSON 400 (seen under load)."""
        declared = self.headers.get("content-length")
        if declared is None or not (declared.isascii() and declared.isdigit() and len(declared) <= 19):
            return None  # chunked (or malformed: Envoy rejects it): reserved chunk by chunk
        n = min(int(declared), self.stages.max_body_bytes)  # never buffered beyond the limit
        if not self.stages.admission.reserve(n):
            return self._answer_itself(self.stages.overloaded("the request-body buffer is full"))
        self.reserved = n
        return None

    def _too_large(self, limit: int) -> pb.ProcessingResponse:
        exc = BadRequest(f"request body exceeds the limit of {limit} bytes", "body_too_large")
        self.stages.recorder.refused("bad_request")
        return self._answer_itself(Answer(400, exc.json_body(), f"kv_epp_bad_request:{exc.code}"))

    def _release_body(self) -> None:
        """Give the stream's body reservation back (idempotent: the body went on, was refused, or the
        stream closed)."""
        if self.reserved:
            self.stages.admission.release(self.reserved)
            self.reserved = 0

    def _take_body(self) -> bytes:
        body = b"".join(self.body)
        self.body.clear()
        return body

    async def _route(
        self, body: bytes | None, *, at_headers: bool, body_eos: bool = True
    ) -> Sequence[pb.ProcessingResponse]:
        try:
            readable = self.resp_mode in (FULL_DUPLEX, STREAMED)
            arrived = self.headers_at or None
            result = await self.stages.route(Inbound(self.path, self.headers, body, self.subset, readable, arrived))
        finally:
            self._release_body()  # the body is out of the stream's buffer (echoed or refused)
        if isinstance(result, Answer):
            return (self._answer_itself(result),)
        self.exchange = result
        self.phase = Phase.ROUTED
        self.answer = "routed"
        if isinstance(result, ExternalExchange):
            return self._pick_external(result, body or b"", at_headers, body_eos)
        dest = result.decision.destinations()
        pre = result.decision.prefiller()
        if result.body_out is not None and not at_headers:  # the request path rewrote the body (Anthropic)
            return self._pick(dest, result.body_out, at_headers, body_eos, True, result.scores, pre)
        return self._pick(dest, body or b"", at_headers, body_eos, scores=result.scores, prefiller=pre)

    def _answer_itself(self, a: Answer) -> pb.ProcessingResponse:
        self._release_body()
        self.phase = Phase.DONE
        self.answer = STATUS_OUTCOMES.get(a.status, "answered")
        return immediate(a.status, a.body, a.details, with_bypass(self.stages.cache, a.headers))

    def _pick(
        self,
        dest: str,
        body: bytes,
        at_headers: bool,
        body_eos: bool,
        mutated: bool = False,
        scores: dict[str, float] | None = None,
        prefiller: str | None = None,
    ) -> Sequence[pb.ProcessingResponse]:
        """The pick's answer. ``mutated``: ``body`` replaces the client's (full duplex: the echoed body is this
        one and ``content-length`` its length; BUFFERED: a body mutation with a matching ``content-length``, which
        Envoy requires when the headers are SEND, else it refuses the mutation with a local reply)."""
        if at_headers:
            return (pick_response(dest, None, on_body=False, scores=scores, prefiller=prefiller),)
        if self.mode != FULL_DUPLEX:  # BUFFERED: the pick rides on the body answer
            if not mutated:
                return (pick_response(dest, None, on_body=True, scores=scores, prefiller=prefiller),)
            r = pick_response(dest, len(body), on_body=True, scores=scores, prefiller=prefiller)
            r.request_body.response.body_mutation.body = body
            return (r,)
        # full duplex: the deferred headers answer, then the whole body back as streamed mutations
        first = pick_response(dest, len(body), on_body=False, scores=scores, prefiller=prefiller)
        return [first, *streamed_chunks(body, body_eos, request=True)]

    def _pick_external(
        self, ex: ExternalExchange, body: bytes, at_headers: bool, body_eos: bool
    ) -> Sequence[pb.ProcessingResponse]:
        """The pick of an external backend: its cluster, path and headers; its body (replaced or echoed)."""
        rt = ex.route
        out = rt.body if rt.body is not None else body
        if at_headers:
            return (
                external_pick_response(rt.cluster, rt.path, rt.set_headers, rt.remove_headers, None, on_body=False),
            )
        if self.mode != FULL_DUPLEX:  # BUFFERED: on the body answer, the body replaced when it changed
            length = len(out) if rt.body is not None else None
            r = external_pick_response(rt.cluster, rt.path, rt.set_headers, rt.remove_headers, length, on_body=True)
            if rt.body is not None:
                r.request_body.response.body_mutation.body = out
            return (r,)
        first = external_pick_response(rt.cluster, rt.path, rt.set_headers, rt.remove_headers, len(out), on_body=False)
        return [first, *streamed_chunks(out, body_eos, request=True)]

    # -- response phases --------------------------------------------------------------------------
    def _response_headers(self, msg: pb.HttpHeaders, served: str | None = None) -> Sequence[pb.ProcessingResponse]:
        status: int | None = None
        for h in msg.headers.headers:
            if h.key == ":status":
                try:
                    status = int(header_value(h))
                except ValueError:
                    status = None
                break
        answer = _HEADERS_OK
        ex = self.exchange
        if ex is not None:
            self.phase = Phase.RESPONSE
            cache = ex.cache
            store = cache is not None and cache.key is not None  # an eligible response-cache miss: it is stored
            if cache is not None and store:  # the cache keeps its headers (decoded for these responses only)
                cache.headers = tuple((h.key, header_value(h)) for h in msg.headers.headers)
            ex.response_headers(status, served)
            x_cache = ex.x_cache
            token = ex.session_token
            if token is not None and served is not None and served != ex.decision.endpoint.address:
                token = self.stages.token_for(served)  # a retry: the endpoint that answered holds the session
            conv = ex.route.converter if isinstance(ex, ExternalExchange) else None
            if conv is not None and conv.active:  # the picker converts this body: new type, no length
                answer = response_headers_answer(x_cache, conv.content_type, token)
            elif x_cache is not None or token is not None:
                answer = response_headers_answer(x_cache, session_token=token)
            sampling = self.sampling
            if sampling is not None:
                # a sample only where Envoy can switch the body on (body NONE, no full-duplex body mode); an
                # eligible cache miss is switched like an opted-in sample (its body must reach the cache)
                if msg.end_of_stream:
                    pass
                elif self.resp_mode != RESPONSE_NONE:  # full mode: every body passes through; read its usage too
                    self.sampled = True
                elif self.mode != FULL_DUPLEX and sampling.choose(self.opted_in or store):
                    self.sampled = True
                    self.resp_mode = STREAMED
                    answer = sampled_headers_answer(self.mode, x_cache, token)
                sampling.headers_seen(self.sampled)
            if store and self.resp_mode == RESPONSE_NONE and not msg.end_of_stream:
                self.stages.cache_cannot_store()
        if msg.end_of_stream:
            self._end_response()
        return (answer,)

    def _response_body(self, msg: pb.HttpBody) -> Sequence[pb.ProcessingResponse]:
        ex = self.exchange
        if isinstance(ex, ExternalExchange) and ex.route.converter is not None and ex.route.converter.active:
            return self._converted_body(ex, msg)
        if ex is not None and ex.wants_body:
            ex.response_body(msg.body, msg.end_of_stream)
        if self.sampled:  # keep the last bytes only: the usage is at the end of the body
            self.tail = keep_tail(self.tail, msg.body)
            if msg.end_of_stream and self.sampling is not None:
                self.sampling.usage(self.tail, self.exchange)
        if msg.end_of_stream:
            self._end_response()
        if self.resp_mode == FULL_DUPLEX:
            return streamed_chunks(msg.body, msg.end_of_stream, request=False)
        return (_RESPONSE_BODY_OK,)

    def _converted_body(self, ex: ExternalExchange, msg: pb.HttpBody) -> Sequence[pb.ProcessingResponse]:
        """A gemini backend's native answer, converted to the OpenAI shape before the observers and the client see
        it (full duplex: streamed mutations; STREAMED: each chunk replaced, maybe by nothing until the end)."""
        eos = msg.end_of_stream
        body = ex.convert(msg.body, eos)
        if ex.wants_body:
            ex.response_body(body, eos)
        if eos:
            self._end_response()
        if self.resp_mode == FULL_DUPLEX:
            return streamed_chunks(body, eos, request=False)
        return (streamed_response_body(body),)

    def _end_response(self) -> None:
        if self.exchange is not None:
            self.exchange.end(completed=True)
        self.phase = Phase.DONE

    def close(self) -> None:
        """Stream ended (normally or by abort): the in-flight slot and the body reservation are always
        released."""
        self._release_body()
        if self.exchange is not None:
            # body NONE: Envoy closes the stream when the request ends, so a close after the response headers
            # is the normal end (an abort after the headers cannot be told apart from it)
            self.exchange.end(completed=self.phase is Phase.RESPONSE and self.resp_mode == RESPONSE_NONE)
