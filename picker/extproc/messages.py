"""Envoy ext_proc message helpers: header options, immediate answers, streamed body chunks, the subset
hint, the pick (header + ``envoy.lb`` metadata). Shared by the picker's stream and the no-op floor."""

from __future__ import annotations

from collections.abc import Iterable

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2

from picker.config import SESSION_TOKEN_HEADER
from picker.gemini.names import UPSTREAM_HEADER
from picker.routing.disagg import PREFILLER_HEADER

DEST_HEADER = "x-gateway-destination-endpoint"
SERVED_KEY = "x-gateway-destination-endpoint-served"  # envoy.lb: the endpoint Envoy actually used
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
SCORES_KEY = "x-gateway-destination-endpoint-scores"  # envoy.lb: each candidate's score (llm-d, behind a flag)
LB_NAMESPACE = "envoy.lb"
_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
MAX_STREAMED_CHUNK = 62_000  # Envoy's limit for one streamed body mutation in full-duplex mode
FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
BUFFERED = processing_mode_pb2.ProcessingMode.BUFFERED
STREAMED = processing_mode_pb2.ProcessingMode.STREAMED
BUFFERED_PARTIAL = processing_mode_pb2.ProcessingMode.BUFFERED_PARTIAL
RESPONSE_NONE = processing_mode_pb2.ProcessingMode.NONE
_SEND = processing_mode_pb2.ProcessingMode.SEND
_SKIP = processing_mode_pb2.ProcessingMode.SKIP


def header_value(h: base_pb2.HeaderValue) -> str:
    return h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value


def set_header(mutation: pb.HeaderMutation, key: str, value: str) -> None:
    """Add an overwriting header to ``mutation``, built in place (nested constructors copy each level)."""
    opt = mutation.set_headers.add()
    opt.header.key = key
    opt.header.raw_value = value.encode()
    opt.append_action = _OVERWRITE


def immediate(
    status: int, body: bytes, details: str, headers: Iterable[tuple[str, str]] = (("content-type", "application/json"),)
) -> pb.ProcessingResponse:
    """An ImmediateResponse: the picker answers the client itself (400, 503, a cached response)."""
    r = pb.ProcessingResponse()
    answer = r.immediate_response
    answer.status.code = status
    for k, v in headers:
        set_header(answer.headers, k, v)
    answer.body = body
    answer.details = details
    return r


def _metadata_value(req: pb.ProcessingRequest, namespace: str, key: str) -> struct_pb2.Value | None:
    """``metadata_context.filter_metadata[namespace][key]`` of a message, or None when absent."""
    if not req.HasField("metadata_context"):
        return None
    fm = req.metadata_context.filter_metadata
    if namespace not in fm:
        return None
    return fm[namespace].fields.get(key)


def subset_hint(req: pb.ProcessingRequest) -> list[str] | None:
    """The proxy's subset hint (list of ip:port), or None when absent."""
    value = _metadata_value(req, SUBSET_NAMESPACE, SUBSET_KEY)
    if value is None:
        return None
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        return [v.string_value for v in value.list_value.values if v.string_value]
    if kind == "string_value":
        return [a.strip() for a in value.string_value.split(",") if a.strip()]
    return []


def served_endpoint(req: pb.ProcessingRequest) -> str | None:
    """The endpoint the proxy actually sent the request to (``envoy.lb`` / ``-served``, written by Envoy's
    override_host policy on every attempt, so after a retry it names the last one), or None."""
    value = _metadata_value(req, LB_NAMESPACE, SERVED_KEY)
    if value is None or value.WhichOneof("kind") != "string_value":
        return None
    return value.string_value.strip() or None


def pick_response(
    dest: str,
    content_length: int | None,
    *,
    on_body: bool,
    scores: dict[str, float] | None = None,
    prefiller: str | None = None,
) -> pb.ProcessingResponse:
    """The pick: the destination header (overwriting any client value), ``clear_route_cache``, the
    ``envoy.lb`` metadata (``dest`` is the ranked list ``ip:port[,ip:port...]``, the pick first; Envoy's
    override_host policy routes on the metadata and retries on the next entry), and ``content-length``
    when the body is re-sent (full duplex). Answers the request-headers phase, or the request-body phase
    (``on_body``, BUFFERED mode). ``scores`` (llm-d's ``--emit-endpoint-scores``): ``ip:port`` → score, a struct
    under ``x-gateway-destination-endpoint-scores`` in the same metadata. ``prefiller``: P/D's prefill endpoint,
    set as ``x-prefiller-host-port`` (overwriting every client value); without one any client value is removed, so
    none reaches a decode pod's sidecar (docs/pd.md)."""
    r = pb.ProcessingResponse()
    common = r.request_body.response if on_body else r.request_headers.response
    set_header(common.header_mutation, DEST_HEADER, dest)
    if prefiller is not None:
        set_header(common.header_mutation, PREFILLER_HEADER, prefiller)
    else:
        common.header_mutation.remove_headers.append(PREFILLER_HEADER)
    if content_length is not None:
        set_header(common.header_mutation, "content-length", str(content_length))
    common.clear_route_cache = True
    lb = r.dynamic_metadata.fields[LB_NAMESPACE].struct_value
    lb.fields[DEST_HEADER].string_value = dest
    if scores is not None:
        fields = lb.fields[SCORES_KEY].struct_value.fields
        for addr, score in scores.items():
            fields[addr].number_value = score
    return r


