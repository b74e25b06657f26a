"""Admission control without Envoy: the shared body budget (reserved, refused, always given back), the
open-stream bound, the saturation rule, and the 429 they answer (Retry-After, JSON, counted)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from picker.config import parse_settings
from picker.extproc.stream import RequestStream
from picker.facts import Answer
from picker.request.path import Inbound
from picker.runtime.app import PickerApp
from tests.support.builders import BACKENDS, CHAT, app_of, processor_of, stream_of
from tests.support.poll import async_wait_until

BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 3000}]}).encode()


def make_app(admission: dict[str, Any] | None = None, mode: str = "FULL_DUPLEX_STREAMED", **extra: Any) -> PickerApp:
    return app_of(
        {
            "pool": {"backends": BACKENDS},
            "extproc": {"default_body_mode": mode, "max_body_bytes": 8192},
            "admission": {"max_buffered_body_bytes": 8192, **(admission or {})},
            **extra,
        }
    )


def headers(
    length: int | None = None, method: str = "POST", path: str = CHAT, eos: bool = False
) -> pb.ProcessingRequest:
    pairs = [(":path", path), (":method", method)] + ([("content-length", str(length))] if length is not None else [])
    msg = pb.ProcessingRequest()
    for k, v in pairs:
        msg.request_headers.headers.headers.add(key=k, raw_value=v.encode())
    msg.request_headers.end_of_stream = eos
    return msg


def body(chunk: bytes, eos: bool) -> pb.ProcessingRequest:
    msg = pb.ProcessingRequest()
    msg.request_body.body = chunk
    msg.request_body.end_of_stream = eos
    return msg


def status_of(out: list[pb.ProcessingResponse]) -> int | None:
    for r in out:
        if r.HasField("immediate_response"):
            return int(r.immediate_response.status.code)
    return None


def outcome(app: PickerApp, name: str) -> float:
    return app.metrics.registry.get_sample_value("continuum_picker_requests_total", {"outcome": name}) or 0.0


def answer_header(r: pb.ProcessingResponse, name: str) -> str | None:
    for h in r.immediate_response.headers.set_headers:
        if h.header.key == name:
            return (h.header.raw_value or h.header.value.encode()).decode()
    return None


def retry_after(r: pb.ProcessingResponse) -> str | None:
    return answer_header(r, "retry-after")


async def send(stream: RequestStream, msg: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
    return list(await stream.handle(msg))


# -- the body budget ------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["FULL_DUPLEX_STREAMED", "BUFFERED"])
async def test_declared_length_is_reserved_at_headers_and_refused_when_it_does_not_fit(mode: str) -> None:
    app = make_app(mode=mode)
    adm = app.path.admission
    first = stream_of(app)
    assert status_of(await send(first, headers(len(BODY)))) is None
    assert adm.body_bytes == len(BODY)
    second = stream_of(app)
    assert status_of(await send(second, headers(len(BODY)))) is None  # 2 x 3 KB fit in 8 KiB
    third = stream_of(app)
    out = await send(third, headers(len(BODY)))
    assert status_of(out) == 429 and retry_after(out[0]) == "1"
    err = json.loads(out[0].immediate_response.body)["error"]
    assert err["code"] == "overloaded" and err["type"] == "rate_limit_error"
    assert outcome(app, "overloaded") == 1
    assert adm.body_bytes == 2 * len(BODY)  # the refused stream reserved nothing
    # the first stream's body goes to the request path: its reservation is given back
    assert status_of(await send(first, body(BODY, True))) is None
    assert first.exchange is not None
    assert adm.body_bytes == len(BODY)
    second.close()  # aborted before its body: released too
    third.close()
    first.close()
    assert adm.body_bytes == 0


async def test_chunked_body_is_reserved_chunk_by_chunk_and_refused_past_the_budget() -> None:
    app = make_app()
    adm = app.path.admission
    holders = [stream_of(app) for _ in range(2)]
    for s in holders:
        await send(s, headers())  # no content-length: nothing reserved yet
        assert status_of(await send(s, body(b"x" * 3000, False))) is None
    assert adm.body_bytes == 6000
    late = stream_of(app)
    await send(late, headers())
    assert status_of(await send(late, body(b"y" * 1000, False))) is None
    out = await send(late, body(b"y" * 1193, False))  # 6000 + 2193 > 8192
    assert status_of(out) == 429 and late.done
    assert adm.body_bytes == 6000 and late.body == []  # the refused stream let go of its buffer and budget
    late.close()
    for s in holders:
        s.close()
    assert adm.body_bytes == 0


async def test_declared_length_over_the_per_stream_limit_reserves_only_the_limit_then_is_a_400() -> None:
    """No 400 at the headers (Envoy would close the connection under the client's upload, a reset instead
    of the JSON answer): the limit is reserved, and the body phase answers 400 once it passes the limit."""
    app = make_app()
    s = stream_of(app)
    assert await send(s, headers(9000)) == []
    assert app.path.admission.body_bytes == 8192  # never more than the per-stream limit
    out = await send(s, body(b"x" * 9000, False))
    assert status_of(out) == 400
    assert json.loads(out[0].immediate_response.body)["error"]["code"] == "body_too_large"
    assert app.path.admission.body_bytes == 0


async def test_per_stream_limit_refusal_releases_the_reservation() -> None:
    app = make_app()
    s = stream_of(app)
    await send(s, headers())
    await send(s, body(b"x" * 8000, False))
    assert status_of(await send(s, body(b"x" * 500, False))) == 400
    assert app.path.admission.body_bytes == 0
    s.close()
    assert app.path.admission.body_bytes == 0


async def test_bad_request_and_no_backend_release_the_reservation() -> None:
    app = make_app()
    s = stream_of(app)
    await send(s, headers(5))
    assert status_of(await send(s, body(b"{nope", True))) == 400
    assert app.path.admission.body_bytes == 0


# -- open streams ---------------------------------------------------------------------------------
class _Context:
    async def abort(self, code: Any, details: str) -> None:
        raise AssertionError(f"aborted: {code} {details}")

    def peer(self) -> str:  # every stream from one Envoy: the per-peer cap (4,096) is far above these tests
        return "ipv4:127.0.0.1:50000"


async def _messages(*msgs: pb.ProcessingRequest) -> AsyncIterator[pb.ProcessingRequest]:
    for m in msgs:
        yield m


async def _held(release: asyncio.Event) -> AsyncIterator[pb.ProcessingRequest]:
    yield headers()  # then stalls mid-request, as a client that stops uploading
    await release.wait()


async def test_streams_past_the_bound_get_429_and_closing_one_admits_the_next() -> None:
    app = make_app({"max_open_streams": 2})
    svc = processor_of(app)
    adm = app.path.admission
    release = asyncio.Event()

    async def drain(it: AsyncIterator[pb.ProcessingResponse]) -> list[pb.ProcessingResponse]:
        return [r async for r in it]

    held = [asyncio.create_task(drain(svc.Process(_held(release), _Context()))) for _ in range(2)]
    await async_wait_until(lambda: adm.open_streams == 2, what="two streams open")
    refused = await drain(svc.Process(_messages(headers(len(BODY)), body(BODY, True)), _Context()))
    assert len(refused) == 1 and refused[0].immediate_response.status.code == 429
    assert retry_after(refused[0]) == "1"
    assert outcome(app, "overloaded") == 1
    assert adm.open_streams == 2  # the refused stream was never counted
    held[0].cancel()  # one aborted, one ended by its client
    release.set()
    await asyncio.gather(*held, return_exceptions=True)
    assert adm.open_streams == 0 and adm.body_bytes == 0
    ok = await drain(svc.Process(_messages(headers(len(BODY)), body(BODY, True)), _Context()))
    assert ok and not ok[0].HasField("immediate_response")


@pytest.mark.parametrize("cache", [True, False])
async def test_the_open_streams_429_says_x_cache_bypass_when_the_response_cache_is_on(cache: bool) -> None:
    app = make_app({"max_open_streams": 1}, response_cache={"enabled": cache})
    svc = processor_of(app)
    release = asyncio.Event()

    async def drain(it: AsyncIterator[pb.ProcessingResponse]) -> list[pb.ProcessingResponse]:
        return [r async for r in it]

    held = asyncio.create_task(drain(svc.Process(_held(release), _Context())))
    await async_wait_until(lambda: app.path.admission.open_streams == 1, what="one stream open")
    refused = await drain(svc.Process(_messages(headers(len(BODY)), body(BODY, True)), _Context()))
    release.set()
    await held
    assert refused[0].immediate_response.status.code == 429
    assert answer_header(refused[0], "x-cache") == ("BYPASS" if cache else None)


# -- saturation -----------------------------------------------------------------------------------
async def test_every_endpoint_at_its_in_flight_bound_is_saturated() -> None:
    app = make_app({"max_in_flight_per_endpoint": 1})
    req = Inbound(CHAT, {":method": "POST"}, BODY)
    a = await app.path.route(req)
    b = await app.path.route(req)
    assert not isinstance(a, Answer) and not isinstance(b, Answer)
    c = await app.path.route(req)
    assert isinstance(c, Answer) and c.status == 429 and ("retry-after", "1") in c.headers
    assert "every eligible endpoint" in json.loads(c.body)["error"]["message"]
    assert app.pool.in_flight() == {"a": 1, "b": 1}  # the refused request took no slot
    # the subset hint narrows what "eligible" means
    a.end(completed=True)
    assert isinstance(await app.path.route(Inbound(CHAT, {":method": "POST"}, BODY, ["10.0.0.2:8000"])), Answer)
    d = await app.path.route(req)
    assert not isinstance(d, Answer) and d.decision.endpoint.name == "a"
    for ex in (b, d):
        ex.end(completed=True)
    assert outcome(app, "overloaded") == 2


async def test_total_in_flight_bound() -> None:
    app = make_app({"max_in_flight_per_endpoint": 0, "max_in_flight_total": 3, "retry_after_seconds": 7})
    req = Inbound(CHAT, {":method": "POST"}, BODY)
    exs = [await app.path.route(req) for _ in range(3)]
    over = await app.path.route(req)
    assert isinstance(over, Answer) and over.status == 429 and ("retry-after", "7") in over.headers
    for ex in exs:
        assert not isinstance(ex, Answer)
        ex.end(completed=False)
    assert not isinstance(await app.path.route(req), Answer)


async def test_bounds_are_hot_reloaded() -> None:
    app = make_app({"max_open_streams": 5})
    new = parse_settings(
        {
            "pool": {"backends": BACKENDS},
            "extproc": {"default_body_mode": "FULL_DUPLEX_STREAMED", "max_body_bytes": 8192},
            "admission": {"max_buffered_body_bytes": 9000, "max_open_streams": 9},
        }
    )
    assert app.apply(new) == []
    assert app.path.admission.cfg.max_open_streams == 9


# -- methods without an inference body ------------------------------------------------------------
@pytest.mark.parametrize("method", ["OPTIONS", "GET", "HEAD", "DELETE"])
async def test_other_methods_on_the_chat_path_are_routed_without_a_body_parse(method: str) -> None:
    app = make_app()
    ex = await app.path.route(Inbound(CHAT, {":method": method}, b""))
    assert not isinstance(ex, Answer)
    ex.end(completed=True)
    s = stream_of(app)
    out = await send(s, headers(method=method, eos=True))
    assert status_of(out) is None and s.exchange is not None
    s.close()
