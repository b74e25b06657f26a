"""The ext_proc stream handler: one ``RequestStream`` per HTTP request, dispatching on the phase.

Body modes (WIRE.md §1):
- FULL_DUPLEX_STREAMED (GIE): body chunks are buffered unanswered; at end of stream the deferred
  request-headers response carries the destination, ``Content-Length`` and ``clear_route_cache``,
  then the body is echoed as streamed responses of at most 62,000 bytes. Response chunks are echoed.
- BUFFERED: headers are answered at once (client destination header stripped); the single body
  message is answered with the destination header mutation.
Body-less requests are routed at the headers phase. The in-flight lease is released at the end of
the response or, on abort, when the stream closes; never twice, never leaked.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from picker.pool.pool import Lease
from picker.request.facts import BadRequest, RequestFacts, api_for_path, parse_request
from picker.routing.endpoints import Decision

if TYPE_CHECKING:
    from picker.runtime.app import PickerApp

log = logging.getLogger("kv_epp.extproc")

DEST_HEADER = "x-gateway-destination-endpoint"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
LB_NAMESPACE = "envoy.lb"
MAX_STREAMED_CHUNK = 62_000  # Envoy's limit for one streamed body mutation in full-duplex mode
FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
BUFFERED = processing_mode_pb2.ProcessingMode.BUFFERED
STREAMED = processing_mode_pb2.ProcessingMode.STREAMED
BUFFERED_PARTIAL = processing_mode_pb2.ProcessingMode.BUFFERED_PARTIAL
# Body modes where the router would see the headers before a complete body: the picker routes at the
# headers phase on the path alone (no prefix key) and answers each body chunk. envoy-config never
# generates them; a hand-written Envoy config might.
ROUTE_AT_HEADERS_MODES = frozenset({processing_mode_pb2.ProcessingMode.NONE, STREAMED, BUFFERED_PARTIAL})
JSON_HEADERS = (("content-type", "application/json"),)


def _header_value(h: base_pb2.HeaderValue) -> str:
    return h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value


def _header_option(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def immediate(status: int, body: bytes, details: str) -> pb.ProcessingResponse:
    """An ImmediateResponse with a JSON body (400 bad request, 503 no backend, ...)."""
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=pb.HeaderMutation(set_headers=[_header_option(k, v) for k, v in JSON_HEADERS]),
            body=body,
            details=details,
        )
    )


def error_body(message: str, code: str, kind: str = "invalid_request_error") -> bytes:
    import orjson

    return orjson.dumps({"error": {"message": message, "type": kind, "code": code}})


def subset_hint(req: pb.ProcessingRequest) -> list[str] | None:
    """The proxy's subset hint (list of ip:port), or None when absent."""
    if not req.HasField("metadata_context"):
        return None
    fm = req.metadata_context.filter_metadata
    if SUBSET_NAMESPACE not in fm:
        return None
    value = fm[SUBSET_NAMESPACE].fields.get(SUBSET_KEY)
    if value is None:
        return None
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        return [v.string_value for v in value.list_value.values if v.string_value]
    if kind == "string_value":
        return [a.strip() for a in value.string_value.split(",") if a.strip()]
    return []


