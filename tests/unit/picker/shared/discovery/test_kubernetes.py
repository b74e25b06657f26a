"""The InferencePool watcher's own rules, without an API server: how a watch stream's lines become events (and
which lines are errors, 410 Gone or a stall), what an error answer is reported as, how a list with malformed pods
is published, how pod events coalesce into publications, and the backoffs. Requests go to an in-process
``httpx2.MockTransport``; the whole run (lists, watches, resyncs, outages) is tested against the fake API server in
tests/integration/test_discovery_kube.py."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator, Callable
from types import SimpleNamespace
from typing import Any

import httpx2
import orjson
import pytest

from picker.shared.discovery import kubernetes as kube
from picker.shared.discovery.config import InferencePoolRef
from picker.shared.discovery.kube_objects import parse_pool_spec
from picker.shared.discovery.kubernetes import KubernetesPoolDiscovery
from picker.shared.discovery.model import PoolSnapshot

NS = "llm"
PODS = f"api/v1/namespaces/{NS}/pods"
SPEC = parse_pool_spec({"spec": {"selector": {"matchLabels": {"app": "vllm"}}, "targetPorts": [{"number": 8000}]}})
READY = [{"type": "Ready", "status": "True"}]

Handler = Callable[[httpx2.Request], httpx2.Response]


def client(handler: Handler) -> httpx2.AsyncClient:
    return httpx2.AsyncClient(transport=httpx2.MockTransport(handler), base_url="https://kube.test/")


def discovery(counted: list[str] | None = None, **ref: Any) -> KubernetesPoolDiscovery:
    return KubernetesPoolDiscovery(
        InferencePoolRef(name="pool", namespace=NS, **ref), counted.append if counted is not None else None
    )


def pod(name: str, ip: str | None = "10.0.0.1", ready: bool = True, **meta: Any) -> dict[str, Any]:
    status: dict[str, Any] = {"conditions": READY if ready else []}
    if ip is not None:
        status["podIP"] = ip
    return {"metadata": {"name": name, "resourceVersion": "1", **meta}, "status": status}


def line(etype: str, obj: dict[str, Any]) -> bytes:
    return orjson.dumps({"type": etype, "object": obj}) + b"\n"


async def chunks(*parts: bytes) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


async def watch(d: KubernetesPoolDiscovery, handler: Handler, rv: str = "5") -> list[tuple[str, dict[str, Any]]]:
    params = {"labelSelector": SPEC.label_selector, "allowWatchBookmarks": "true", "timeoutSeconds": "300"}
    async with client(handler) as http:
        return [event async for event in d._watch(http, PODS, params, rv)]


async def next_turn() -> None:
    """Let the callbacks already scheduled on the loop run (they run in order, before this one)."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    loop.call_soon(done.set_result, None)
    await done


# -- the watch stream ------------------------------------------------------------------------------------------


async def test_a_watch_yields_one_event_per_line_however_the_lines_are_cut_into_chunks() -> None:
    seen: list[httpx2.Request] = []
    a, b, mark = pod("a"), pod("b"), {"metadata": {"resourceVersion": "9"}}
    body = line("ADDED", a) + b"\n" + line("MODIFIED", b) + line("BOOKMARK", mark).rstrip(b"\n")  # no final newline

    def handler(request: httpx2.Request) -> httpx2.Response:
        seen.append(request)
        return httpx2.Response(200, content=chunks(body[:7], body[7:60], body[60:61], body[61:]))

    counted: list[str] = []
    events = await watch(discovery(counted), handler, rv="5")
    assert events == [("ADDED", a), ("MODIFIED", b), ("BOOKMARK", mark)]
    (request,) = seen
    query = dict(request.url.params)
    assert query["watch"] == "1" and query["resourceVersion"] == "5" and query["allowWatchBookmarks"] == "true"
    assert query["labelSelector"] == "app=vllm" and counted == ["watch"]


