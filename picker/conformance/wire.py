"""The gateway's side of one ext_proc stream, written from the GIE protocol (not from kv-epp's own helpers): the
ProcessingRequests a gateway sends in each body mode, and what the picker's answers carry (the pick, an
ImmediateResponse, the echoed body). See docs/conformance.md.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import struct_pb2

DEST_HEADER = "x-gateway-destination-endpoint"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
SERVED_KEY = "x-gateway-destination-endpoint-served"
FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
BUFFERED = processing_mode_pb2.ProcessingMode.BUFFERED
RESPONSE_NONE = processing_mode_pb2.ProcessingMode.NONE
MODES = {"full_duplex": FULL_DUPLEX, "buffered": BUFFERED}  # the --body-mode names


class ProtocolError(Exception):
    """The picker answered something a gateway cannot use: the message says what, in one line."""


def _header_value(h: base_pb2.HeaderValue) -> str:
    return h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value


def request_headers(
    mode: int, response_mode: int, method: str, path: str, extra: Sequence[tuple[str, str]] = (), *, eos: bool = False
) -> pb.ProcessingRequest:
    """The first message of a stream: the request headers and, as Envoy does, the stream's body modes."""
    msg = pb.ProcessingRequest()
    pairs = [(":method", method), (":path", path), (":authority", "conformance.local"), (":scheme", "http")]
    for k, v in (*pairs, *extra):
        msg.request_headers.headers.headers.add(key=k, raw_value=v.encode())
    msg.request_headers.end_of_stream = eos
    msg.protocol_config.request_body_mode = mode
    msg.protocol_config.response_body_mode = response_mode
    return msg


def with_subset(msg: pb.ProcessingRequest, subset: Sequence[str]) -> pb.ProcessingRequest:
    """``msg`` with the gateway's subset hint (a list, as GIE's protocol writes it) in its metadata context."""
    value = struct_pb2.Value()
    value.list_value.SetInParent()
    for endpoint in subset:
        value.list_value.values.add(string_value=endpoint)
    msg.metadata_context.filter_metadata[SUBSET_NAMESPACE].fields[SUBSET_KEY].CopyFrom(value)
    return msg


def request_body(chunk: bytes, eos: bool) -> pb.ProcessingRequest:
    msg = pb.ProcessingRequest()
    msg.request_body.body = chunk
    msg.request_body.end_of_stream = eos
    return msg


def response_headers(status: int, served: str | None, *, eos: bool) -> pb.ProcessingRequest:
    """The upstream's response headers, with the endpoint that served it in ``envoy.lb`` (GIE v1.0.0)."""
    msg = pb.ProcessingRequest()
    msg.response_headers.headers.headers.add(key=":status", raw_value=str(status).encode())
    msg.response_headers.headers.headers.add(key="content-type", raw_value=b"application/json")
    msg.response_headers.end_of_stream = eos
    if served is not None:
        msg.metadata_context.filter_metadata[LB_NAMESPACE].fields[SERVED_KEY].string_value = served
    return msg


def response_body(chunk: bytes, eos: bool) -> pb.ProcessingRequest:
    msg = pb.ProcessingRequest()
    msg.response_body.body = chunk
    msg.response_body.end_of_stream = eos
    return msg


@dataclass(slots=True)
class Immediate:
    """The picker answered the request itself."""

    status: int
    body: bytes
    headers: dict[str, str]

    def json_body(self) -> Any:
        """The body as JSON, or None when it is not JSON."""
        try:
            return json.loads(self.body)
        except ValueError:
            return None


@dataclass(slots=True)
class Picked:
    """The picker's pick, as the gateway would apply it."""

    header: str | None  # x-gateway-destination-endpoint as the header mutation sets it
    metadata: str | None  # the same key in dynamic_metadata["envoy.lb"]
    phase: str  # the answer that carried it: request_headers or request_body
    content_length: str | None  # a content-length the picker set with the pick (full duplex: the body's)
    echoed: bytes | None = None  # full duplex: the body the picker streamed back
    notes: list[str] = field(default_factory=list)

    @property
    def endpoints(self) -> list[str]:
        """The ranked list (pick first) as the header carries it."""
        return [e.strip() for e in (self.header or "").split(",") if e.strip()]


