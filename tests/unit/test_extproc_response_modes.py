"""Response modes: the generated processing modes, the picker's mode override matching what Envoy is told
to accept, sampling at the response headers, usage read from the tail, and the in-flight slot's end."""

from __future__ import annotations

import json
from typing import Any

import pytest
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf.json_format import MessageToDict

from picker.config import parse_settings
from picker.extproc.messages import sampled_mode
from picker.extproc.sampling import TAIL_BYTES, ResponseSampling, read_usage
from picker.extproc.stream import RequestStream
from picker.runtime.app import PickerApp
from picker.runtime.envoy_config import EnvoyOptions, bootstrap, processing_mode, sampled_override

PM = processing_mode_pb2.ProcessingMode
BACKENDS = [{"name": "a", "address": "10.0.0.1:8000"}]


def make_app(rate: float = 0.0) -> PickerApp:
    return PickerApp(parse_settings({"pool": {"backends": BACKENDS}, "extproc": {"response_sample_rate": rate}}))


def ext_proc_config(**kw: Any) -> dict[str, Any]:
    b = bootstrap(EnvoyOptions(backends=("10.0.0.1:8000",), **kw))
    hcm = b["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    (f,) = [f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc"]
    return dict(f["typed_config"])


@pytest.mark.parametrize("body_mode", ["FULL_DUPLEX_STREAMED", "BUFFERED"])
def test_default_mode_sends_no_response_body_and_keeps_the_stream_to_the_end(body_mode: str) -> None:
    mode = ext_proc_config(body_mode=body_mode)["processing_mode"]
    assert mode["response_header_mode"] == "SEND"  # status and first byte
    assert mode["response_body_mode"] == "NONE"  # no per-chunk message
    assert mode["response_trailer_mode"] == "SEND"  # Envoy closes the stream at the request's end, not earlier
    assert mode["request_trailer_mode"] == ("SEND" if body_mode == "FULL_DUPLEX_STREAMED" else "SKIP")


def test_full_mode_streams_every_chunk() -> None:
    assert processing_mode("FULL_DUPLEX_STREAMED", "full")["response_body_mode"] == "FULL_DUPLEX_STREAMED"
    assert processing_mode("BUFFERED", "full")["response_body_mode"] == "STREAMED"
    assert "allow_mode_override" not in ext_proc_config(response_mode="full")


def test_sampled_needs_buffered_bodies() -> None:
    with pytest.raises(ValueError, match="BUFFERED"):
        ext_proc_config(body_mode="FULL_DUPLEX_STREAMED", response_mode="sampled")


def test_picker_override_is_the_one_envoy_accepts() -> None:
    cfg = ext_proc_config(body_mode="BUFFERED", response_mode="sampled")
    assert cfg["allow_mode_override"] is True
    assert cfg["processing_mode"]["response_body_mode"] == "NONE"
    (allowed,) = cfg["allowed_override_modes"]
    assert allowed == sampled_override("BUFFERED")
    sent = MessageToDict(sampled_mode(PM.BUFFERED), preserving_proto_field_name=True)
    assert sent == allowed


def sse(usage: dict[str, Any] | None, filler: int = 0) -> bytes:
    chunks = [b'data: {"choices":[{"delta":{"content":"' + b"x" * filler + b'"}}]}\n\n']
    if usage is not None:
        chunks.append(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
    chunks.append(b"data: [DONE]\n\n")
    return b"".join(chunks)


def test_read_usage_from_tail() -> None:
    usage = {"prompt_tokens": 120, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 96}}
    assert read_usage(sse(usage)) == (120, 96)
    assert read_usage(json.dumps({"id": "x", "usage": usage}).encode()) == (120, 96)
    assert read_usage(sse({"prompt_tokens": 7, "completion_tokens": 1})) == (7, None)  # unknown, not zero
    assert read_usage(sse(None)) is None


def headers(status: int = 200, eos: bool = False) -> pb.ProcessingRequest:
    r = pb.ProcessingRequest()
    h = r.response_headers.headers.headers.add()
    h.key, h.raw_value = ":status", str(status).encode()
    r.response_headers.end_of_stream = eos
    return r


def protocol(r: pb.ProcessingRequest, body: int, response: int) -> pb.ProcessingRequest:
    r.protocol_config.request_body_mode = body  # type: ignore[assignment]
    r.protocol_config.response_body_mode = response  # type: ignore[assignment]
    return r


