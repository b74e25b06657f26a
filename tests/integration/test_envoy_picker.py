"""The picker behind the real Envoy binary, in both body modes (FULL_DUPLEX_STREAMED and BUFFERED)."""

from __future__ import annotations

import json
import math
import socket
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.integration.conftest import SUBSET_TEST_HEADER, Stack, build_stack, http
from tests.support.poll import wait_until

pytestmark = pytest.mark.envoy

PICKER_CONFIG = {
    "selection_strategy": "PrefixAwareHash",
    "prefix_routing": {"enabled": True, "load_factor_epsilon": 0.25},
    "pool": {"health": {"window_size": 10, "min_samples": 3, "unhealthy_below": 0.5, "cooldown_seconds": 60}},
}


@pytest.fixture(scope="module", params=["FULL_DUPLEX_STREAMED", "BUFFERED"])
def stack(request: pytest.FixtureRequest, workdir: Path) -> Iterator[Stack]:
    yield from build_stack(workdir, request.param, 4, PICKER_CONFIG)


@pytest.fixture(autouse=True)
def _reset(stack: Stack) -> None:
    stack.backends.reset()
    wait_idle(stack)


def in_flight(stack: Stack) -> dict[str, int]:
    return {
        d["backend"]: d["in_flight_requests"]
        for d in stack.admin("/admin/prefix-routing/stats")["backend_distribution"]
    }


def wait_idle(stack: Stack, timeout: float = 10.0) -> None:
    """Wait until the picker reports no request in flight (fails the test after ``timeout``)."""
    wait_until(lambda: not any(in_flight(stack).values()), timeout, interval=0.05, what="no request in flight")


def test_same_prefix_same_backend(stack: Stack) -> None:
    served = {stack.chat("You are a tax assistant.", user=f"question {i}").headers["x-backend"] for i in range(8)}
    assert len(served) == 1


def test_distinct_prefixes_spread(stack: Stack) -> None:
    counts = Counter(stack.chat(f"system prompt number {i}").headers["x-backend"] for i in range(60))
    assert set(counts) == set(stack.backends.names)  # every backend owns part of the key space
    assert max(counts.values()) <= 30


def test_concurrent_distinct_prefixes_stay_within_bound(stack: Stack) -> None:
    n = 24
    for i in range(4):
        stack.backends.control(i, delay_ms=600)
    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(lambda i: stack.chat(f"distinct prefix {i}"), range(n)))
    assert all(r.status == 200 for r in results)
    bound = math.ceil(1.25 * n / 4)  # (1 + epsilon) * average load with every request in flight
    peaks = [stack.backends.stats(i)["max_active"] for i in range(4)]
    assert max(peaks) <= bound, peaks


def test_hot_prefix_overflows_instead_of_overloading(stack: Stack) -> None:
    before = stack.admin("/admin/prefix-routing/stats")["routing_decisions"]
    n = 16
    for i in range(4):
        stack.backends.control(i, delay_ms=800)
    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(lambda i: stack.chat("the one hot system prompt", user=str(i)), range(n)))
    assert all(r.status == 200 for r in results)
    counts = Counter(r.headers["x-backend"] for r in results)
    assert len(counts) > 1  # spilled over
    assert max(counts.values()) <= math.ceil(1.25 * n / 4)
    after = stack.admin("/admin/prefix-routing/stats")["routing_decisions"]
    assert after["overflow"] > before["overflow"]


def test_streaming_response_passes_through_intact(stack: Stack) -> None:
    r = stack.chat("streaming system", stream=True, max_tokens=50)
    assert r.status == 200
    events = [line[6:] for line in r.body.decode().split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["index"] for c in chunks] == list(range(50))
    assert all(c["backend"] == r.headers["x-backend"] for c in chunks)


def test_large_body_is_forwarded_intact(stack: Stack) -> None:
    system = "lorem ipsum " * 20_000  # ~240 KB: several 62,000-byte streamed chunks in full duplex
    r = stack.chat(system)
    assert r.status == 200
    sent = len(
        json.dumps(
            {
                "model": "m",
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": "hi"}],
            }
        )
    )
    assert r.json()["body_bytes"] == sent


