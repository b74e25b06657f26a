"""``continuum_picker_route_seconds{outcome}``: one sample per answered request, from the request headers received
to the routing answer sent, with the answer's outcome.

Real gRPC: the picker's ``ExternalProcessor`` on a loopback port (port 0), a gRPC client playing Envoy's part of
one stream per request (headers, body, then the response phases), the histogram read from the picker's registry
once the stream has ended. The response phases must not add samples.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from picker.extproc.messages import BUFFERED, DEST_HEADER
from picker.ops.metrics import ROUTE_BUCKETS, ROUTE_OUTCOMES
from picker.request.exchange import Exchange
from picker.runtime.app import PickerApp
from tests.support.builders import BACKENDS, app_of, processor_of
from tests.support.extproc_grpc import exchange, request_body, request_headers, response_headers, serve  # noqa: F401  (fixture)

BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hello " * 200}]}).encode()


def make_app(backends: list[dict[str, str]] = BACKENDS, **admission: Any) -> PickerApp:
    return app_of({"pool": {"backends": backends}, "admission": admission})


def counts(app: PickerApp) -> dict[str, float]:
    """outcome -> samples of continuum_picker_route_seconds, as the registry exports them."""
    reg = app.metrics.registry
    return {
        o: reg.get_sample_value("continuum_picker_route_seconds_count", {"outcome": o}) or 0.0 for o in ROUTE_OUTCOMES
    }


def only(outcome: str, n: int = 1) -> dict[str, float]:
    return {o: float(n) if o == outcome else 0.0 for o in ROUTE_OUTCOMES}


def destination(r: pb.ProcessingResponse) -> str | None:
    common = r.request_headers.response if r.HasField("request_headers") else r.request_body.response
    for h in common.header_mutation.set_headers:
        if h.header.key == DEST_HEADER:
            return h.header.raw_value.decode()
    return None


async def test_a_routed_request_observes_exactly_one_routed_sample(serve: Any) -> None:  # noqa: F811
    app = make_app()
    stub = await serve(app)
    assert counts(app) == only("routed", 0)  # exported from the start, empty
    # full duplex: headers unanswered, then the pick (deferred headers answer) and the body echoed
    out = await exchange(stub, request_headers(), request_body(BODY), answers_before_response=2)
    assert destination(out[0]) is not None
    assert counts(app) == only("routed")
    reg = app.metrics.registry
    le = {str(b): reg.get_sample_value("continuum_picker_route_seconds_bucket", {"outcome": "routed", "le": str(b)})
          for b in ROUTE_BUCKETS}  # fmt: skip
    assert sorted(le.values()) == list(le.values()) and le[str(ROUTE_BUCKETS[-1])] <= 1  # cumulative
    inf = reg.get_sample_value("continuum_picker_route_seconds_bucket", {"outcome": "routed", "le": "+Inf"})
    assert inf == 1 and (reg.get_sample_value("continuum_picker_route_seconds_sum", {"outcome": "routed"}) or 0) > 0


async def test_buffered_and_bodyless_requests_observe_one_sample_each(serve: Any) -> None:  # noqa: F811
    app = make_app()
    stub = await serve(app)
    # BUFFERED: the headers answer strips the client's destination header (not the routing answer), the body's
    # answer carries the pick
    out = await exchange(stub, request_headers(body_mode=BUFFERED), request_body(BODY), answers_before_response=2)
    assert destination(out[0]) is None and destination(out[1]) is not None
    assert counts(app) == only("routed")
    out = await exchange(stub, request_headers("/v1/models", "GET", eos=True))  # routed at the headers
    assert destination(out[0]) is not None
    assert counts(app) == only("routed", 2)


async def test_the_pickers_own_answers_are_counted_by_outcome(serve: Any) -> None:  # noqa: F811
    app = make_app()
    stub = await serve(app)
    out = await exchange(stub, request_headers(), request_body(b"{not json"))
    assert out[0].immediate_response.status.code == 400
    assert counts(app) == only("bad_request")
    empty = make_app(backends=[])
    stub = await serve(empty)
    out = await exchange(stub, request_headers(), request_body(BODY))
    assert out[0].immediate_response.status.code == 503
    assert counts(empty) == only("no_backend")


async def test_a_refused_stream_counts_as_overloaded(serve: Any) -> None:  # noqa: F811
    app = make_app(max_open_streams=1)
    stub = await serve(app)
    held = stub.Process()  # holds the only stream slot: headers sent, the body never
    await held.write(request_headers())
    try:
        out = await exchange(stub, request_headers(), request_body(BODY))
        assert out[0].immediate_response.status.code == 429
        assert counts(app) == only("overloaded")
    finally:
        held.cancel()


async def test_a_failure_before_the_pick_is_an_error_sample_and_after_it_none(
    serve: Any,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    app = make_app()
    stub = await serve(app)

    def broken_headers(self: Exchange, status: int | None, served: str | None = None) -> None:
        raise RuntimeError("injected fault in a response observer")

    monkeypatch.setattr(Exchange, "response_headers", broken_headers)  # fails after the pick was sent
    call = stub.Process()
    await call.write(request_headers())
    await call.write(request_body(BODY))
    assert destination(await call.read()) is not None
    await call.read()  # the body echoed
    await call.write(response_headers())
    assert (await call.read()).immediate_response.status.code == 500
    await call.done_writing()
    while await call.read() is not grpc.aio.EOF:
        pass
    assert counts(app) == only("routed")  # the routing answer was counted; the error after it adds nothing

    async def broken_route(*_: Any) -> None:
        raise RuntimeError("injected fault in the request path")

    monkeypatch.setattr(app.path, "route", broken_route)
    out = await exchange(stub, request_headers(), request_body(BODY))
    assert out[0].immediate_response.status.code == 500
    assert counts(app) == {**only("routed"), "error": 1.0}


async def test_a_sample_is_taken_when_grpc_closes_the_stream_at_an_immediate_answer() -> None:
    """Found in CI (test_dashboard_metrics, loaded machine): Envoy ends the stream at an ImmediateResponse, and
    gRPC may close the servicer's generator at its yield instead of resuming it; the sample was taken after the
    yield only, so a 400 (or a 429, a 500) could go uncounted. Here the generator is closed at the yield,
    deterministically, as gRPC does."""
    app = make_app()
    servicer = processor_of(app)

    async def envoy() -> AsyncIterator[pb.ProcessingRequest]:
        yield request_headers(body_mode=BUFFERED)
        yield request_body(b"{not json")

    class Context:  # what the servicer asks of gRPC's context before the first message
        def peer(self) -> str:
            return "ipv4:127.0.0.1:50000"

    gen = servicer.Process(envoy(), Context())  # type: ignore[arg-type]
    answer = await anext(gen)
    while not answer.HasField("immediate_response"):  # the headers' own answer comes first in this mode
        answer = await anext(gen)
    assert answer.immediate_response.status.code == 400
    await gen.aclose()  # gRPC's close at the yield: the stream ended before the generator resumed
    sample = app.metrics.registry.get_sample_value("continuum_picker_route_seconds_count", {"outcome": "bad_request"})
    assert sample == 1