def streamed_chunks(body: bytes, eos: bool, *, request: bool) -> list[pb.ProcessingResponse]:
    """``body`` as full-duplex streamed body mutations of at most MAX_STREAMED_CHUNK bytes (built in
    place: about four times cheaper than nested constructors, and this runs for every response chunk)."""
    n = len(body)
    if n <= MAX_STREAMED_CHUNK:
        return [_streamed(body, eos, request)]
    last = (n - 1) // MAX_STREAMED_CHUNK * MAX_STREAMED_CHUNK
    return [
        _streamed(body[off : off + MAX_STREAMED_CHUNK], eos and off == last, request)
        for off in range(0, n, MAX_STREAMED_CHUNK)
    ]


def _streamed(chunk: bytes, eos: bool, request: bool) -> pb.ProcessingResponse:
    r = pb.ProcessingResponse()
    phase = r.request_body if request else r.response_body
    sr = phase.response.body_mutation.streamed_response
    sr.body = chunk
    if eos:
        sr.end_of_stream = True
    return r


def sampled_mode(request_body_mode: int) -> processing_mode_pb2.ProcessingMode:
    """The processing mode a sampled response is switched to: the configured one (``--response-mode
    sampled``) with a STREAMED response body. It must equal the Envoy config's ``allowed_override_modes``
    entry (``picker.runtime.envoy_config.sampled_override``) or Envoy ignores it."""
    m = processing_mode_pb2.ProcessingMode()
    m.request_header_mode = _SEND
    m.response_header_mode = _SEND
    m.request_body_mode = request_body_mode
    m.response_body_mode = STREAMED
    m.request_trailer_mode = _SEND if request_body_mode == FULL_DUPLEX else _SKIP
    m.response_trailer_mode = _SEND
    return m


def sampled_headers_answer(
    request_body_mode: int, x_cache: str | None = None, session_token: str | None = None
) -> pb.ProcessingResponse:
    """The answer to a sampled request's response headers: continue, and stream this response's body
    (with the ``x-cache`` and ``x-session-token`` headers when given)."""
    r = response_headers_answer(x_cache, session_token=session_token)
    r.mode_override.CopyFrom(sampled_mode(request_body_mode))
    return r


def response_headers_answer(
    x_cache: str | None, content_type: str | None = None, session_token: str | None = None
) -> pb.ProcessingResponse:
    """The answer to the response headers: continue, adding ``x-cache: <x_cache>`` (overwriting an upstream's)
    when the response cache is on, and ``x-session-token`` when given. ``content_type``: the picker converts the
    body (a gemini backend's native answer), so its ``content-length`` goes and its type is this."""
    r = pb.ProcessingResponse()
    r.response_headers.SetInParent()
    mutation = r.response_headers.response.header_mutation
    if x_cache is not None:
        set_header(mutation, "x-cache", x_cache)
    if session_token is not None:
        set_header(mutation, SESSION_TOKEN_HEADER, session_token)
    if content_type is not None:
        set_header(mutation, "content-type", content_type)
        mutation.remove_headers.append("content-length")
    return r


def external_pick_response(
    cluster: str,
    path: str,
    headers: Iterable[tuple[str, str]],
    remove: Iterable[str],
    content_length: int | None,
    *,
    on_body: bool,
) -> pb.ProcessingResponse:
    """The pick of an external backend (``type: gemini``): ``upstream_header`` names its cluster (Envoy's route
    for it matches once ``clear_route_cache`` makes Envoy choose again), ``:path`` is the API's, ``headers`` are
    set (its API key) and ``remove`` removed (the client's credentials); ``content-length`` when the body is
    re-sent or replaced."""
    r = pb.ProcessingResponse()
    common = r.request_body.response if on_body else r.request_headers.response
    m = common.header_mutation
    set_header(m, UPSTREAM_HEADER, cluster)
    set_header(m, ":path", path)
    for k, v in headers:
        set_header(m, k, v)
    m.remove_headers.extend(remove)
    if content_length is not None:
        set_header(m, "content-length", str(content_length))
    common.clear_route_cache = True
    return r


def streamed_response_body(chunk: bytes) -> pb.ProcessingResponse:
    """A STREAMED response-body answer that replaces the chunk with ``chunk`` (a converted answer; maybe empty)."""
    r = pb.ProcessingResponse()
    r.response_body.response.body_mutation.body = chunk
    return r
