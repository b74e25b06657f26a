"""The InferenceObjective watch's own rules, without an API server (requests go to an in-process
``httpx2.MockTransport``): what a list publishes, how events change and coalesce the published priorities, the
bound, malformed objects, and a missing CRD (404) that is logged once, publishes nothing watched and is retried.
The whole run against the fake API server, with the picker, is tests/integration/test_objectives_fake_kube.py."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import httpx2
import orjson
import pytest

from picker.shared.discovery import kubernetes as kube
from picker.shared.discovery.config import InferencePoolRef
from picker.shared.discovery.kube_objectives import MAX_OBJECTIVES, KubernetesObjectiveWatch
from tests.support.poll import async_wait_until

NS = "llm"
POOL = "vllm"
PATH = f"/apis/llm-d.ai/v1alpha2/namespaces/{NS}/inferenceobjectives"

Handler = Callable[[httpx2.Request], httpx2.Response]


def client(handler: Handler) -> httpx2.AsyncClient:
    return httpx2.AsyncClient(transport=httpx2.MockTransport(handler), base_url="https://kube.test/")


def objective(name: str, priority: Any = None, pool: str = POOL, rv: str = "1") -> dict[str, Any]:
    spec: dict[str, Any] = {"poolRef": {"name": pool}}
    if priority is not None:
        spec["priority"] = priority
    return {"metadata": {"name": name, "resourceVersion": rv}, "spec": spec}


class Run:
    """A watch with what it published and counted."""

    def __init__(self, max_objectives: int = MAX_OBJECTIVES, publish: Callable[[dict[str, int]], None] | None = None):
        self.published: list[dict[str, int]] = []
        self.counted: list[str] = []
        ref = InferencePoolRef(name=POOL, namespace=NS, retry_max_seconds=0.1)
        self.watch = KubernetesObjectiveWatch(
            ref, publish or self.published.append, self.counted.append, max_objectives=max_objectives
        )

    async def listed(self, items: list[Any]) -> str:
        body = {"kind": "InferenceObjectiveList", "metadata": {"resourceVersion": "42"}, "items": items}
        async with client(lambda request: httpx2.Response(200, json=body)) as http:
            return await self.watch._list(http)


async def next_turn() -> None:
    """Let the callbacks already scheduled on the loop run."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    loop.call_soon(done.set_result, None)
    await done


async def test_a_list_publishes_the_priorities_of_our_pools_objectives_only() -> None:
    run = Run()
    items = [
        objective("chat", 10),
        objective("batch", -5),
        objective("plain"),  # unset: 0
        objective("theirs", 99, pool="other"),
        {"metadata": {"name": "broken"}, "spec": {"poolRef": {"name": POOL}, "priority": "high"}},
        {"metadata": {}},
    ]
    assert await run.listed(items) == "42"
    assert run.published == [{"chat": 10, "batch": -5, "plain": 0}]
    assert run.counted == ["objectives_malformed", "objectives_malformed", "objectives_list"]
    status = run.watch.status()
    assert status["synced"] is True and status["crd_found"] is True and status["objectives"] == 3
    assert status["malformed"] == 2 and status["counts"] == {"malformed": 2, "list": 1}
    assert status["source"] == f"inferenceobjectives {NS} poolRef={POOL}"


async def test_events_change_the_published_priorities_once_per_loop_turn() -> None:
    run = Run()
    await run.listed([objective("chat", 10), objective("batch", 1)])
    w = run.watch
    w._on_event("MODIFIED", objective("chat", 20), "43")
    w._on_event("ADDED", objective("new"), "44")
    w._on_event("BOOKMARK", {"metadata": {"resourceVersion": "45"}}, "45")
    await next_turn()
    assert run.published[1:] == [{"chat": 20, "batch": 1, "new": 0}]
    w._on_event("MODIFIED", objective("batch", 1, pool="other"), "46")  # moved to another pool: not ours now
    w._on_event("DELETED", objective("new"), "47")
    await next_turn()
    assert run.published[2:] == [{"chat": 20}]
    w._on_event("MODIFIED", objective("chat", 20), "48")  # nothing changed: nothing published
    w._on_event("BOOKMARK", {"metadata": {"resourceVersion": "49"}}, "49")
    await next_turn()
    assert len(run.published) == 3 and w.status()["resource_version"] == "49"
    w._on_event("MODIFIED", objective("chat", "x"), "50")  # malformed: counted, and no longer counts as ours
    await next_turn()
    assert run.published[3:] == [{}] and w.status()["malformed"] == 1
    assert run.published[1] is not run.published[2]  # a new dict at each change