async def routed(app: PickerApp, body_mode: int, response_mode: int, opt_in: bool = False) -> RequestStream:
    """A stream routed in ``body_mode`` (BUFFERED: headers then one body message)."""
    stream = RequestStream(app, ResponseSampling.of(app))
    req = pb.ProcessingRequest()
    for k, v in ((":path", "/v1/chat/completions"), (":method", "POST")) + (
        (("x-kv-epp-sample", "1"),) if opt_in else ()
    ):
        h = req.request_headers.headers.headers.add()
        h.key, h.raw_value = k, v.encode()
    await stream.handle(protocol(req, body_mode, response_mode))
    body = pb.ProcessingRequest()
    body.request_body.body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
    body.request_body.end_of_stream = True
    await stream.handle(body)
    assert stream.exchange is not None
    return stream


def in_flight(app: PickerApp) -> int:
    return sum(app.pool.in_flight().values())


async def test_none_mode_holds_the_slot_until_the_stream_closes() -> None:
    app = make_app()
    stream = await routed(app, PM.FULL_DUPLEX_STREAMED, PM.NONE)
    (answer,) = await stream.handle(headers(200))
    assert answer.HasField("response_headers") and not answer.HasField("mode_override")
    assert stream.exchange is not None and stream.exchange.status == 200
    assert in_flight(app) == 1  # the first byte is not the end
    stream.close()  # Envoy closes the stream when the HTTP stream ends
    assert in_flight(app) == 0
    stream.close()
    assert in_flight(app) == 0  # never twice


async def test_opt_in_samples_in_buffered_mode_only() -> None:
    app = make_app(rate=0.0)
    fd = await routed(app, PM.FULL_DUPLEX_STREAMED, PM.NONE, opt_in=True)
    (answer,) = await fd.handle(headers(200))
    assert not answer.HasField("mode_override")  # Envoy would ignore it in full duplex
    plain = await routed(app, PM.BUFFERED, PM.NONE)
    (answer,) = await plain.handle(headers(200))
    assert not answer.HasField("mode_override")  # rate 0, no opt-in
    sampled = await routed(app, PM.BUFFERED, PM.NONE, opt_in=True)
    (answer,) = await sampled.handle(headers(200))
    assert answer.mode_override == sampled_mode(PM.BUFFERED)
    usage = {"prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": 32}}
    data = sse(usage, filler=3 * TAIL_BYTES)  # the usage is in the last bytes, after a long body
    chunks = [data[i : i + 1000] for i in range(0, len(data), 1000)]
    for i, chunk in enumerate(chunks):
        msg = pb.ProcessingRequest()
        msg.response_body.body = chunk
        msg.response_body.end_of_stream = i == len(chunks) - 1
        (answer,) = await sampled.handle(msg)
        assert answer.HasField("response_body") and not answer.response_body.response.HasField("body_mutation")
    assert len(sampled.tail) <= TAIL_BYTES
    s = ResponseSampling.of(app)
    assert s.c_usage_prompt._value.get() == 40 and s.c_usage_cached._value.get() == 32
    assert s.c_sampled._value.get() == 1 and s.c_headers._value.get() == 2
    assert in_flight(app) == 2  # the sampled one ended with its body; fd and plain wait for their close
    fd.close()
    plain.close()
    sampled.close()
    assert in_flight(app) == 0


async def test_rate_samples_a_fraction() -> None:
    app = make_app(rate=0.5)
    ResponseSampling.of(app)._credit = 0.0  # every second response, evenly: the first is not, the second is
    first = await routed(app, PM.BUFFERED, PM.NONE)
    second = await routed(app, PM.BUFFERED, PM.NONE)
    assert not (await first.handle(headers(200)))[0].HasField("mode_override")
    assert (await second.handle(headers(200)))[0].HasField("mode_override")


def test_the_sample_carries_tier4s_prediction_for_a_calibrated_share() -> None:
    """Every response adds Tier 4's prompt tokens and predicted cached tokens to scope "all"; a sampled one
    with usage also to scope "sampled", next to what the engine delivered."""
    from types import SimpleNamespace

    app = PickerApp(parse_settings({}))
    s = ResponseSampling.of(app)
    predicted: Any = SimpleNamespace(prompt_tokens=100, predicted_cached=64)
    unknown: Any = SimpleNamespace(prompt_tokens=None, predicted_cached=0)  # Tier 4 did not tokenize it
    s.headers_seen(False, predicted)
    s.headers_seen(False, unknown)
    s.headers_seen(True, predicted)
    s.usage(b'{"usage": {"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": 80}}}', predicted)

    def value(scope: str, kind: str) -> float | None:
        return app.metrics.registry.get_sample_value("kv_epp_predicted_tokens_total", {"scope": scope, "kind": kind})

    assert (value("all", "prompt"), value("all", "cached")) == (200, 128)
    assert (value("sampled", "prompt"), value("sampled", "cached")) == (100, 64)
    assert app.metrics.registry.get_sample_value("kv_epp_sampled_usage_tokens_total", {"kind": "cached"}) == 80
