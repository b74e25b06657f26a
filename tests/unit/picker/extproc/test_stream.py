"""Wire compatibility: our ext_proc messages (xds-protos/upb) decode with envoy-data-plane's
betterproto classes, and theirs decode with ours, for every phase the picker handles."""

from __future__ import annotations

import json

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy_data_plane.envoy.config.core import v3 as bcore
from envoy_data_plane.envoy.service.ext_proc import v3 as bext

from picker.config import parse_settings
from picker.extproc.stream import MAX_STREAMED_CHUNK, RequestStream
from picker.runtime.app import PickerApp
from picker.runtime.compose import build_app
from tests.support.builders import BACKENDS, app_of, static_pool, stream_of


def app(mode: str = "FULL_DUPLEX_STREAMED") -> PickerApp:
    s = parse_settings(
        {
            "selection_strategy": "PrefixAwareHash",
            "prefix_routing": {"enabled": True},
            "pool": {"backends": BACKENDS},
            "extproc": {"default_body_mode": mode},
        }
    )
    return build_app(s)


def headers_msg(path: str = "/v1/chat/completions", eos: bool = False, extra=()) -> bytes:
    hv = [
        bcore.HeaderValue(key=":path", raw_value=path.encode()),
        bcore.HeaderValue(key=":method", raw_value=b"POST"),
    ]
    hv += [bcore.HeaderValue(key=k, raw_value=v.encode()) for k, v in extra]
    return bytes(
        bext.ProcessingRequest(request_headers=bext.HttpHeaders(headers=bcore.HeaderMap(headers=hv), end_of_stream=eos))
    )


def body_msg(body: bytes, eos: bool) -> bytes:
    return bytes(bext.ProcessingRequest(request_body=bext.HttpBody(body=body, end_of_stream=eos)))


async def feed(stream: RequestStream, raw: bytes) -> list[bext.ProcessingResponse]:
    out = await stream.handle(pb.ProcessingRequest.FromString(raw))
    return [bext.ProcessingResponse.parse(r.SerializeToString()) for r in out]


def header_map(mutation: bext.HeaderMutation) -> dict[str, str]:
    return {o.header.key: (o.header.raw_value or o.header.value.encode()).decode() for o in mutation.set_headers}


CHAT = json.dumps(
    {
        "model": "m",
        "messages": [{"role": "system", "content": "S" * 150_000}, {"role": "user", "content": "u"}],
    }
).encode()


async def test_full_duplex_round_trip() -> None:
    stream = stream_of(app())
    assert await feed(stream, headers_msg(extra=[("x-gateway-destination-endpoint", "6.6.6.6:1")])) == []
    half = len(CHAT) // 2
    assert await feed(stream, body_msg(CHAT[:half], False)) == []  # chunks are not answered
    out = await feed(stream, body_msg(CHAT[half:], True))
    first = out[0]
    hdrs = header_map(first.request_headers.response.header_mutation)
    ranked = hdrs["x-gateway-destination-endpoint"].split(",")  # the pick, then the ranked fallbacks
    assert sorted(ranked) == sorted(b["address"] for b in BACKENDS)
    assert hdrs["content-length"] == str(len(CHAT))
    assert first.request_headers.response.clear_route_cache is True
    md = first.dynamic_metadata.to_dict()
    assert md["envoy.lb"]["x-gateway-destination-endpoint"] == hdrs["x-gateway-destination-endpoint"]
    chunks = [r.request_body.response.body_mutation.streamed_response for r in out[1:]]
    assert all(len(c.body) <= MAX_STREAMED_CHUNK for c in chunks)
    assert b"".join(c.body for c in chunks) == CHAT
    assert [c.end_of_stream for c in chunks] == [False] * (len(chunks) - 1) + [True]
    # response side: headers answered, chunks echoed
    resp_hdrs = bext.ProcessingRequest(
        response_headers=bext.HttpHeaders(
            headers=bcore.HeaderMap(headers=[bcore.HeaderValue(key=":status", raw_value=b"200")])
        )
    )
    assert len(await feed(stream, bytes(resp_hdrs))) == 1
    assert stream.stages.pool.in_flight()[stream.decision.endpoint.name] == 1  # type: ignore[union-attr]
    echoed = await feed(
        stream,
        bytes(bext.ProcessingRequest(response_body=bext.HttpBody(body=b"data: x\n\n", end_of_stream=True))),
    )
    assert echoed[0].response_body.response.body_mutation.streamed_response.body == b"data: x\n\n"
    assert echoed[0].response_body.response.body_mutation.streamed_response.end_of_stream is True
    assert sum(stream.stages.pool.in_flight().values()) == 0