def _immediate(r: pb.ProcessingResponse) -> Immediate:
    ir = r.immediate_response
    headers = {o.header.key.lower(): _header_value(o.header) for o in ir.headers.set_headers}
    return Immediate(int(ir.status.code), bytes(ir.body), headers)


def _common(r: pb.ProcessingResponse, phase: str) -> pb.CommonResponse | None:
    if phase == "request_headers":
        return r.request_headers.response
    if phase == "request_body":
        return r.request_body.response
    return None


def _pick_parts(r: pb.ProcessingResponse, phase: str) -> tuple[str | None, str | None, str | None]:
    """(destination header, destination metadata, content-length) set by one answer."""
    header = length = None
    common = _common(r, phase)
    if common is not None:
        for opt in common.header_mutation.set_headers:
            key = opt.header.key.lower()
            if key == DEST_HEADER:
                header = _header_value(opt.header)
            elif key == "content-length":
                length = _header_value(opt.header)
    metadata = None
    fields = r.dynamic_metadata.fields
    if LB_NAMESPACE in fields:
        value = fields[LB_NAMESPACE].struct_value.fields.get(DEST_HEADER)
        if value is not None:
            metadata = value.string_value if value.WhichOneof("kind") == "string_value" else repr(value)
    return header, metadata, length


class Stream:
    """One ext_proc stream to the picker, as the gateway holds it (a gRPC deadline bounds it as a whole)."""

    def __init__(self, stub: pb_grpc.ExternalProcessorStub, metadata: Sequence[tuple[str, str]], timeout: float):
        self.call = stub.Process(metadata=tuple(metadata), timeout=timeout)

    async def send(self, msg: pb.ProcessingRequest) -> None:
        """Write one message; ProtocolError when the picker ended the stream first. A write that loses the race with
        the picker's status (e.g. an UNAUTHENTICATED refusal at the stream's start) fails in gRPC's core, which
        then reports INTERNAL instead of the picker's status: the message says so."""
        try:
            await self.call.write(msg)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            code, details = await self.call.code(), await self.call.details()
            if code == grpc.StatusCode.INTERNAL:
                raise ProtocolError(
                    "the picker closed the stream before taking the kit's message (gRPC then hides its status:"
                    " refused? a token or client certificate it wants?)"
                ) from None
            raise ProtocolError(f"stream ended while sending: {code.name} {details!r}") from None

    async def recv(self, waiting_for: str) -> pb.ProcessingResponse:
        """The next answer; ProtocolError when the stream ends instead (the gateway would fail the request)."""
        try:
            r = await self.call.read()
        except grpc.aio.AioRpcError as exc:
            raise ProtocolError(
                f"stream failed waiting for {waiting_for}: {exc.code().name} {exc.details()!r}"
            ) from None
        if r is grpc.aio.EOF:
            code = await self.call.code()
            raise ProtocolError(f"stream ended ({code.name}) waiting for {waiting_for}")
        assert isinstance(r, pb.ProcessingResponse)
        return r

    async def finish(self) -> None:
        """Half-close (the HTTP exchange is over) and read to the end: extra answers or an error status fail."""
        await self.call.done_writing()
        extra = 0
        try:
            while (await self.call.read()) is not grpc.aio.EOF:
                extra += 1
        except grpc.aio.AioRpcError as exc:
            raise ProtocolError(f"stream ended with {exc.code().name} {exc.details()!r}") from None
        code = await self.call.code()
        if code != grpc.StatusCode.OK:
            raise ProtocolError(f"stream ended with {code.name}")
        if extra:
            raise ProtocolError(f"{extra} answer(s) after the exchange ended")

    def cancel(self) -> None:
        self.call.cancel()


