"""The FAKE Kubernetes API server (tests.support.fake_kube) itself, over real HTTP: that it answers as the
discovery tests assume the real one does (lists, watches from a version, selectors, 410, bookmarks, auth, a custom
resource and its CRD uninstalled)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from tests.support.fake_kube import DEFAULT_TOKEN, OBJECTIVES, FakeKubeApiServer
from tests.support.poll import async_wait_until

NS = "ns"
PODS = f"/api/v1/namespaces/{NS}/pods"
POOLS = f"/apis/inference.networking.k8s.io/v1/namespaces/{NS}/inferencepools"
OBJECTIVES_PATH = f"/apis/llm-d.ai/v1alpha2/namespaces/{NS}/inferenceobjectives"
AUTH = {"Authorization": f"Bearer {DEFAULT_TOKEN}"}


@pytest.fixture
async def fake() -> AsyncIterator[FakeKubeApiServer]:
    server = FakeKubeApiServer()
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(headers=AUTH, timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


async def get(http: aiohttp.ClientSession, fake: FakeKubeApiServer, path: str, **query: str) -> tuple[int, Any]:
    async with http.get(fake.url + path, params=query) as resp:
        return resp.status, await resp.json()


async def watch(http: aiohttp.ClientSession, fake: FakeKubeApiServer, path: str, **query: str) -> list[Any]:
    """Every event of a watch stream that ends by itself (timeoutSeconds, an ERROR, close_watches)."""
    async with http.get(fake.url + path, params={"watch": "1", **query}) as resp:
        assert resp.status == 200
        return [json.loads(line) async for line in resp.content if line.strip()]


async def test_lists_select_by_label_and_field_and_page(fake: FakeKubeApiServer, http: aiohttp.ClientSession) -> None:
    fake.put_pod("a", NS, {"app": "x"}, "10.0.0.1", True)
    fake.put_pod("b", NS, {"app": "x"}, None, False)
    fake.put_pod("c", NS, {"app": "y"}, "10.0.0.3", True)
    fake.put_pod("a", "other", {"app": "x"}, "10.0.0.4", True)
    status, body = await get(http, fake, PODS, labelSelector="app=x")
    assert status == 200 and [i["metadata"]["name"] for i in body["items"]] == ["a", "b"]
    assert body["metadata"]["resourceVersion"] == str(fake.resource_version)
    assert body["items"][0]["status"]["podIP"] == "10.0.0.1" and "podIP" not in body["items"][1]["status"]
    _, body = await get(http, fake, PODS, labelSelector="app!=x")
    assert [i["metadata"]["name"] for i in body["items"]] == ["c"]
    _, body = await get(http, fake, PODS, fieldSelector="metadata.name=c")
    assert [i["metadata"]["name"] for i in body["items"]] == ["c"]
    _, page1 = await get(http, fake, PODS, limit="2")
    fake.put_pod("d", NS, {}, None, False)  # a later write does not change the pages of that list
    _, page2 = await get(http, fake, PODS, limit="2", **{"continue": page1["metadata"]["continue"]})
    assert [i["metadata"]["name"] for i in page1["items"] + page2["items"]] == ["a", "b", "c"]
    assert "continue" not in page2["metadata"]


async def test_pool_get_and_404(fake: FakeKubeApiServer, http: aiohttp.ClientSession) -> None:
    fake.put_pool("p", NS, {"app": "x"}, [8000, 8001])
    status, body = await get(http, fake, POOLS + "/p")
    assert status == 200 and body["kind"] == "InferencePool"
    assert body["spec"]["targetPorts"] == [{"number": 8000}, {"number": 8001}]
    assert body["spec"]["selector"]["matchLabels"] == {"app": "x"}
    status, body = await get(http, fake, POOLS + "/q")
    assert status == 404 and body["code"] == 404


async def test_custom_resources_list_watch_and_answer_404_while_uninstalled(
    fake: FakeKubeApiServer, http: aiohttp.ClientSession
) -> None:
    manifest = {
        "metadata": {"name": "chat", "labels": {"team": "a"}},
        "spec": {"poolRef": {"name": "p"}, "priority": 1},
    }
    fake.put_object(OBJECTIVES, NS, manifest)
    fake.put_object(OBJECTIVES, "other", {"metadata": {"name": "elsewhere"}, "spec": {"poolRef": {"name": "p"}}})
    status, body = await get(http, fake, OBJECTIVES_PATH)
    assert status == 200 and body["kind"] == "InferenceObjectiveList" and body["apiVersion"] == "llm-d.ai/v1alpha2"
    (item,) = body["items"]
    assert item["metadata"]["name"] == "chat" and item["spec"] == manifest["spec"]
    assert item["metadata"]["labels"] == {"team": "a"}
    since = body["metadata"]["resourceVersion"]
    fake.put_object(OBJECTIVES, NS, {"metadata": {"name": "chat"}, "spec": {"poolRef": {"name": "p"}, "priority": 2}})
    fake.delete_object(OBJECTIVES, NS, "chat")
    fake.close_watches()
    events = await watch(http, fake, OBJECTIVES_PATH, resourceVersion=since, timeoutSeconds="1")
    assert [(e["type"], e["object"]["kind"], e["object"]["spec"].get("priority")) for e in events] == [
        ("MODIFIED", "InferenceObjective", 2),
        ("DELETED", "InferenceObjective", 2),
    ]
    fake.put_object(OBJECTIVES, NS, manifest)
    fake.uninstall(OBJECTIVES)  # as deleting the CRD: its objects go (DELETED), then 404
    status, body = await get(http, fake, OBJECTIVES_PATH)
    assert status == 404 and body["code"] == 404
    async with http.get(fake.url + OBJECTIVES_PATH, params={"watch": "1"}) as resp:
        assert resp.status == 404
    fake.install(OBJECTIVES)
    status, body = await get(http, fake, OBJECTIVES_PATH)
    assert status == 200 and body["items"] == []
    with pytest.raises(ValueError, match="not a custom resource"):
        fake.put_object("pods", NS, manifest)


async def test_a_watch_replays_from_its_version_and_translates_selector_moves(
    fake: FakeKubeApiServer, http: aiohttp.ClientSession
) -> None:
    fake.put_pod("a", NS, {"app": "x"}, "10.0.0.1", True)
    since = str(fake.resource_version)
    fake.set_ready("a", NS, False)
    fake.put_pod("a", NS, {"app": "gone"}, "10.0.0.1", False)  # leaves the selector
    fake.put_pod("b", NS, {"app": "y"}, "10.0.0.2", True)
    fake.put_pod("b", NS, {"app": "x"}, "10.0.0.2", True)  # enters it
    fake.delete_pod("b", NS)
    fake.close_watches()  # nothing open yet: the watch below ends by its timeout
    events = await watch(http, fake, PODS, labelSelector="app=x", resourceVersion=since, timeoutSeconds="1")
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [
        ("MODIFIED", "a"),
        ("DELETED", "a"),
        ("ADDED", "b"),
        ("DELETED", "b"),
    ]
    versions = [int(e["object"]["metadata"]["resourceVersion"]) for e in events]
    assert versions == sorted(versions) and versions[-1] == fake.resource_version


async def test_a_watch_without_a_version_starts_with_the_current_objects(
    fake: FakeKubeApiServer, http: aiohttp.ClientSession
) -> None:
    fake.put_pod("a", NS, {}, "10.0.0.1", True)
    events = await watch(http, fake, PODS, timeoutSeconds="1")
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("ADDED", "a")]


async def test_compaction_gone_and_bookmarks(fake: FakeKubeApiServer, http: aiohttp.ClientSession) -> None:
    fake.put_pod("a", NS, {}, "10.0.0.1", True)
    old = str(fake.resource_version)
    fake.put_pod("a", NS, {}, "10.0.0.2", True)
    fake.expire_watches()
    events = await watch(http, fake, PODS, resourceVersion=old)
    assert [(e["type"], e["object"]["code"]) for e in events] == [("ERROR", 410)]
    status, body = await get(http, fake, PODS, resourceVersion=old)
    assert status == 410 and body["reason"] == "Expired"
    fake.watch_gone_as_http = True
    async with http.get(fake.url + PODS, params={"watch": "1", "resourceVersion": old}) as resp:
        assert resp.status == 410
    # a watch from the current version is fine, and gets bookmarks only if it asked for them
    now = str(fake.resource_version)
    async with (
        http.get(fake.url + PODS, params={"watch": "1", "resourceVersion": now, "allowWatchBookmarks": "true"}) as resp,
        http.get(fake.url + PODS, params={"watch": "1", "resourceVersion": now}) as plain,
    ):
        await async_wait_until(lambda: fake.open_watches() == 2, what="both watches open")
        fake.bump(3)
        fake.bookmark()
        fake.close_watches()
        lines = [json.loads(line) async for line in resp.content if line.strip()]
        assert [line async for line in plain.content if line.strip()] == []
    assert lines == [
        {
            "type": "BOOKMARK",
            "object": {"kind": "Pod", "apiVersion": "v1", "metadata": {"resourceVersion": str(fake.resource_version)}},
        }
    ]


async def test_auth_outage_and_the_request_record(fake: FakeKubeApiServer, http: aiohttp.ClientSession) -> None:
    async with aiohttp.ClientSession() as anonymous, anonymous.get(fake.url + PODS) as resp:
        assert resp.status == 401
    fake.fail_requests(2)
    assert [(await get(http, fake, PODS))[0] for _ in range(3)] == [503, 503, 200]
    fake.fail_requests(True)
    assert (await get(http, fake, PODS, labelSelector="a=b"))[0] == 503
    fake.fail_requests(False)
    assert (await get(http, fake, PODS))[0] == 200
    assert fake.requests[-2] == ("GET", PODS, {"labelSelector": "a=b"})
