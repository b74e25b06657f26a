"""``kv-epp pd-sidecar`` over real HTTP: the sidecar (``picker.pdsidecar.run.started``, as ``serve`` runs it) in
front of two real aiohttp servers standing in for the decode and the prefill engine (tests.support.pd_engines),
which record what they receive. What the engines see is asserted exactly (docs/pd.md, "The routing sidecar";
docs/wire.md §8); every wait is a poll with a deadline, never a sleep."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import socket
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from picker.pdsidecar.allowlist import Verdict
from picker.pdsidecar.connectors import NIXL_PREFILL_PARAMS
from picker.pdsidecar.options import SidecarOptions
from picker.pdsidecar.run import Running, started
from picker.shared.discovery.config import BackendsFileRef, InferencePoolRef
from tests.support.certs import TestCA
from tests.support.fake_kube import FakeKubeApiServer
from tests.support.pd_engines import ConnectionCounter, FakeEngine, Seen, closed_port, fake_engine, ok_json
from tests.support.poll import async_wait_until

HEADER = "x-prefiller-host-port"
CHAT = "/v1/chat/completions"
REQUEST: dict[str, Any] = {
    "model": "m",
    "messages": [{"role": "user", "content": "a long prompt"}],
    "max_tokens": 50,
    "temperature": 0.5,
}
STREAMED: dict[str, Any] = {
    **REQUEST,
    "stream": True,
    "stream_options": {"include_usage": True},
    "min_tokens": 5,
    "max_completion_tokens": 60,
}
# vLLM's NixlConnector answer to a prefill leg (docs/wire.md §8)
PRODUCED: dict[str, Any] = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [1, 2, 3],
    "remote_engine_id": "engine-p",
    "remote_host": "10.0.0.9",
    "remote_port": 5600,
    "tp_size": 1,
}
PREFILL_ANSWER: dict[str, Any] = {
    "id": "p",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "x"}, "finish_reason": "length"}],
    "usage": {"prompt_tokens": 40, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 16}},
    "kv_transfer_params": PRODUCED,
}
DECODE_ANSWER: dict[str, Any] = {
    "id": "d",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 40, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 32}},
}
SSE = [b'data: {"choices":[{"delta":{"content":"he"}}]}\n\n', b'data: {"choices":[{"delta":{"content":"llo"}}],',
       b'"usage":{"prompt_tokens_details":{"cached_tokens":32}}}\n\n', b"data: [DONE]\n\n"]  # fmt: skip


def body_of(payload: dict[str, Any]) -> bytes:
    # a layout of our own (spaces, key order): a byte-for-byte leg proves the body was not re-serialized
    return json.dumps(payload, indent=1).encode()


def answer_json(payload: dict[str, Any], status: int = 200) -> Any:
    async def answer(_: web.Request, __: Seen) -> web.StreamResponse:
        return web.json_response(payload, status=status)

    return answer


async def answer_sse(request: web.Request, _: Seen) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Engine": "decode"})
    await response.prepare(request)
    for chunk in SSE:
        await response.write(chunk)
    await response.write_eof()
    return response


async def hang(_: web.Request, __: Seen) -> web.StreamResponse:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


def options(decode: FakeEngine, allowed: list[str], **changes: Any) -> SidecarOptions:
    base = SidecarOptions(
        host="127.0.0.1",
        port=0,
        model_server_port=decode.port,
        prefill_targets=frozenset(allowed),
        drain_seconds=2.0,
    )
    return replace(base, **changes)


@dataclass(frozen=True)
class Reply:
    status: int
    headers: CIMultiDictProxy[str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    def error(self) -> dict[str, Any]:
        assert self.headers["Content-Type"].startswith("application/json"), self.headers
        error: dict[str, Any] = self.json()["error"]
        return error


@dataclass(frozen=True)
class Client:
    """A started sidecar and an HTTP client to it."""

    running: Running
    session: aiohttp.ClientSession
    url: str

    async def post(self, body: Any, prefill: str | None = None, path: str = CHAT, headers: Any = None) -> Reply:
        """POST ``body`` (bytes, or a dict sent as ``body_of`` lays it out) with ``x-prefiller-host-port: prefill``."""
        sent = CIMultiDict(headers or {})
        if prefill is not None:
            sent[HEADER] = prefill
        data = body_of(body) if isinstance(body, dict) else body
        async with self.session.post(self.url + path, data=data, headers=sent) as resp:
            return Reply(resp.status, resp.headers, await resp.read())

    async def get(self, path: str, headers: Any = None) -> Reply:
        async with self.session.get(self.url + path, headers=headers) as resp:
            return Reply(resp.status, resp.headers, await resp.read())

    def counter(self, name: str, **labels: str) -> float:
        return counter(self.running, name, **labels)


@contextlib.asynccontextmanager
async def sidecar(opts: SidecarOptions) -> AsyncIterator[Client]:
    async with started(opts) as running, aiohttp.ClientSession(auto_decompress=False) as session:
        yield Client(running, session, f"http://127.0.0.1:{running.port}")


@pytest.fixture
async def decode() -> AsyncIterator[FakeEngine]:
    async with fake_engine(answer_json(DECODE_ANSWER)) as engine:
        yield engine


@pytest.fixture
async def prefill() -> AsyncIterator[FakeEngine]:
    async with fake_engine(answer_json(PREFILL_ANSWER)) as engine:
        yield engine


def counter(running: Running, name: str, **labels: str) -> float:
    value = running.metrics.registry.get_sample_value(name, labels or None)
    return value or 0.0


async def settled(running: Running) -> None:
    """The sidecar holds no request any more (its in-flight gauges back to 0)."""
    await async_wait_until(
        lambda: (
            counter(running, "kv_pd_sidecar_inflight_requests", kind="all") == 0
            and counter(running, "kv_pd_sidecar_inflight_requests", kind="pd") == 0
        ),
        what="no request in flight in the sidecar",
    )


# --- passthrough ---


async def raw_exchange(port: int, request: bytes) -> bytes:
    """One HTTP/1.1 exchange written byte for byte (``Connection: close``): the answer's bytes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        return await reader.read()
    finally:
        writer.close()
        await writer.wait_closed()