@pytest.mark.parametrize(
    ("raw", "error", "says"),
    [
        (b'{"type": "ERROR", "object": {"code": 410, "message": "too old resource version: 5 (9)"}}', kube._Gone,
         "too old resource version"),
        (b'{"type": "ERROR", "object": {"code": 500, "reason": "InternalError"}}', kube._ApiError,
         "HTTP 500: watch ERROR event: InternalError"),
        (b'{"type": "SYNC", "object": {}}', kube._ApiError, "unknown watch event type 'SYNC'"),
        (b'{"type": "ADDED"}', kube._ApiError, "a watch event without an object"),
        (b'{"type": "ADDED", "object": [1]}', kube._ApiError, "a watch event without an object"),
        (b"[1, 2]", kube._ApiError, "a watch event without an object"),
        (b"{not json", ValueError, ""),
    ],
)  # fmt: skip
def test_a_watch_line_that_is_no_usable_event_is_an_error_and_410_is_gone(
    raw: bytes, error: type[Exception], says: str
) -> None:
    with pytest.raises(error, match=re.escape(says) if says else None):
        kube._decode_event(raw)


async def test_a_410_answer_to_a_watch_is_gone_with_the_status_message() -> None:
    status = {"kind": "Status", "code": 410, "reason": "Expired", "message": "too old resource version: 1 (7)"}
    with pytest.raises(kube._Gone, match=re.escape("too old resource version: 1 (7)")):
        await watch(discovery(), lambda request: httpx2.Response(410, json=status))


@pytest.mark.parametrize(
    ("answer", "says"),
    [
        (httpx2.Response(403, json={"kind": "Status", "message": 'pods is forbidden: User "x" cannot watch'}),
         f'HTTP 403: GET /{PODS}: pods is forbidden: User "x" cannot watch'),
        (httpx2.Response(503, text="  upstream connect error\n"), f"HTTP 503: GET /{PODS}: upstream connect error"),
        (httpx2.Response(500, text="x" * 2000), f"HTTP 500: GET /{PODS}: {'x' * 500}"),  # the first 500 characters
    ],
)  # fmt: skip
async def test_another_error_answer_is_reported_with_its_code_request_and_message(
    answer: httpx2.Response, says: str
) -> None:
    with pytest.raises(kube._ApiError) as exc:
        await watch(discovery(), lambda request: answer)
    assert str(exc.value) == says and exc.value.code == answer.status_code
    assert kube._describe(exc.value) == says  # reported as is in last_error


async def test_a_watch_that_times_out_reading_is_stalled() -> None:
    async def silent() -> AsyncIterator[bytes]:
        yield line("ADDED", pod("a"))
        raise httpx2.ReadTimeout("read timed out")

    events: list[tuple[str, dict[str, Any]]] = []
    d = discovery(watch_idle_timeout_seconds=75.0)
    with pytest.raises(kube._Stalled, match=re.escape(f"GET {PODS}: nothing for 75 s")):
        async with client(lambda request: httpx2.Response(200, content=silent())) as http:
            async for event in d._watch(http, PODS, {}, "1"):
                events.append(event)
    assert [etype for etype, _ in events] == ["ADDED"]  # what came before the silence was delivered


async def test_a_watch_event_over_the_bound_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kube, "MAX_EVENT_BYTES", 64)
    huge = line("ADDED", pod("a", meta_pad="x" * 200))
    with pytest.raises(kube._ApiError, match="a watch event over 64 bytes"):
        await watch(discovery(), lambda request: httpx2.Response(200, content=chunks(huge[:100], huge[100:])))


@pytest.mark.parametrize(("idle", "timeout", "read"), [(150.0, 300, 150.0), (600.0, 30, 90.0), (0.5, 1, 0.5)])
def test_a_watch_may_be_silent_for_the_idle_timeout_at_most_the_server_timeout_plus_a_grace(
    idle: float, timeout: int, read: float
) -> None:
    d = discovery(watch_idle_timeout_seconds=idle, watch_timeout_seconds=timeout)
    assert d.watch_read_timeout == read


# -- lists and publication -------------------------------------------------------------------------------------