async def test_buffered_round_trip() -> None:
    stream = stream_of(app("BUFFERED"))
    out = await feed(stream, headers_msg())
    assert out[0].request_headers.response.header_mutation.remove_headers == ["x-gateway-destination-endpoint"]
    out = await feed(stream, body_msg(CHAT, True))
    assert len(out) == 1
    hdrs = header_map(out[0].request_body.response.header_mutation)
    ranked = hdrs["x-gateway-destination-endpoint"].split(",")  # the pick, then the ranked fallbacks
    assert sorted(ranked) == sorted(b["address"] for b in BACKENDS)
    assert "content-length" not in hdrs
    assert out[0].request_body.response.clear_route_cache is True


async def test_bodyless_request_routed_at_headers() -> None:
    stream = stream_of(app())
    out = await feed(stream, headers_msg("/v1/models", eos=True))
    assert "x-gateway-destination-endpoint" in header_map(out[0].request_headers.response.header_mutation)


async def test_bad_body_immediate_400_decodes() -> None:
    stream = stream_of(app())
    await feed(stream, headers_msg())
    out = await feed(stream, body_msg(b"{oops", True))
    ir = out[0].immediate_response
    assert ir.status.code == 400
    assert json.loads(ir.body)["error"]["code"] == "invalid_json"
    assert header_map(ir.headers)["content-type"] == "application/json"


async def test_subset_hint_list_is_honoured() -> None:
    from google.protobuf import struct_pb2

    stream = stream_of(app())
    req = pb.ProcessingRequest.FromString(headers_msg())
    hint = struct_pb2.Struct()
    hint.update({"x-gateway-destination-endpoint-subset": ["10.0.0.2:8000"]})
    req.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    # decode the same request with betterproto to prove the metadata layout matches Envoy's schema
    decoded = bext.ProcessingRequest.parse(req.SerializeToString())
    got = decoded.metadata_context.filter_metadata["envoy.lb.subset_hint"].to_dict()
    assert got == {"x-gateway-destination-endpoint-subset": ["10.0.0.2:8000"]}
    await stream.handle(req)
    out = await stream.handle(pb.ProcessingRequest.FromString(body_msg(CHAT, True)))
    dest = {h.header.key: h.header.raw_value for h in out[0].request_headers.response.header_mutation.set_headers}
    assert dest["x-gateway-destination-endpoint"] == b"10.0.0.2:8000"


async def test_abort_releases_lease() -> None:
    stream = stream_of(app())
    await feed(stream, headers_msg())
    await feed(stream, body_msg(CHAT, True))
    assert sum(stream.stages.pool.in_flight().values()) == 1
    stream.close()
    stream.close()
    assert sum(stream.stages.pool.in_flight().values()) == 0


async def test_streamed_mode_routes_at_headers_and_answers_every_chunk() -> None:
    """Found in review: in STREAMED (and NONE) body mode the router sees the headers before a whole body,
    so the pick happens at the headers phase and every body chunk gets its own answer."""
    from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2

    stream = stream_of(app())
    req = pb.ProcessingRequest.FromString(headers_msg())
    req.protocol_config.request_body_mode = processing_mode_pb2.ProcessingMode.STREAMED
    out = await stream.handle(req)
    assert out[0].WhichOneof("response") == "request_headers"
    dest = {h.header.key for h in out[0].request_headers.response.header_mutation.set_headers}
    assert "x-gateway-destination-endpoint" in dest
    for eos in (False, False, True):
        chunk = await stream.handle(pb.ProcessingRequest.FromString(body_msg(b"{}", eos)))
        assert len(chunk) == 1 and chunk[0].WhichOneof("response") == "request_body"


@pytest.mark.parametrize("value", ["²", "9" * 5000, "-1", "1e3"])
async def test_a_hostile_content_length_is_not_a_crash(value: str) -> None:
    app = app_of({"pool": static_pool(1, port=80)})
    msg = pb.ProcessingRequest()
    for k, v in ((":path", "/v1/chat/completions"), (":method", "POST"), ("content-length", value)):
        msg.request_headers.headers.headers.add(key=k, raw_value=v.encode())
    assert list(await stream_of(app).handle(msg)) == []  # full duplex: deferred, nothing reserved
    assert app.path.admission.body_bytes == 0