class RequestStream:
    """State of one ext_proc stream (one HTTP request)."""

    __slots__ = (
        "app", "body", "body_len", "decided_at", "decision", "done", "headers", "lease", "mode",
        "path", "resp_mode", "response_seen", "status", "subset",
    )  # fmt: skip

    def __init__(self, app: PickerApp) -> None:
        self.app = app
        self.headers: dict[str, str] = {}
        self.path = "/"
        self.body: list[bytes] = []
        self.body_len = 0
        self.mode = FULL_DUPLEX if app.settings.extproc.default_body_mode == "FULL_DUPLEX_STREAMED" else BUFFERED
        self.resp_mode = self.mode
        self.subset: list[str] | None = None
        self.decision: Decision | None = None
        self.lease: Lease | None = None
        self.decided_at = 0.0
        self.status: int | None = None
        self.response_seen = False
        self.done = False

    # -- dispatch ---------------------------------------------------------------------------------
    async def handle(self, req: pb.ProcessingRequest) -> Sequence[pb.ProcessingResponse]:
        if req.HasField("protocol_config"):
            self.mode = req.protocol_config.request_body_mode
            self.resp_mode = req.protocol_config.response_body_mode
        hint = subset_hint(req)
        if hint is not None:
            self.subset = hint
        phase = req.WhichOneof("request")
        if phase == "request_headers":
            return await self._request_headers(req.request_headers)
        if phase == "request_body":
            return await self._request_body(req.request_body)
        if phase == "request_trailers":
            return await self._request_trailers()
        if phase == "response_headers":
            return self._response_headers(req.response_headers)
        if phase == "response_body":
            return self._response_body(req.response_body)
        if phase == "response_trailers":
            self._finish()
            return (pb.ProcessingResponse(response_trailers=pb.TrailersResponse()),)
        return ()

    # -- request phases ---------------------------------------------------------------------------
    async def _request_headers(self, msg: pb.HttpHeaders) -> Sequence[pb.ProcessingResponse]:
        wanted = self.app.wanted_headers
        for h in msg.headers.headers:
            key = h.key.lower()
            if key in wanted:  # decode only what routing reads
                self.headers[key] = _header_value(h)
        self.path = self.headers.get(":path", "/")
        if msg.end_of_stream:
            return await self._route(b"", at_headers=True)
        if self.mode in ROUTE_AT_HEADERS_MODES:
            return await self._route(b"", at_headers=True, parse=False)
        if self.mode == FULL_DUPLEX:
            return ()  # deferred until the body is complete
        strip = pb.HeaderMutation(remove_headers=[DEST_HEADER])
        return (
            pb.ProcessingResponse(
                request_headers=pb.HeadersResponse(response=pb.CommonResponse(header_mutation=strip))
            ),
        )

    async def _request_body(self, msg: pb.HttpBody) -> Sequence[pb.ProcessingResponse]:
        if self.done:
            return ()
        if self.decision is not None:  # routed at the headers phase: pass chunks through
            return (
                (pb.ProcessingResponse(request_body=pb.BodyResponse()),) if self.mode in ROUTE_AT_HEADERS_MODES else ()
            )
        if msg.body:
            self.body_len += len(msg.body)
            limit = self.app.settings.extproc.max_body_bytes
            if self.body_len > limit:
                self.done = True
                self.body.clear()
                return (
                    self._bad_request(BadRequest(f"request body exceeds the limit of {limit} bytes", "body_too_large")),
                )
            self.body.append(msg.body)
        if not msg.end_of_stream and self.mode == FULL_DUPLEX:
            return ()
        body = b"".join(self.body)
        self.body.clear()
        return await self._route(body, at_headers=False, body_eos=True)

    async def _request_trailers(self) -> Sequence[pb.ProcessingResponse]:
        if self.decision is None and not self.done:
            body = b"".join(self.body)
            self.body.clear()
            out = list(await self._route(body, at_headers=False, body_eos=False))
        else:
            out = []
        if not self.done:
            out.append(pb.ProcessingResponse(request_trailers=pb.TrailersResponse()))
        return out

    def _bad_request(self, exc: BadRequest) -> pb.ProcessingResponse:
        self.app.metrics.requests.labels("bad_request").inc()
        return immediate(400, exc.json_body(), f"kv_epp_bad_request:{exc.code}")

    async def _route(
        self, body: bytes, *, at_headers: bool, body_eos: bool = True, parse: bool = True
    ) -> Sequence[pb.ProcessingResponse]:
        app = self.app
        t0 = time.perf_counter()
        session = self.headers.get(app.settings.session_affinity.header)
        tenant = self.headers.get(app.settings.extproc.tenant_header)
        if not parse:  # the body is not available before the pick in this mode: route on the path alone
            facts = RequestFacts(api=api_for_path(self.path), session_id=session, tenant_id=tenant)
        else:
            try:
                if at_headers and api_for_path(self.path) != "other" and self.headers.get(":method", "POST") == "POST":
                    raise BadRequest("request body is empty: a JSON body is required", "empty_body")
                max_bytes = app.settings.extproc.max_body_bytes
                facts = parse_request(body, self.path, max_body_bytes=max_bytes, session_id=session, tenant_id=tenant)
            except BadRequest as exc:
                self.done = True
                return (self._bad_request(exc),)
        cpu = time.perf_counter() - t0
        key = app.router.key_for(facts)
        block_keys: Sequence[int] | None = None
        if key is not None and app.router.tier4_active():
            block_keys = await app.block_keys_for(facts)  # bounded wait; None -> no Tier 4
        t1 = time.perf_counter()
        view = app.pool.view(self.subset)
        decision = app.router.decide(facts, view, block_keys, key)
        cpu += time.perf_counter() - t1
        app.metrics.decision_seconds.observe(cpu)
        if decision is None:
            self.done = True
            app.metrics.requests.labels("no_backend").inc()
            why = "no endpoint in the subset hint is eligible" if self.subset is not None else "no healthy backend"
            return (immediate(503, error_body(why, "no_healthy_backend", "service_unavailable"), "kv_epp_no_backend"),)
        self.decision = decision
        self.lease = app.pool.acquire(decision.endpoint)
        self.decided_at = time.monotonic()
        app.on_decision(decision)
        return self._answer(decision, body, at_headers, body_eos)

    def _answer(self, d: Decision, body: bytes, at_headers: bool, body_eos: bool) -> Sequence[pb.ProcessingResponse]:
        dest = d.endpoint.address
        sets = [_header_option(DEST_HEADER, dest)]
        metadata = struct_pb2.Struct()
        metadata.fields[LB_NAMESPACE].struct_value.fields[DEST_HEADER].string_value = dest
        full_duplex = self.mode == FULL_DUPLEX and not at_headers
        if full_duplex:
            sets.append(_header_option("content-length", str(len(body))))
        common = pb.CommonResponse(
            header_mutation=pb.HeaderMutation(set_headers=sets),  # overwrite = client value stripped
            clear_route_cache=True,
        )
        if at_headers:
            return (
                pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common), dynamic_metadata=metadata),
            )
        if not full_duplex:
            return (pb.ProcessingResponse(request_body=pb.BodyResponse(response=common), dynamic_metadata=metadata),)
        out = [pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common), dynamic_metadata=metadata)]
        out.extend(_streamed_chunks(body, body_eos, request=True))
        return out

    # -- response phases --------------------------------------------------------------------------
    def _response_headers(self, msg: pb.HttpHeaders) -> Sequence[pb.ProcessingResponse]:
        self.response_seen = True
        for h in msg.headers.headers:
            if h.key == ":status":
                try:
                    self.status = int(_header_value(h))
                except ValueError:
                    self.status = None
                break
        if self.decision is not None:
            ok = self.status is not None and self.status < 500
            latency_ms = (time.monotonic() - self.decided_at) * 1000.0
            self.app.pool.record_response(self.decision.endpoint.name, ok, latency_ms if ok else None)
            m = self.app.metrics
            m.child(m.backend_responses, self.decision.endpoint.name, f"{(self.status or 0) // 100}xx").inc()
        if msg.end_of_stream:
            self._finish()
        return (pb.ProcessingResponse(response_headers=pb.HeadersResponse()),)

    def _response_body(self, msg: pb.HttpBody) -> Sequence[pb.ProcessingResponse]:
        if msg.end_of_stream:
            self._finish()
        if self.resp_mode == FULL_DUPLEX:
            return _streamed_chunks(msg.body, msg.end_of_stream, request=False)
        return (pb.ProcessingResponse(response_body=pb.BodyResponse()),)

    def _finish(self) -> None:
        if self.lease is not None:
            self.lease.release()
        self.done = True

    def close(self) -> None:
        """Stream ended (normally or by abort): the in-flight slot is always released."""
        if self.lease is not None:
            self.lease.release()


def _streamed_chunks(body: bytes, eos: bool, *, request: bool) -> list[pb.ProcessingResponse]:
    out: list[pb.ProcessingResponse] = []
    n = len(body)
    offsets = range(0, n, MAX_STREAMED_CHUNK) if n else range(1)
    last = offsets[-1]
    for off in offsets:
        chunk = body[off : off + MAX_STREAMED_CHUNK]
        mutation = pb.BodyMutation(
            streamed_response=pb.StreamedBodyResponse(body=chunk, end_of_stream=eos and off == last)
        )
        resp = pb.BodyResponse(response=pb.CommonResponse(body_mutation=mutation))
        out.append(pb.ProcessingResponse(request_body=resp) if request else pb.ProcessingResponse(response_body=resp))
    return out