async def listed(d: KubernetesPoolDiscovery, items: list[Any], snapshots: list[PoolSnapshot]) -> str:
    d._publish = snapshots.append  # what run() sets
    body = {"kind": "PodList", "metadata": {"resourceVersion": "42"}, "items": items}
    async with client(lambda request: httpx2.Response(200, json=body)) as http:
        return await d._list_pods(http, SPEC)


async def test_malformed_pods_in_a_list_are_counted_and_skipped_and_the_rest_is_published() -> None:
    counted: list[str] = []
    snapshots: list[PoolSnapshot] = []
    d = discovery(counted)
    items = [pod("b"), {"metadata": {"name": "../evil"}}, pod("a", ip="fd00::1", ready=False), pod("c", ip="x")]
    rv = await listed(d, items, snapshots)
    assert rv == "42" and d.synced
    (snapshot,) = snapshots
    assert [(b.name, b.address, b.ready, b.namespace) for b in snapshot.backends] == [
        ("a", "[fd00::1]:8000", False, NS),
        ("b", "10.0.0.1:8000", True, NS),
    ]
    assert snapshot.version == "42" and snapshot.source == f"inference_pool {NS}/pool"
    status = d.status()
    assert counted == ["error", "list"] and status["counts"] == {"error": 1, "list": 1}  # ../evil: counted, skipped
    assert (status["pods"], status["published_pods"], status["live_pods"]) == (3, 2, 1)  # c: no usable IP


async def test_pod_events_of_one_loop_turn_are_one_publication() -> None:
    snapshots: list[PoolSnapshot] = []
    d = discovery()
    await listed(d, [pod("a"), pod("b")], snapshots)
    d._apply_pod_event("MODIFIED", pod("a", ready=False))
    d._apply_pod_event("ADDED", pod("c", ip="10.0.0.3"))
    d._apply_pod_event("DELETED", pod("b"))
    assert len(snapshots) == 1  # nothing yet: published on the next loop turn
    await next_turn()
    assert len(snapshots) == 2
    assert [(b.name, b.ready) for b in snapshots[-1].backends] == [("a", False), ("c", True)]


async def test_events_that_change_no_published_backend_publish_nothing() -> None:
    snapshots: list[PoolSnapshot] = []
    d = discovery()
    await listed(d, [pod("a"), pod("pending", ip=None)], snapshots)
    d._apply_pod_event("MODIFIED", pod("a", resourceVersion="7"))  # same IP, readiness and annotations
    d._apply_pod_event("MODIFIED", pod("pending", ip=None, labels={"x": "y"}))  # still no IP
    d._apply_pod_event("DELETED", pod("pending", ip=None))  # was never published
    d._apply_pod_event("DELETED", pod("unknown"))
    await next_turn()
    assert len(snapshots) == 1 and d.status()["pods"] == 1


async def test_a_watched_pod_without_a_usable_name_is_counted_reported_and_ignored() -> None:
    counted: list[str] = []
    snapshots: list[PoolSnapshot] = []
    d = discovery(counted)
    await listed(d, [pod("a")], snapshots)
    d._apply_pod_event("ADDED", pod("-bad", ip="10.0.0.9"))
    await next_turn()
    assert len(snapshots) == 1 and d.status()["pods"] == 1
    assert counted[-1] == "error" and "'-bad' is not a usable backend name" in str(d.status()["last_error"])


async def test_a_consumer_that_raises_does_not_stop_the_publications(caplog: pytest.LogCaptureFixture) -> None:
    got: list[PoolSnapshot] = []

    def publish(snapshot: PoolSnapshot) -> None:
        got.append(snapshot)
        raise RuntimeError("consumer bug")

    d = discovery()
    d._publish = publish
    body = {"metadata": {"resourceVersion": "1"}, "items": [pod("a")]}
    with caplog.at_level(logging.ERROR, logger="kv_epp.discovery"):
        async with client(lambda request: httpx2.Response(200, json=body)) as http:
            await d._list_pods(http, SPEC)
        d._apply_pod_event("ADDED", pod("b", ip="10.0.0.2"))
        await next_turn()
    assert [s.names() for s in got] == [("a",), ("a", "b")]
    assert "event=discovery_publish_failed" in caplog.text


