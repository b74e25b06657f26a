"""Tier 2 through the real Envoy: the picker, two echo engines and the in-memory store.

- ``full`` (full duplex, or BUFFERED request bodies with STREAMED response bodies) and ``sampled`` (BUFFERED bodies;
  an eligible miss is switched to a streamed response body like a sample): the same T=0 request twice → the second
  answer is ``X-Cache: HIT``, byte-identical, and the engines saw one request; streamed (a synthetic SSE stream a
  strict parser accepts) and not.
- One Valkey, two pickers behind two Envoys: an entry stored through one is a HIT through the other.
- T>0 → ``X-Cache: BYPASS`` and both requests reach an engine.
- ``none`` (the default): no response body reaches the picker, so nothing is stored: every T=0 request is a MISS.
- Stored headers: the engine's ``x-backend`` is not replayed on a hit by default (``response_cache.stored_headers``
  is an allow-list: ``content-type``, ``content-language``); the BUFFERED + full stack lists it, and replays it.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import (
    HttpResult,
    Stack,
    build_stack,
    cache_pickers_on_valkey,
    http,
    valkey_keys,
)
from tests.support.valkey import running_valkey

pytestmark = pytest.mark.envoy


@pytest.fixture(
    scope="module",
    params=[
        ("FULL_DUPLEX_STREAMED", "full"),
        ("BUFFERED", "full"),
        ("BUFFERED", "sampled"),
        ("FULL_DUPLEX_STREAMED", "none"),
    ],
    ids=lambda p: f"{p[0]}-{p[1]}",
)
def stack(request: pytest.FixtureRequest, workdir: Path) -> Iterator[Stack]:
    body_mode, response_mode = request.param
    cache: dict[str, Any] = {"enabled": True}
    if replays_x_backend(body_mode, response_mode):
        cache["stored_headers"] = ["content-type", "x-backend"]
    config = {
        "selection_strategy": "RoundRobin",  # a repeat would go to the other engine: only the cache avoids it
        "response_cache": cache,
        "extproc": {"response_sample_rate": 0.0},
    }
    yield from build_stack(workdir, body_mode, 2, config, envoy_options={"response_mode": response_mode})


def replays_x_backend(body_mode: str, response_mode: str) -> bool:
    """The stack whose ``response_cache.stored_headers`` lists the engine's ``x-backend`` (the others: default)."""
    return (body_mode, response_mode) == ("BUFFERED", "full")


def seen(stack: Stack) -> int:
    return sum(stack.backends.stats(i)["seen"] for i in range(2))


def ask(stack: Stack, **fields: Any) -> HttpResult:
    body = {"model": "m", "messages": [{"role": "user", "content": "q"}], **fields}
    return http("POST", stack.url + "/v1/chat/completions", body)


def strict_sse(body: bytes) -> list[Any]:
    """Parse an OpenAI-style SSE body strictly: every line ``data: <payload>`` or blank, LF line ends, each event
    one data line and a blank line, the last event ``[DONE]``, every other payload a JSON object."""
    assert body.endswith(b"\n\n") and b"\r" not in body
    events = body[:-2].split(b"\n\n")
    assert events[-1] == b"data: [DONE]"
    out = []
    for e in events[:-1]:
        assert e.startswith(b"data: ") and b"\n" not in e, e
        payload = json.loads(e[len(b"data: ") :])
        assert isinstance(payload, dict)
        out.append(payload)
    return out


def stores(stack: Stack) -> bool:
    return stack.envoy.opts.response_mode != "none"


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_repeat_is_a_hit_answered_by_the_picker(stack: Stack, stream: bool) -> None:
    fields: dict[str, Any] = {"temperature": 0, "max_tokens": 4, "stream": stream, "user": uuid.uuid4().hex}
    before = seen(stack)
    first = ask(stack, **fields)
    assert first.status == 200 and first.headers.get("x-cache") == "MISS", first.headers
    assert seen(stack) == before + 1
    second = ask(stack, **fields)
    assert second.status == 200
    if not stores(stack):  # response mode none: the body never reached the picker
        assert second.headers.get("x-cache") == "MISS" and seen(stack) == before + 2
        return
    assert second.headers.get("x-cache") == "HIT", second.headers
    assert second.body == first.body  # byte-identical content
    assert seen(stack) == before + 1  # the engines saw one request
    assert first.headers.get("x-backend") in ("be-0", "be-1")  # the engine's own header on the routed answer
    if replays_x_backend(stack.mode, stack.envoy.opts.response_mode):  # listed in stored_headers: replayed
        assert second.headers.get("x-backend") == first.headers.get("x-backend"), second.headers
    else:  # the default allow-list: an engine's header is never replayed to another caller
        assert "x-backend" not in second.headers and "x-body-bytes" not in second.headers, second.headers
    if stream:
        assert second.headers["content-type"].startswith("text/event-stream")
        chunks = strict_sse(second.body)
        assert [c["choices"][0]["delta"]["content"] for c in chunks] == [f"tok{i} " for i in range(4)]
    else:
        assert second.headers["content-type"].startswith("application/json")
        assert json.loads(second.body)["echo_model"] == "m"
    third = ask(stack, **fields)  # and again: the entry stays
    assert third.headers.get("x-cache") == "HIT" and third.body == first.body and seen(stack) == before + 1


def test_nonzero_temperature_bypasses(stack: Stack) -> None:
    fields = {"temperature": 0.7, "user": uuid.uuid4().hex}
    before = seen(stack)
    a, b = ask(stack, **fields), ask(stack, **fields)
    assert (a.status, b.status) == (200, 200)
    assert a.headers.get("x-cache") == b.headers.get("x-cache") == "BYPASS"
    assert seen(stack) == before + 2


def test_a_different_request_is_not_served_the_entry(stack: Stack) -> None:
    user = uuid.uuid4().hex
    first = ask(stack, temperature=0, user=user)
    other = ask(stack, temperature=0, user=user, seed=7)  # anything that shapes the answer is keyed
    assert first.headers.get("x-cache") == other.headers.get("x-cache") == "MISS"


def test_picker_answers_carry_bypass(stack: Stack) -> None:
    bad = http("POST", stack.url + "/v1/chat/completions", b"{not json")
    assert bad.status == 400 and bad.headers.get("x-cache") == "BYPASS"


@pytest.mark.valkey
def test_two_pickers_share_entries_on_valkey(workdir: Path) -> None:
    """Two pickers (each behind its own Envoy) on one Valkey: a response cached through one is a HIT through
    the other, and the engines saw one request."""
    (workdir / "shared").mkdir(exist_ok=True)
    with (
        running_valkey(workdir / "valkey") as valkey,
        cache_pickers_on_valkey(valkey.url, workdir / "shared", "picker-valkey") as s,
    ):
        backends, envoys = s.backends, s.envoys
        body = {"model": "m", "messages": [{"role": "user", "content": uuid.uuid4().hex}], "temperature": 0}
        seen_before = sum(backends.stats(i)["seen"] for i in range(2))
        first = http("POST", envoys[0].url + "/v1/chat/completions", body)
        assert first.status == 200 and first.headers.get("x-cache") == "MISS"
        second = http("POST", envoys[1].url + "/v1/chat/completions", body)
        assert second.status == 200 and second.headers.get("x-cache") == "HIT", second.headers
        assert second.body == first.body
        assert sum(backends.stats(i)["seen"] for i in range(2)) == seen_before + 1
        keys = valkey_keys(valkey.url)
        assert len(keys) == 1 and keys[0].startswith("cr:resp:") and len(keys[0]) == len("cr:resp:") + 64