async def test_without_the_header_a_request_reaches_the_engine_as_it_came(decode: FakeEngine) -> None:
    body = b'{"model":  "m", "prompt": "hi"}'
    request = (
        b"POST /v1/completions?x=1%202 HTTP/1.1\r\nHost: sidecar.example\r\nX-Custom: a\r\nX-Custom: b\r\n"
        b"Authorization: Bearer t\r\nContent-Type: application/json\r\nX-Hop: 1\r\nConnection: close, X-Hop\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    decode.answer = ok_json
    async with sidecar(options(decode, [])) as c:
        answer = await raw_exchange(c.running.port, request)
    assert answer.startswith(b"HTTP/1.1 200")
    assert answer.endswith(b'{"ok": true}')
    (seen,) = decode.seen
    assert (seen.method, seen.path, seen.body) == ("POST", "/v1/completions?x=1%202", body)
    assert list(seen.headers) == [
        ("Host", "sidecar.example"), ("X-Custom", "a"), ("X-Custom", "b"), ("Authorization", "Bearer t"),
        ("Content-Type", "application/json"), ("Content-Length", str(len(body))),
    ]  # fmt: skip


async def test_every_other_path_is_proxied_and_the_header_never_reaches_the_engine(
    decode: FakeEngine, prefill: FakeEngine
) -> None:
    models = {"object": "list", "data": [{"id": "m"}]}
    decode.answer = answer_json(models)
    async with sidecar(options(decode, [prefill.address])) as c:
        for path in ("/v1/models", "/metrics", "/health"):
            reply = await c.get(path, headers={HEADER: prefill.address})
            assert (reply.status, reply.json()) == (200, models), path
            assert "x-kv-epp-prefill" not in reply.headers  # a passthrough answer is the engine's, untouched
        reply = await c.post({"model": "m", "prompt": "p"}, prefill.address, path="/tokenize")
        assert reply.status == 200
        # an empty header is no header: passthrough, and the header is removed all the same
        assert (await c.post(REQUEST, " ")).status == 200
        assert c.counter("kv_pd_sidecar_passthrough_requests_total", reason="not_pd_route") == 4
        assert c.counter("kv_pd_sidecar_passthrough_requests_total", reason="no_header") == 1
    assert [(s.method, s.path) for s in decode.seen] == [
        ("GET", "/v1/models"), ("GET", "/metrics"), ("GET", "/health"), ("POST", "/tokenize"), ("POST", CHAT),
    ]  # fmt: skip
    assert all(HEADER not in s.names() for s in decode.seen)
    assert decode.seen[-1].body == body_of(REQUEST)
    assert prefill.seen == []


async def test_a_streamed_passthrough_answer_is_relayed_byte_for_byte(decode: FakeEngine) -> None:
    decode.answer = answer_sse
    async with sidecar(options(decode, [])) as c:
        reply = await c.post(STREAMED)
    assert reply.status == 200
    assert (reply.headers["Content-Type"], reply.headers["X-Engine"]) == ("text/event-stream", "decode")
    assert reply.body == b"".join(SSE)


# --- the connectors' legs ---


async def test_nixlv2_legs(decode: FakeEngine, prefill: FakeEngine) -> None:
    async with sidecar(options(decode, [prefill.address])) as c:
        reply = await c.post(REQUEST, prefill.address, headers={"x-request-id": "client-id", "Authorization": "t"})
        assert c.counter("kv_pd_sidecar_pd_requests_total", connector="nixlv2") == 1
    assert (reply.status, reply.headers["x-kv-epp-prefill"]) == (200, "remote")
    (p,) = prefill.seen
    (d,) = decode.seen
    assert p.path == d.path == CHAT
    one_token = {"stream": False, "max_tokens": 1, "max_completion_tokens": 1}
    assert json.loads(p.body) == {**REQUEST, **one_token, "kv_transfer_params": NIXL_PREFILL_PARAMS}
    assert json.loads(d.body) == {**REQUEST, "kv_transfer_params": PRODUCED}
    # one fresh request id shared by both legs, in place of the client's
    assert p.header("x-request-id") == d.header("x-request-id")
    assert p.header("x-request-id") != ["client-id"] and len(p.header("x-request-id")) == 1
    assert p.header("authorization") == d.header("authorization") == ["t"]
    assert HEADER not in p.names() | d.names()
    # the decode answer's cached_tokens is the prefill side's (as llm-d's sidecar does); the rest is the engine's
    usage = {**DECODE_ANSWER["usage"], "prompt_tokens_details": {"cached_tokens": 16}}
    assert reply.json() == {**DECODE_ANSWER, "usage": usage}


async def test_nixlv2_streamed_decode_answer_passes_untouched(decode: FakeEngine, prefill: FakeEngine) -> None:
    decode.answer = answer_sse
    async with sidecar(options(decode, [prefill.address])) as c:
        reply = await c.post(STREAMED, prefill.address)
    assert (reply.status, reply.headers["x-kv-epp-prefill"]) == (200, "remote")
    assert reply.body == b"".join(SSE)  # cached_tokens 32 stays: a stream is not rewritten
    (p,) = prefill.seen
    (d,) = decode.seen
    unstreamed = {k: v for k, v in STREAMED.items() if k != "stream_options"}
    one_token = {"stream": False, "max_tokens": 1, "max_completion_tokens": 1, "min_tokens": 1}
    assert json.loads(p.body) == {**unstreamed, **one_token, "kv_transfer_params": NIXL_PREFILL_PARAMS}
    assert json.loads(d.body) == {**STREAMED, "kv_transfer_params": PRODUCED}


async def test_shared_storage_legs(decode: FakeEngine, prefill: FakeEngine) -> None:
    prefill.answer = answer_json({**PREFILL_ANSWER, "kv_transfer_params": None})
    async with sidecar(options(decode, [prefill.address], kv_connector="shared-storage")) as c:
        reply = await c.post(STREAMED, prefill.address, path="/v1/completions")
    assert (reply.status, reply.headers["x-kv-epp-prefill"]) == (200, "remote")
    assert reply.json() == DECODE_ANSWER  # no cached_tokens rewrite: the consumer's figure is the truth
    (p,) = prefill.seen
    (d,) = decode.seen
    unstreamed = {k: v for k, v in STREAMED.items() if k != "stream_options"}
    one_token = {"stream": False, "max_tokens": 1, "max_completion_tokens": 1, "min_tokens": 1}
    assert json.loads(p.body) == {**unstreamed, **one_token}
    assert d.body == body_of(STREAMED)  # the decode leg is the client's body, byte for byte
    assert p.header("x-request-id") == d.header("x-request-id")


async def test_sglang_legs_run_at_once_with_one_bootstrap_room(decode: FakeEngine, prefill: FakeEngine) -> None:
    decode_arrived = asyncio.Event()

    async def prefill_waits_for_the_decode_leg(_: web.Request, __: Seen) -> web.StreamResponse:
        await decode_arrived.wait()  # answers only once the decode leg has arrived: the legs run at once
        return web.json_response({"ok": "prefill"})

    async def decode_answer(_: web.Request, __: Seen) -> web.StreamResponse:
        decode_arrived.set()
        return web.json_response(DECODE_ANSWER)

    prefill.answer = prefill_waits_for_the_decode_leg
    decode.answer = decode_answer
    async with sidecar(options(decode, [prefill.address], kv_connector="sglang", sglang_bootstrap_port=8998)) as c:
        reply = await c.post(REQUEST, prefill.address)
        await settled(c.running)
    assert (reply.status, reply.json()) == (200, DECODE_ANSWER)
    (p,) = prefill.seen
    (d,) = decode.seen
    room = json.loads(p.body)["bootstrap_room"]
    assert isinstance(room, int) and 0 <= room < 2**63
    expected = {**REQUEST, "bootstrap_host": "127.0.0.1", "bootstrap_port": 8998, "bootstrap_room": room}
    assert json.loads(p.body) == json.loads(d.body) == expected
    assert p.header("x-request-id") == d.header("x-request-id")


# --- SSRF, the header, the body ---


async def test_a_prefill_target_outside_the_pool_is_refused_without_a_connection(decode: FakeEngine) -> None:
    outside = ConnectionCounter()
    await outside.start()
    try:
        async with sidecar(options(decode, ["127.0.0.1:1"])) as c:
            reply = await c.post(REQUEST, outside.address)
            assert c.counter("kv_pd_sidecar_ssrf_refusals_total") == 1
    finally:
        await outside.stop()
    assert reply.status == 403
    assert reply.error()["code"] == "prefill_target_not_in_pool" and outside.address in reply.error()["message"]
    assert outside.accepted == 0
    assert decode.seen == []


@pytest.mark.parametrize(
    "value", ["prefill.example:8000", "10.0.0.1", "10.0.0.1:0", "::1:8000", "10.0.0.1:8000/x", "10.0.0.1:http"]
)
async def test_a_header_that_is_not_ip_port_is_a_400(decode: FakeEngine, value: str) -> None:
    async with sidecar(options(decode, ["10.0.0.1:8000"])) as c:
        reply = await c.post(REQUEST, value)
        assert c.counter("kv_pd_sidecar_rejected_requests_total", reason="bad_header") == 1
    assert (reply.status, reply.error()["code"]) == (400, "bad_header")
    assert decode.seen == []


async def test_the_first_value_is_used(decode: FakeEngine, prefill: FakeEngine) -> None:
    """A comma list, or repeated headers: the first value is the target (the others are not even checked)."""
    async with sidecar(options(decode, [prefill.address])) as c:
        assert (await c.post(REQUEST, f"{prefill.address}, 127.0.0.1:1")).status == 200
        repeated = [(HEADER, prefill.address), (HEADER, "127.0.0.1:1")]
        assert (await c.post(REQUEST, headers=repeated)).status == 200
    assert len(prefill.seen) == 2
    assert all(HEADER not in s.names() for s in [*prefill.seen, *decode.seen])


async def test_a_malformed_body_is_a_400_and_reaches_no_engine(decode: FakeEngine, prefill: FakeEngine) -> None:
    async with sidecar(options(decode, [prefill.address])) as c:
        for body in (b'{"model": "m", ', b'["a list"]', b"\xff\xfe"):
            reply = await c.post(body, prefill.address)
            assert (reply.status, reply.error()["code"]) == (400, "malformed_body")
        assert c.counter("kv_pd_sidecar_rejected_requests_total", reason="malformed_body") == 3
    assert prefill.seen == [] and decode.seen == []


async def test_a_compressed_body_passes_through_as_sent_but_takes_no_pd(
    decode: FakeEngine, prefill: FakeEngine
) -> None:
    gzipped = gzip.compress(body_of(REQUEST))
    encoded = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
    async with sidecar(options(decode, [prefill.address])) as c:
        assert (await c.post(gzipped, headers=encoded)).status == 200
        reply = await c.post(gzipped, prefill.address, headers=encoded)
    assert (reply.status, reply.error()["code"]) == (415, "unsupported_encoding")
    (seen,) = decode.seen
    assert seen.body == gzipped and seen.header("content-encoding") == ["gzip"]
    assert prefill.seen == []


async def test_a_body_over_the_bound_is_a_413(decode: FakeEngine, prefill: FakeEngine) -> None:
    async def chunked() -> AsyncIterator[bytes]:  # no content-length: the bound applies as it is read
        for _ in range(4):
            yield b" " * 400

    async with sidecar(options(decode, [prefill.address], max_body_bytes=1000)) as c:
        big = {**REQUEST, "messages": [{"role": "user", "content": "x" * 2000}]}
        reply = await c.post(big, prefill.address)
        assert (reply.status, reply.error()["code"]) == (413, "body_too_large")
        assert (await c.post(chunked(), prefill.address)).status == 413
    assert prefill.seen == [] and decode.seen == []


@pytest.mark.parametrize("bound", [{"max_pd_requests": 1}, {"max_buffered_bytes": 1500}, {"max_requests": 1}])
async def test_past_an_in_flight_bound_a_request_is_a_503(
    decode: FakeEngine, prefill: FakeEngine, bound: dict[str, int]
) -> None:
    release = asyncio.Event()

    async def held(_: web.Request, __: Seen) -> web.StreamResponse:
        await release.wait()
        return web.json_response(PREFILL_ANSWER)

    prefill.answer = held
    body = {**REQUEST, "messages": [{"role": "user", "content": "x" * 900}]}  # about 1000 bytes as laid out
    async with sidecar(options(decode, [prefill.address], **bound)) as c:
        first = asyncio.create_task(c.post(body, prefill.address))
        await async_wait_until(lambda: prefill.seen, what="the first request's prefill leg")
        second = await c.post(body, prefill.address)
        assert (second.status, second.error()["code"]) == (503, "overloaded")
        release.set()
        assert (await first).status == 200
        assert (await c.post(body, prefill.address)).status == 200  # the bound is free again
    assert len(prefill.seen) == 2


async def test_the_buffered_bound_counts_the_bodies_still_being_read(decode: FakeEngine, prefill: FakeEngine) -> None:
    """A body is reserved at its declared length before it is read: two slow uploads of 1,000 bytes each under a
    1,500-byte bound, the second is refused while the first is still arriving (nothing of it read)."""
    gate = asyncio.Event()
    body = body_of({**REQUEST, "messages": [{"role": "user", "content": "x" * 900}]})

    async def slowly() -> AsyncIterator[bytes]:
        yield body[:10]
        await gate.wait()
        yield body[10:]

    async with sidecar(options(decode, [prefill.address], max_buffered_bytes=1500)) as c:
        headers = {HEADER: prefill.address, "content-length": str(len(body)), "content-type": "application/json"}
        first = asyncio.create_task(c.session.post(c.url + CHAT, data=slowly(), headers=headers))
        await async_wait_until(
            lambda: c.counter("kv_pd_sidecar_inflight_requests", kind="pd") == 1, what="the first read"
        )
        second = await c.post(body, prefill.address)
        assert (second.status, second.error()["code"]) == (503, "overloaded")
        gate.set()
        resp = await first
        assert resp.status == 200
        resp.release()
    assert len(prefill.seen) == 1


# --- a failed prefill leg ---


async def test_a_prefill_http_error_is_the_clients(decode: FakeEngine, prefill: FakeEngine) -> None:
    vllm_error = {"error": {"message": "maximum context length is 64", "type": "BadRequestError", "code": 400}}

    async def not_json(_: web.Request, __: Seen) -> web.StreamResponse:
        return web.Response(status=500, text="<html>boom</html>", content_type="text/html")

    prefill.answer = answer_json(vllm_error, status=400)
    async with sidecar(options(decode, [prefill.address])) as c:
        engine_error = await c.post(REQUEST, prefill.address)
        prefill.answer = not_json
        html_error = await c.post(REQUEST, prefill.address)
        assert c.counter("kv_pd_sidecar_prefill_failures_total", kind="http_error") == 2
    assert (engine_error.status, engine_error.headers["x-kv-epp-prefill"]) == (400, "failed")
    assert engine_error.json() == vllm_error  # the engine's own error, as one engine would have given it
    assert (html_error.status, html_error.headers["x-kv-epp-prefill"]) == (500, "failed")
    error = html_error.error()
    assert (error["type"], error["code"]) == ("prefill_failed", "http_error")
    assert prefill.address in error["message"] and "boom" in error["message"]
    assert decode.seen == []


async def test_a_refused_prefill_connection_is_a_502(decode: FakeEngine) -> None:
    target = f"127.0.0.1:{closed_port()}"
    async with sidecar(options(decode, [target])) as c:
        reply = await c.post(REQUEST, target)
        assert c.counter("kv_pd_sidecar_prefill_failures_total", kind="connect_error") == 1
    assert (reply.status, reply.headers["x-kv-epp-prefill"]) == (502, "failed")
    assert reply.error()["code"] == "connect_error" and target in reply.error()["message"]
    assert decode.seen == []


async def test_a_prefill_past_its_timeout_is_a_504_and_is_cancelled(decode: FakeEngine, prefill: FakeEngine) -> None:
    prefill.answer = hang
    async with sidecar(options(decode, [prefill.address], prefill_timeout=0.5)) as c:
        reply = await c.post(REQUEST, prefill.address)
        assert (reply.status, reply.error()["code"]) == (504, "timeout")
        await async_wait_until(lambda: prefill.cancelled == [CHAT], what="the prefill engine sees the connection close")
        assert c.counter("kv_pd_sidecar_prefill_failures_total", kind="timeout") == 1
    assert decode.seen == []


async def test_a_prefill_answer_without_transfer_params_is_a_502_not_a_local_prefill(
    decode: FakeEngine, prefill: FakeEngine
) -> None:
    prefill.answer = answer_json({k: v for k, v in PREFILL_ANSWER.items() if k != "kv_transfer_params"})
    async with sidecar(options(decode, [prefill.address])) as c:
        reply = await c.post(REQUEST, prefill.address)
        assert c.counter("kv_pd_sidecar_prefill_failures_total", kind="bad_answer") == 1
    assert reply.status == 502
    assert reply.error()["code"] == "bad_answer" and "kv_transfer_params" in reply.error()["message"]
    assert decode.seen == []


async def test_prefill_failure_local_decodes_locally_and_says_so(decode: FakeEngine, prefill: FakeEngine) -> None:
    prefill.answer = answer_json({"error": {"message": "overloaded"}}, status=503)
    async with sidecar(options(decode, [prefill.address], prefill_failure="local")) as c:
        fallback = await c.post(REQUEST, prefill.address, headers={"x-request-id": "client-id"})
        assert c.counter("kv_pd_sidecar_local_fallbacks_total", kind="http_error") == 1
        # a 4xx the local engine would repeat stays the client's
        prefill.answer = answer_json({"error": {"message": "bad"}}, status=400)
        refused = await c.post(REQUEST, prefill.address)
        assert c.counter("kv_pd_sidecar_local_fallbacks_total", kind="http_error") == 1
        assert c.counter("kv_pd_sidecar_prefill_failures_total", kind="http_error") == 2
    assert (fallback.status, fallback.headers["x-kv-epp-prefill"]) == (200, "local-fallback")
    assert fallback.json() == DECODE_ANSWER  # the local engine's own figures: nothing rewritten
    assert (refused.status, refused.headers["x-kv-epp-prefill"]) == (400, "failed")
    (d,) = decode.seen
    assert d.body == body_of(REQUEST)  # the client's body, as a passthrough would have sent it
    assert d.header("x-request-id") == ["client-id"]
    assert HEADER not in d.names()


async def test_sglang_prefill_failure_before_the_decode_answer_is_the_clients(
    decode: FakeEngine, prefill: FakeEngine
) -> None:
    prefill.answer = answer_json({"error": {"message": "no room"}}, status=500)
    decode.answer = hang  # the decode engine waits for the KV that never comes
    async with sidecar(options(decode, [prefill.address], kv_connector="sglang")) as c:
        reply = await c.post(REQUEST, prefill.address)
        await async_wait_until(lambda: decode.cancelled == [CHAT], what="the decode leg is cancelled")
        await settled(c.running)
    assert (reply.status, reply.headers["x-kv-epp-prefill"]) == (500, "failed")
    assert reply.json() == {"error": {"message": "no room"}}


# --- client aborts ---


async def test_a_client_gone_during_the_prefill_leg_cancels_it(decode: FakeEngine, prefill: FakeEngine) -> None:
    prefill.answer = hang
    async with sidecar(options(decode, [prefill.address])) as c:
        call = asyncio.create_task(c.post(REQUEST, prefill.address))
        await async_wait_until(lambda: prefill.seen, what="the prefill leg arrives")
        call.cancel()  # the client closes its connection
        with contextlib.suppress(asyncio.CancelledError):
            await call
        await async_wait_until(lambda: prefill.cancelled == [CHAT], what="the prefill engine sees the connection close")
        await settled(c.running)
        assert c.counter("kv_pd_sidecar_client_aborts_total", leg="prefill") == 1
    assert decode.seen == []


async def test_a_client_gone_during_the_decode_stream_cancels_it(decode: FakeEngine, prefill: FakeEngine) -> None:
    async def endless(request: web.Request, _: Seen) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(SSE[0])
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    decode.answer = endless
    async with sidecar(options(decode, [prefill.address])) as c:
        resp = await c.session.post(c.url + CHAT, data=body_of(STREAMED), headers={HEADER: prefill.address})
        assert await resp.content.readuntil(b"\n\n") == SSE[0]
        resp.close()  # the client goes away mid-stream
        await async_wait_until(lambda: decode.cancelled == [CHAT], what="the decode engine sees the connection close")
        await settled(c.running)
        assert c.counter("kv_pd_sidecar_client_aborts_total", leg="decode") == 1
    assert len(prefill.seen) == 1 and prefill.cancelled == []


async def test_a_client_gone_during_a_passthrough_cancels_it(decode: FakeEngine) -> None:
    decode.answer = hang
    async with sidecar(options(decode, [])) as c:
        call = asyncio.create_task(c.get("/v1/models"))
        await async_wait_until(lambda: decode.seen, what="the request arrives")
        call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await call
        await async_wait_until(lambda: decode.cancelled == ["/v1/models"], what="the engine sees the connection close")
        await settled(c.running)


async def test_a_client_gone_during_sglangs_legs_cancels_both(decode: FakeEngine, prefill: FakeEngine) -> None:
    prefill.answer = decode.answer = hang
    async with sidecar(options(decode, [prefill.address], kv_connector="sglang")) as c:
        call = asyncio.create_task(c.post(REQUEST, prefill.address))
        await async_wait_until(lambda: prefill.seen and decode.seen, what="both legs arrive")
        call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await call
        await async_wait_until(lambda: prefill.cancelled == decode.cancelled == [CHAT], what="both legs closed")
        await settled(c.running)


# --- the local engine ---


async def test_the_local_engine_down_is_a_503(prefill: FakeEngine) -> None:
    opts = options(prefill, [prefill.address], model_server_port=closed_port())  # no engine behind the sidecar
    async with sidecar(opts) as c:
        passthrough = await c.get("/v1/models")
        pd = await c.post(REQUEST, prefill.address)
        assert c.counter("kv_pd_sidecar_local_engine_errors_total", kind="connect_error") == 2
    assert (passthrough.status, passthrough.error()["code"]) == (503, "connect_error")
    assert (pd.status, pd.headers["x-kv-epp-prefill"]) == (503, "remote")  # the prefill leg ran; no engine to decode


async def test_an_engine_stream_cut_short_reaches_the_client_cut_short(decode: FakeEngine) -> None:
    async def cut(request: web.Request, _: Seen) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(SSE[0])
        assert request.transport is not None
        request.transport.close()  # the engine dies mid-answer
        return response

    decode.answer = cut
    async with sidecar(options(decode, [])) as c:
        async with c.session.post(c.url + CHAT, data=body_of(STREAMED)) as resp:
            assert resp.status == 200
            with pytest.raises(aiohttp.ClientPayloadError):  # not a clean end: the client knows it is cut
                await resp.read()
        assert c.counter("kv_pd_sidecar_local_engine_errors_total", kind="broken_stream") == 1
        await settled(c.running)


async def test_prefill_legs_over_tls(decode: FakeEngine, tmp_path: Path) -> None:
    issued = TestCA().issue("prefill")
    (tmp_path / "c.pem").write_bytes(issued.cert_pem)
    (tmp_path / "k.pem").write_bytes(issued.key_pem)
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(tmp_path / "c.pem", tmp_path / "k.pem")
    async with fake_engine(answer_json(PREFILL_ANSWER), ssl_context=server) as prefill:
        verified = options(decode, [prefill.address], prefiller_use_tls=True)
        async with sidecar(verified) as c:
            refused = await c.post(REQUEST, prefill.address)  # the test CA is not a system root: verified, refused
        async with sidecar(replace(verified, prefiller_tls_insecure_skip_verify=True)) as c:
            trusted = await c.post(REQUEST, prefill.address)
    assert (refused.status, trusted.status) == (502, 200)
    assert len(prefill.seen) == 1 and len(decode.seen) == 1


# --- the allowlist's sources ---


async def test_the_allowlist_follows_a_backends_file(decode: FakeEngine, prefill: FakeEngine, tmp_path: Path) -> None:
    path = tmp_path / "backends.yaml"
    path.write_text("backends:\n  - {name: other, address: '127.0.0.1:1'}\n")
    ref = BackendsFileRef(path=str(path), poll_seconds=0.05)
    async with sidecar(options(decode, [], backends_file=ref)) as c:
        await async_wait_until(lambda: c.running.allowlist.synced, what="the file read")
        assert (await c.post(REQUEST, prefill.address)).status == 403
        path.write_text(f"backends:\n  - {{name: p, address: '{prefill.address}', ready: false}}\n")
        await async_wait_until(
            lambda: (
                c.counter("kv_pd_sidecar_allowlist_targets") == 1
                and c.running.allowlist.check(prefill.address) is Verdict.ALLOWED
            ),
            what="the file re-read",
        )
        assert (await c.post(REQUEST, prefill.address)).status == 200  # a member of the pool, ready or not
    assert len(prefill.seen) == 1


async def test_the_allowlist_follows_an_inference_pool(decode: FakeEngine, prefill: FakeEngine, tmp_path: Path) -> None:
    kube = FakeKubeApiServer()
    await kube.start()
    try:
        kubeconfig = kube.write_kubeconfig(tmp_path / "kubeconfig", namespace="llm")
        kube.put_pool("pool", "llm", {"app": "vllm"}, [prefill.port])
        kube.put_pod("prefill-0", "llm", {"app": "vllm", "llm-d.ai/role": "prefill"}, "127.0.0.1", True)
        ref = InferencePoolRef(name="pool", namespace="llm", kubeconfig=str(kubeconfig))
        async with sidecar(options(decode, [], inference_pool=ref)) as c:
            await async_wait_until(lambda: len(c.running.allowlist) == 1, what="the pool's one endpoint")
            assert (await c.post(REQUEST, prefill.address)).status == 200
            # the pod's IP on a port that is not the pool's target port: outside the pool
            assert (await c.post(REQUEST, "127.0.0.1:1")).status == 403
            kube.delete_pod("prefill-0", "llm")
            await async_wait_until(lambda: len(c.running.allowlist) == 0, what="the pod gone from the allowlist")
            assert (await c.post(REQUEST, prefill.address)).status == 403
    finally:
        await kube.stop()
    assert len(prefill.seen) == 1


async def test_the_sidecar_answers_503_until_the_pool_is_known(decode: FakeEngine, tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"  # an API server that is not there: the pool is never listed
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{closed_port()}"}}],
        "users": [{"name": "u", "user": {}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u", "namespace": "llm"}}],
    }))  # fmt: skip
    ref = InferencePoolRef(name="pool", namespace="llm", kubeconfig=str(kubeconfig))
    async with sidecar(options(decode, [], inference_pool=ref)) as c:
        pd = await c.post(REQUEST, "127.0.0.1:1")
        passthrough = await c.get("/v1/models")  # a passthrough needs no allowlist
        assert c.counter("kv_pd_sidecar_allowlist_synced") == 0
    assert (pd.status, pd.error()["code"]) == (503, "allowlist_not_synced")
    assert passthrough.status == 200
    assert [s.path for s in decode.seen] == ["/v1/models"]


async def test_a_stop_lets_requests_in_flight_finish(decode: FakeEngine, prefill: FakeEngine) -> None:
    release = asyncio.Event()

    async def slow(_: web.Request, __: Seen) -> web.StreamResponse:
        await release.wait()
        return web.json_response(DECODE_ANSWER)

    decode.answer = slow
    stop = asyncio.Event()

    async def run_sidecar(ready: asyncio.Future[int]) -> None:
        # drain_seconds well past the polls below: the drain must not end before the test releases the request
        async with started(options(decode, [prefill.address], drain_seconds=60.0)) as running:
            ready.set_result(running.port)
            await stop.wait()
        # leaving `started` drains: it returns once the request in flight is answered

    ready: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    runner = asyncio.create_task(run_sidecar(ready))
    port = await ready
    async with aiohttp.ClientSession() as session:
        url = f"http://127.0.0.1:{port}{CHAT}"
        call = asyncio.create_task(session.post(url, data=body_of(REQUEST), headers={HEADER: prefill.address}))
        await async_wait_until(lambda: decode.seen, what="the decode leg arrives")
        stop.set()  # as SIGTERM does
        await async_wait_until(lambda: not _accepts(port), what="the sidecar stops listening")
        assert not runner.done()
        release.set()
        resp = await call
        assert resp.status == 200 and await resp.json() == {
            **DECODE_ANSWER, "usage": {**DECODE_ANSWER["usage"], "prompt_tokens_details": {"cached_tokens": 16}},
        }  # fmt: skip
        resp.release()
    await runner


def _accepts(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0