async def test_the_objectives_are_bounded_and_the_ones_past_the_bound_counted() -> None:
    run = Run(max_objectives=2)
    await run.listed([objective("a", 1), objective("b", 2), objective("c", 3)])
    assert run.published == [{"a": 1, "b": 2}] and run.watch.status()["objectives_ignored"] == 1
    run.watch._on_event("ADDED", objective("d", 4), "43")
    run.watch._on_event("MODIFIED", objective("a", 5), "44")  # a known one still changes
    await next_turn()
    assert run.published[1:] == [{"a": 5, "b": 2}]
    assert run.counted.count("objectives_over_limit") == 2


async def test_a_consumer_that_raises_does_not_stop_the_watch(caplog: pytest.LogCaptureFixture) -> None:
    def publish(_: dict[str, int]) -> None:
        raise RuntimeError("consumer bug")

    run = Run(publish=publish)
    with caplog.at_level(logging.ERROR, "kv_epp.discovery"):
        await run.listed([objective("a", 1)])
    assert "event=discovery_publish_failed source='inferenceobjectives" in caplog.text
    run.watch._on_event("ADDED", objective("b", 2), "43")
    await next_turn()
    assert run.watch.status()["objectives"] == 2


async def test_a_missing_crd_is_logged_once_publishes_nothing_watched_and_is_retried(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """404 on the resource three times (the CRD not installed), then it is: listed and watched from then on."""
    lists: list[int] = []
    watches: list[httpx2.Request] = []

    def handler(request: httpx2.Request) -> httpx2.Response:
        assert request.url.path == PATH
        if request.url.params.get("watch") == "1":
            watches.append(request)
            if len(watches) > 1:  # ends at once with nothing: the watch loop backs off (and the test runs)
                return httpx2.Response(200, content=b"")
            event = {"type": "ADDED", "object": objective("late", 7, rv="43")}
            return httpx2.Response(200, content=orjson.dumps(event) + b"\n")
        lists.append(1)
        if len(lists) <= 3:
            status = {"kind": "Status", "code": 404, "message": "the server could not find the requested resource"}
            return httpx2.Response(404, json=status)
        body = {"metadata": {"resourceVersion": "42"}, "items": [objective("chat", 3)]}
        return httpx2.Response(200, json=body)

    run = Run()
    with caplog.at_level(logging.INFO, "kv_epp.discovery"):
        async with client(handler) as http:
            task = asyncio.create_task(run.watch._follow(http))
            try:
                await async_wait_until(lambda: len(lists) >= 3, what="three lists answered 404")
                status = run.watch.status()
                assert status["crd_found"] is False and status["synced"] is False
                assert "is the InferenceObjective CRD installed?" in str(status["last_error"])
                assert run.published == [{}]  # known absent: nothing watched (published once)
                await async_wait_until(lambda: {"chat": 3, "late": 7} in run.published, what="found, then watched")
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
    assert caplog.text.count("event=inferenceobjectives_not_found") == 1
    assert caplog.text.count("event=inferenceobjectives_found") == 1
    assert run.counted.count("objectives_not_found") == 3 and "objectives_error" not in run.counted
    status = run.watch.status()
    assert status["crd_found"] is True and status["synced"] is True and status["last_error"] is None
    assert watches and watches[0].url.params["resourceVersion"] == "42"
    assert watches[0].url.params["allowWatchBookmarks"] == "true"


async def test_another_error_is_a_discovery_error_and_keeps_what_was_published() -> None:
    run = Run()
    await run.listed([objective("chat", 3)])
    run.watch._on_error("inferenceobjectives", kube._ApiError(403, "GET ...: forbidden"))
    status = run.watch.status()
    assert status["last_error"] == f"inferenceobjectives of {run.watch.source}: HTTP 403: GET ...: forbidden"
    assert status["crd_found"] is True and run.published == [{"chat": 3}]
    assert run.counted[-1] == "objectives_error"