async def test_a_list_answer_that_is_not_a_json_object_or_too_large_is_an_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    d = discovery()
    async with client(lambda request: httpx2.Response(200, json=[1, 2])) as http:
        with pytest.raises(kube._ApiError, match=re.escape(f"GET {PODS}: the answer is not a JSON object")):
            await d._list_pods(http, SPEC)
    monkeypatch.setattr(kube, "MAX_BODY_BYTES", 100)
    big = {"metadata": {"resourceVersion": "1"}, "items": [pod(f"p{i}") for i in range(5)]}
    async with client(lambda request: httpx2.Response(200, content=chunks(orjson.dumps(big)))) as http:
        with pytest.raises(kube._ApiError, match="the answer is over 100 bytes"):
            await d._list_pods(http, SPEC)
    assert not d.synced


def test_the_status_before_anything_was_read() -> None:
    d = KubernetesPoolDiscovery(InferencePoolRef(name="pool"))  # namespace: found with the credentials
    status = d.status()
    assert status["source"] == "inference_pool ?/pool" and status["synced"] is False
    assert (status["pool"], status["pool_found"], status["backends"], status["counts"]) == (None, None, 0, {})


# -- backoffs --------------------------------------------------------------------------------------------------


@pytest.fixture
def slept(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The delays the module's backoffs wait (recorded, not waited), jitter at its upper end."""
    delays: list[float] = []

    async def sleep(delay: float) -> None:
        delays.append(delay)

    monkeypatch.setattr(kube, "asyncio", SimpleNamespace(sleep=sleep))
    monkeypatch.setattr(kube, "random", SimpleNamespace(uniform=lambda low, high: high))
    return delays


async def test_the_backoff_doubles_from_a_tenth_of_a_second_to_its_cap_and_starts_over_after_a_reset(
    slept: list[float],
) -> None:
    backoff = kube._Backoff(cap=1.0)
    for _ in range(6):
        await backoff.sleep()
    assert slept == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0])
    backoff.reset()
    await backoff.sleep()
    assert slept[-1] == pytest.approx(0.1)
    tiny = kube._Backoff(cap=0.05)  # a cap below the first delay bounds it too
    await tiny.sleep()
    assert slept[-1] == pytest.approx(0.05)


async def test_the_backoffs_jitter_waits_between_half_and_all_of_the_delay(monkeypatch: pytest.MonkeyPatch) -> None:
    bounds: list[tuple[float, float]] = []
    delays: list[float] = []

    async def sleep(delay: float) -> None:
        delays.append(delay)

    def lowest(lo: float, hi: float) -> float:
        bounds.append((lo, hi))
        return lo

    monkeypatch.setattr(kube, "asyncio", SimpleNamespace(sleep=sleep))
    monkeypatch.setattr(kube, "random", SimpleNamespace(uniform=lowest))
    await kube._Backoff(cap=10.0).sleep()
    assert bounds == [(0.5, 1.0)] and delays == pytest.approx([0.05])


async def test_a_run_of_410s_relists_at_once_first_then_after_the_backoff_until_a_watch_delivers(
    slept: list[float],
) -> None:
    counted: list[str] = []
    streak = kube._GoneStreak(cap=10.0, count=counted.append)
    await streak.wait()  # the first list
    streak.note()
    await streak.wait()  # the first 410: at once
    assert slept == [] and counted == []
    streak.note()
    await streak.wait()  # the second in a row: backed off
    streak.note()
    await streak.wait()
    assert slept == pytest.approx([0.1, 0.2]) and counted == ["resync_backoff", "resync_backoff"]
    streak.reset()  # a watch delivered an event or a bookmark
    streak.note()
    await streak.wait()
    streak.note()
    await streak.wait()
    assert slept == pytest.approx([0.1, 0.2, 0.1])  # the backoff started over


def test_an_unexpected_error_is_described_by_its_type_and_text() -> None:
    assert kube._describe(ConnectionResetError("peer reset")) == "ConnectionResetError: peer reset"
    assert kube._describe(TimeoutError()) == "TimeoutError"
