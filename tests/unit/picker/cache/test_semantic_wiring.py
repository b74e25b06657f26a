"""The semantic cache and the Anthropic injection wired into the request path and the ext_proc stream.

Semantic: the app's response cache against the simulator's real ``/v1/embeddings`` (an in-process server on a
free port): a near-duplicate question after a stored answer is a semantic HIT; another system prompt, tool list or
tenant is a MISS; an embedding failure (refused, timed out) is a plain miss that indexes nothing; the path is
hot-reloadable. Anthropic: the request path sets the rewritten body, and the stream sends it upstream in place of
the client's (full duplex and BUFFERED), with a matching ``content-length``.

The tests that start a server or bind a socket: tests/integration/test_semantic_wiring_sim.py."""

from __future__ import annotations

import json
import socket
from typing import Any

import orjson
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from picker.config import ConfigError, parse_settings
from picker.facts import Answer
from picker.ops.metrics import PickerMetrics
from picker.request.anthropic import count_markers
from picker.request.exchange import Exchange
from picker.request.path import Inbound
from picker.runtime.app import PickerApp
from picker.runtime.compose import build_app
from tests.support.builders import BACKENDS, CHAT, stream_of
from tests.support.semantic_chat import (
    ALICE,
    NEAR,
    QUESTION,
    answer,
    chat,
    make,
    route,
    semantic_count,
    settings,
)


def refused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed on return: nothing listens there


async def test_an_open_embeddings_breaker_skips_the_semantic_path() -> None:
    app = make(f"http://127.0.0.1:{refused_port()}", semantic_extra={"breaker_failures": 2})
    try:
        for q in (QUESTION, NEAR):
            assert isinstance(await route(app, chat(q)), Exchange)
        assert semantic_count(app, "error") == 2 and app.embeddings.open
        requests = app.embeddings.stats.requests
        ex = await route(app, chat(QUESTION + " Thanks."))
        assert isinstance(ex, Exchange) and ex.x_cache == "MISS" and ex.cache.semantic is None
        assert semantic_count(app, "skip") == 1 and app.embeddings.stats.requests == requests  # no request made
    finally:
        await app.embeddings.close()


def test_index_bounds_and_breaker_are_configured_and_reloaded() -> None:
    app = make("http://127.0.0.1:1", semantic_extra={"max_bytes": 1 << 20, "max_scan": 7, "breaker_failures": 9})
    assert app.semantic_index.max_bytes == 1 << 20 and app.semantic_index.max_scan == 7
    assert app.embeddings.breaker_failures == 9 and app.embeddings.breaker_cooldown_s == 10.0
    reloaded = settings("http://127.0.0.1:1", semantic_extra={"max_scan": 3, "breaker_cooldown_ms": 500})
    app.response_cache.configure(reloaded.response_cache)
    assert app.semantic_index.max_scan == 3 and app.semantic_index.max_bytes == 64 << 20
    assert app.embeddings.breaker_failures == 5 and app.embeddings.breaker_cooldown_s == 0.5
    with pytest.raises(ConfigError, match=r"response_cache\.semantic\.max_scan"):
        settings("http://127.0.0.1:1", semantic_extra={"max_scan": 0})


async def test_embedding_refused_is_a_plain_miss() -> None:
    app = make(f"http://127.0.0.1:{refused_port()}")
    try:
        ex = await route(app, chat(QUESTION))
        assert isinstance(ex, Exchange) and ex.x_cache == "MISS" and ex.cache.semantic is None
        await answer(app, ex)
        assert len(app.semantic_index) == 0  # nothing indexed without a vector
        again = await route(app, chat(QUESTION))  # the exact entry still serves
        assert isinstance(again, Answer) and dict(again.headers)["x-cache"] == "HIT"
        assert semantic_count(app, "error") == 1  # the exact hit never calls the embedder
    finally:
        await app.embeddings.close()


# -- Anthropic cache_control injection -------------------------------------------------------------------
MESSAGES = "/v1/messages"


def anthropic_body(**fields: Any) -> bytes:
    base: dict[str, Any] = {
        "model": "claude-x", "max_tokens": 16, "system": "You are terse.",
        "messages": [{"role": "user", "content": "hi"}],
    }  # fmt: skip
    base.update(fields)
    return orjson.dumps(base)


def anthropic_app(mode: str, inject: bool = True) -> PickerApp:
    s = parse_settings(
        {
            "pool": {"backends": BACKENDS},
            "admin": {"enabled": False},
            "prefix_routing": {"anthropic_cache_control_injection": inject},
            "extproc": {"default_body_mode": mode},
        }
    )
    return build_app(s, PickerMetrics())


