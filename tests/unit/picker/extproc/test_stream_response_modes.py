"""Response modes: the generated processing modes, the picker's mode override matching what Envoy is told
to accept, sampling at the response headers, usage read from the tail, and the in-flight slot's end."""

from __future__ import annotations

import json
from typing import Any

import pytest
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf.json_format import MessageToDict

from picker.extproc.messages import sampled_mode
from picker.extproc.sampling import read_usage
from picker.extproc.stream import RequestStream
from picker.facts import RequestFacts
from picker.kv.stage import KvLookup
from picker.ops.recorder import prediction_outcome
from picker.ops.usage import TAIL_BYTES
from picker.routing.endpoints import BackendHold, StorageTier
from picker.runtime.app import PickerApp
from picker.runtime.envoy_config import EnvoyOptions, bootstrap, processing_mode, sampled_override
from tests.support.builders import app_of

PM = processing_mode_pb2.ProcessingMode
BACKENDS = [{"name": "a", "address": "10.0.0.1:8000"}]


def make_app(rate: float = 0.0) -> PickerApp:
    return app_of({"pool": {"backends": BACKENDS}, "extproc": {"response_sample_rate": rate}})


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
    stream = RequestStream(app.path, app.metrics.route_seconds, app.sampling)
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
    s = app.sampling
    assert s.c_usage_prompt._value.get() == 40 and s.c_usage_cached._value.get() == 32
    assert s.c_sampled._value.get() == 1 and s.c_headers._value.get() == 2
    assert in_flight(app) == 2  # the sampled one ended with its body; fd and plain wait for their close
    fd.close()
    plain.close()
    sampled.close()
    assert in_flight(app) == 0


async def test_rate_samples_a_fraction() -> None:
    app = make_app(rate=0.5)
    app.sampling._credit = 0.0  # every second response, evenly: the first is not, the second is
    first = await routed(app, PM.BUFFERED, PM.NONE)
    second = await routed(app, PM.BUFFERED, PM.NONE)
    assert not (await first.handle(headers(200)))[0].HasField("mode_override")
    assert (await second.handle(headers(200)))[0].HasField("mode_override")


class FixedHolds:
    """Tier 4's answer as the KV index hands it: backend → hold, with the prompt's token count."""

    def __init__(self, blocks: int, prompt_tokens: int) -> None:
        self.blocks, self.prompt_tokens = blocks, prompt_tokens

    async def lookup(self, facts: RequestFacts) -> KvLookup:
        return KvLookup({"a": BackendHold(self.blocks, StorageTier.GPU_HOT)}, self.prompt_tokens)

    def page_tokens(self, backend: str) -> int | None:
        return None


async def read_response(stream: RequestStream, usage: dict[str, Any]) -> None:
    await stream.handle(headers(200))
    assert stream.sampled
    msg = pb.ProcessingRequest()
    msg.response_body.body = sse(usage)
    msg.response_body.end_of_stream = True
    await stream.handle(msg)


def test_prediction_outcome_rule() -> None:
    """Predicted hit: at least one deliverable block (whole blocks, never the prompt's last token); stale when
    the engine delivered under half of what was deliverable."""
    assert prediction_outcome(prompt=100, captured=64, delivered=64, block_size=16) == "hit"
    assert prediction_outcome(prompt=100, captured=64, delivered=32, block_size=16) == "hit"  # half: still a hit
    assert prediction_outcome(prompt=100, captured=64, delivered=16, block_size=16) == "stale"
    assert prediction_outcome(prompt=100, captured=64, delivered=0, block_size=16) == "stale"
    # a block-aligned prompt held in full: the engine recomputes its last block, so 16 of 32 is a full hit
    assert prediction_outcome(prompt=32, captured=32, delivered=16, block_size=16) == "hit"
    assert prediction_outcome(prompt=32, captured=32, delivered=0, block_size=16) == "stale"
    # one block of a one-block prompt is never deliverable: no hit predicted
    assert prediction_outcome(prompt=16, captured=16, delivered=0, block_size=16) == "miss"
    assert prediction_outcome(prompt=100, captured=0, delivered=48, block_size=16) == "unpredicted"
    assert prediction_outcome(prompt=100, captured=0, delivered=0, block_size=16) == "miss"


async def test_delivered_tokens_and_the_stale_index_counter_through_the_stream() -> None:
    """Tier 4 predicted 64 of 100 prompt tokens on the pick: a sampled response whose usage says 0 cached books
    the stale-index counter; one that delivers them is a hit; a response read in full mode counts as observed
    too; an unsampled one only in scope "all"."""
    app = app_of(
        {"pool": {"backends": BACKENDS}, "prefix_routing": {"enabled": True}, "kv_cache_index": {"enabled": True}}
    )
    app.path.holds = FixedHolds(blocks=4, prompt_tokens=100)
    app.path.configure(app.settings)
    stale = await routed(app, PM.BUFFERED, PM.NONE, opt_in=True)
    assert stale.exchange is not None and stale.exchange.decision.reason == "kv_cost"
    await read_response(stale, {"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": 0}})
    hit = await routed(app, PM.BUFFERED, PM.NONE, opt_in=True)
    await read_response(hit, {"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": 64}})
    full = await routed(app, PM.BUFFERED, PM.STREAMED)  # full mode: every body passes through, no override
    await read_response(full, {"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": 48}})
    unsampled = await routed(app, PM.BUFFERED, PM.NONE)
    (answer,) = await unsampled.handle(headers(200))
    assert not unsampled.sampled and not answer.HasField("mode_override")
    no_cached = await routed(app, PM.BUFFERED, PM.NONE, opt_in=True)  # usage without cached_tokens: unknown
    await read_response(no_cached, {"prompt_tokens": 100})

    def get(name: str, **labels: str) -> float | None:
        return app.metrics.registry.get_sample_value(name, labels)

    def tokens(scope: str, kind: str) -> float | None:
        return get("continuum_picker_cached_tokens_total", reason="kv_cost", scope=scope, kind=kind)

    assert [tokens("all", k) for k in ("prompt", "available", "captured")] == [500, 320, 320]
    assert [tokens("observed", k) for k in ("prompt", "available", "captured", "delivered")] == [300, 192, 192, 112]
    outcomes = {o: get("continuum_picker_observed_predictions_total", reason="kv_cost", outcome=o) for o in
                ("hit", "stale", "unpredicted", "miss")}  # fmt: skip
    assert outcomes == {"hit": 2, "stale": 1, "unpredicted": 0, "miss": 0}
    assert get("kv_epp_sampled_usage_tokens_total", kind="cached") == 112
    assert get("kv_epp_responses_observed_total", observed="sampled") == 4