async def send_request(
    s: Stream,
    mode: int,
    response_mode: int,
    body: bytes | None,
    *,
    method: str = "POST",
    path: str = "/v1/chat/completions",
    chunks: int = 1,
    subset: Sequence[str] | None = None,
    extra_headers: Sequence[tuple[str, str]] = (),
) -> Picked | Immediate:
    """One request as a gateway sends it in ``mode`` (``body`` None: a header-only request), up to the picker's
    routing answer. ProtocolError on an answer a gateway could not apply."""
    headers = [("content-type", "application/json"), *extra_headers]
    if body is not None and mode == BUFFERED:
        headers.append(("content-length", str(len(body))))  # Envoy drops it in full duplex (the body streams)
    first = request_headers(mode, response_mode, method, path, headers, eos=body is None)
    if subset is not None:
        with_subset(first, subset)
    await s.send(first)
    if body is None:
        return _decision(await s.recv("the answer to the request headers"), "request_headers")
    if mode == BUFFERED:
        r = await s.recv("the answer to the request headers")
        early = _routing_answer(r, "request_headers", pick_optional=True)
        if isinstance(early, Immediate):
            return early
        await s.send(request_body(body, True))
        r = await s.recv("the answer to the request body")
        late = _routing_answer(r, "request_body", pick_optional=True)
        if late is not None:
            return late
        if early is not None:
            return early
        raise ProtocolError(f"neither the headers answer nor the body answer carries a pick ({DEST_HEADER})")
    # full duplex: the body in chunks, end_of_stream on the last; nothing is answered before it
    size = -(-len(body) // max(chunks, 1)) or 1
    parts = [body[i : i + size] for i in range(0, len(body), size)] or [b""]
    for i, part in enumerate(parts):
        await s.send(request_body(part, i == len(parts) - 1))
    r = await s.recv("the deferred answer to the request headers")
    phase = r.WhichOneof("response")
    if phase == "request_body":
        raise ProtocolError("a body chunk answered before the request headers (Envoy: 'spurious message')")
    answer = _decision(r, "request_headers")
    if isinstance(answer, Immediate):
        return answer
    answer.echoed = await _streamed_echo(s, "request_body")
    return answer


async def _streamed_echo(s: Stream, phase: str) -> bytes:
    """Full duplex: the picker's streamed body mutations for ``phase`` (request_body or response_body), up to the
    one with end_of_stream; their bytes. ProtocolError on any other answer."""
    echoed = bytearray()
    while True:
        r = await s.recv(f"the {phase}'s streamed mutations (end_of_stream)")
        got = r.WhichOneof("response")
        if got != phase:
            raise ProtocolError(f"expected a {phase} streamed mutation, got {got}")
        mutation = getattr(r, phase).response.body_mutation
        if mutation.WhichOneof("mutation") != "streamed_response":
            raise ProtocolError(f"a {phase} answer that is not a streamed_response body mutation (full duplex)")
        echoed += mutation.streamed_response.body
        if mutation.streamed_response.end_of_stream:
            return bytes(echoed)


def _routing_answer(r: pb.ProcessingResponse, phase: str, *, pick_optional: bool = False) -> Picked | Immediate | None:
    """The answer to ``phase``: an ImmediateResponse, a pick, or None (``pick_optional``: a plain continue)."""
    got = r.WhichOneof("response")
    if got == "immediate_response":
        return _immediate(r)
    if got != phase:
        raise ProtocolError(f"answer to {phase} was {got}")
    header, metadata, length = _pick_parts(r, phase)
    if header is None and metadata is None:
        if pick_optional:
            return None
        raise ProtocolError(f"the {phase} answer carries no {DEST_HEADER} header and no envoy.lb metadata")
    return Picked(header, metadata, phase, length)


def _decision(r: pb.ProcessingResponse, phase: str) -> Picked | Immediate:
    """The answer to ``phase``, which must route the request or answer it."""
    answer = _routing_answer(r, phase)
    if answer is None:  # not reached: _routing_answer raises when the pick is required
        raise ProtocolError(f"no pick on the {phase} answer")
    return answer


async def send_response(
    s: Stream, response_mode: int, served: str | None, body: bytes, *, status: int = 200
) -> list[str]:
    """The upstream's response, as the gateway forwards it: headers (with ``served``), then in full duplex the body;
    the stream is then half-closed. Returns notes; ProtocolError on an answer the gateway cannot apply."""
    notes: list[str] = []
    await s.send(response_headers(status, served, eos=False))
    r = await s.recv("the answer to the response headers")
    got = r.WhichOneof("response")
    if got == "immediate_response":
        raise ProtocolError(f"an ImmediateResponse {r.immediate_response.status.code} to the response headers")
    if got != "response_headers":
        raise ProtocolError(f"answer to response_headers was {got}")
    if response_mode == FULL_DUPLEX:
        await s.send(response_body(body, True))
        echoed = await _streamed_echo(s, "response_body")
        if echoed != body:
            notes.append(f"the response body came back changed ({len(echoed)} of {len(body)} bytes)")
    await s.finish()
    return notes