async def test_request_path_sets_the_injected_body() -> None:
    app = anthropic_app("FULL_DUPLEX_STREAMED")
    ex = await app.path.route(Inbound(MESSAGES, {":method": "POST"}, anthropic_body()))
    assert isinstance(ex, Exchange) and ex.body_out is not None and count_markers(ex.body_out) == 1
    assert orjson.loads(ex.body_out)["system"][-1]["cache_control"] == {"type": "ephemeral"}
    marked = anthropic_body(system=[{"type": "text", "text": "S", "cache_control": {"type": "ephemeral"}}])
    ex = await app.path.route(Inbound(MESSAGES, {":method": "POST"}, marked))
    assert isinstance(ex, Exchange) and ex.body_out is None
    chat_body = json.dumps(chat(QUESTION)).encode()
    ex = await app.path.route(Inbound(CHAT, {":method": "POST"}, chat_body))  # not native Anthropic
    assert isinstance(ex, Exchange) and ex.body_out is None
    prefix = app.settings.prefix_routing.model_copy(update={"anthropic_cache_control_injection": False})
    app.apply(app.settings.model_copy(update={"prefix_routing": prefix}))  # hot-reloaded: the next one untouched
    ex = await app.path.route(Inbound(MESSAGES, {":method": "POST"}, anthropic_body()))
    assert isinstance(ex, Exchange) and ex.body_out is None


def headers_msg(path: str) -> pb.ProcessingRequest:
    r = pb.ProcessingRequest()
    for k, v in ((":path", path), (":method", "POST")):
        h = r.request_headers.headers.headers.add()
        h.key, h.raw_value = k, v.encode()
    return r


def body_msg(body: bytes, eos: bool) -> pb.ProcessingRequest:
    r = pb.ProcessingRequest()
    r.request_body.body, r.request_body.end_of_stream = body, eos
    return r


def set_headers(common: Any) -> dict[str, str]:
    return {o.header.key: o.header.raw_value.decode() for o in common.header_mutation.set_headers}


async def test_full_duplex_sends_the_injected_body() -> None:
    stream = stream_of(anthropic_app("FULL_DUPLEX_STREAMED"))
    body = anthropic_body()
    assert await stream.handle(headers_msg(MESSAGES)) == ()
    assert await stream.handle(body_msg(body[:10], False)) == ()
    out = await stream.handle(body_msg(body[10:], True))
    sent = b"".join(r.request_body.response.body_mutation.streamed_response.body for r in out[1:])
    assert sent != body and count_markers(sent) == 1
    assert set_headers(out[0].request_headers.response)["content-length"] == str(len(sent))
    assert out[-1].request_body.response.body_mutation.streamed_response.end_of_stream


async def test_buffered_sends_the_injected_body_with_its_length() -> None:
    stream = stream_of(anthropic_app("BUFFERED"))
    body = anthropic_body()
    await stream.handle(headers_msg(MESSAGES))
    (out,) = await stream.handle(body_msg(body, True))
    common = out.request_body.response
    sent = common.body_mutation.body
    assert count_markers(sent) == 1 and set_headers(common)["content-length"] == str(len(sent))
    stream = stream_of(anthropic_app("BUFFERED", inject=False))  # off: no body mutation at all
    await stream.handle(headers_msg(MESSAGES))
    (out,) = await stream.handle(body_msg(body, True))
    assert not out.request_body.response.HasField("body_mutation")
    assert "content-length" not in set_headers(out.request_body.response)


@pytest.mark.parametrize("backend", ["embedder", "127.0.0.1:8000", "http://h x", "ftp://h"])
def test_semantic_backend_must_be_a_url(backend: str) -> None:
    with pytest.raises(ConfigError) as err:
        settings(backend)
    assert [p for p, _ in err.value.problems] == ["response_cache.semantic.backend"]


async def test_the_path_keys_anthropic_output_shaping_headers_and_skips_a_lossy_identity() -> None:
    """The route passes the request headers to the cache: anthropic-beta is part of the exact key; an identity
    header that was not UTF-8 (decoded lossily, so two callers could collide) gets no semantic path."""
    app = make("http://127.0.0.1:1")
    ex = await route(app, chat(QUESTION))
    assert isinstance(ex, Exchange)
    await answer(app, ex)
    assert isinstance(await route(app, chat(QUESTION)), Answer)  # the exact hit
    beta = await route(app, chat(QUESTION), {**ALICE, "anthropic-beta": "output-128k-2025-02-19"})
    assert isinstance(beta, Exchange) and beta.x_cache == "MISS"  # another key: not served the plain answer
    from picker.facts import caller_identity

    assert caller_identity({"authorization": "Bearer \ufffd"}, "authorization") is None