def test_client_destination_header_is_not_honoured(stack: Stack) -> None:
    # A prefix the picker sends to some backend other than be-0 ...
    owner, prefix = next(
        (o, p) for p in (f"forgery test {i}" for i in range(100)) if (o := stack.chat(p).headers["x-backend"]) != "be-0"
    )
    stack.backends.reset()
    # ... sent with a forged destination naming be-0, a real backend that would answer if it were honoured.
    r = stack.chat(prefix, headers={"x-gateway-destination-endpoint": stack.backends.address(0)})
    assert r.status == 200
    assert r.headers["x-backend"] == owner  # the picker's choice, not the client's
    # the picker's ranked list (its pick first) replaces the client's header
    seen = r.headers["x-seen-destination"].split(",")
    assert seen[0] == stack.backends.address(stack.backends.names.index(owner))
    assert stack.backends.address(0) not in seen or seen.index(stack.backends.address(0)) > 0
    assert stack.backends.stats(0)["seen"] == 0  # the forged destination got nothing
    # A forged destination where nothing listens: honoured, it would fail; ignored, it is served.
    r = stack.chat("forgery test", headers={"x-gateway-destination-endpoint": "192.0.2.1:9"})
    assert r.status == 200
    assert "192.0.2.1:9" not in r.headers["x-seen-destination"]


def test_subset_hint_is_honoured(stack: Stack) -> None:
    allowed = stack.backends.address(2)
    for i in range(6):
        r = stack.chat(f"subset prefix {i}", headers={SUBSET_TEST_HEADER: allowed})
        assert r.status == 200
        assert r.headers["x-backend"] == "be-2"


def test_subset_hint_with_nothing_eligible_is_503(stack: Stack) -> None:
    r = stack.chat("subset prefix", headers={SUBSET_TEST_HEADER: "192.0.2.1:9"})
    assert r.status == 503
    assert r.json()["error"]["code"] == "no_healthy_backend"


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (b"{not json", "invalid_json"),
        (b"[1,2]", "invalid_type"),
        (b'{"messages": []}', "missing_model"),
        (b'{"model": 7, "messages": []}', "invalid_type"),
        (b'{"model": "m", "messages": "hello"}', "invalid_type"),
        (b'{"model": "m", "messages": [{"role": "user", "content": 5}]}', "invalid_type"),
        (b'{"model": "m", "messages": [], "stream": "yes"}', "invalid_type"),
    ],
)
def test_bad_bodies_get_400_json(stack: Stack, body: bytes, code: str) -> None:
    r = http("POST", stack.url + "/v1/chat/completions", body)
    assert r.status == 400
    assert r.headers["content-type"].startswith("application/json")
    assert r.json()["error"]["code"] == code
    assert stack.chat("still healthy after bad input").status == 200


def test_oversized_body_is_400(stack: Stack) -> None:
    big = b'{"model": "m", "messages": [{"role": "user", "content": "' + b"x" * (9 << 20) + b'"}]}'
    r = http("POST", stack.url + "/v1/chat/completions", big, timeout=60)
    assert r.status == 400
    assert r.json()["error"]["code"] == "body_too_large"
    assert stack.chat("healthy after oversized").status == 200


def test_bodyless_request_is_routed(stack: Stack) -> None:
    r = http("GET", stack.url + "/v1/models")
    assert r.status == 200
    assert r.json()["name"] in stack.backends.names


def test_anthropic_messages_route_by_system_blocks(stack: Stack) -> None:
    body = {
        "model": "claude-x",
        "max_tokens": 10,
        "system": [{"type": "text", "text": "You are Claude, a careful reviewer."}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "review this"}]}],
    }
    served = {http("POST", stack.url + "/v1/messages", body).headers["x-backend"] for _ in range(5)}
    assert len(served) == 1


def test_aborted_client_releases_in_flight_slot(stack: Stack) -> None:
    for i in range(4):
        stack.backends.control(i, delay_ms=3000)
    body = json.dumps(
        {
            "model": "m",
            "messages": [{"role": "system", "content": "abort me"}, {"role": "user", "content": "x"}],
        }
    ).encode()
    host, port = stack.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
        + f"content-length: {len(body)}\r\n\r\n".encode()
        + body
    )
    wait_until(lambda: any(in_flight(stack).values()), what="the request to become in flight")
    sock.close()  # the client goes away mid-request
    wait_idle(stack)


def test_failing_backend_is_avoided(stack: Stack) -> None:
    prefixes = [f"failover prefix {i}" for i in range(40)]
    owner = {p: stack.chat(p).headers["x-backend"] for p in prefixes}
    victim_prefixes = [p for p in prefixes if owner[p] == "be-1"]
    assert victim_prefixes
    stack.backends.control(1, fail=True)
    statuses = [stack.chat(victim_prefixes[i % len(victim_prefixes)]).status for i in range(6)]
    assert 500 in statuses  # the failures the picker learns from
    later = [stack.chat(p) for p in victim_prefixes]
    assert all(r.status == 200 for r in later)
    assert all(r.headers["x-backend"] != "be-1" for r in later)
    pool = {b["backend"]: b for b in stack.admin("/admin/pool")["backends"]}
    assert pool["be-1"]["healthy"] is False
