"""InferencePool discovery (picker.shared.discovery.kubernetes) against a FAKE Kubernetes API server
(tests.support.fake_kube.FakeKubeApiServer: real HTTP on loopback, list + watch, resourceVersion, 410 Gone,
bookmarks, stalled watches, 410 storms). Each change is waited for by polling the published snapshots with a
deadline."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from picker.shared.discovery import PoolSnapshot, kube_access
from picker.shared.discovery import kubernetes as kube
from picker.shared.discovery.config import InferencePoolRef
from picker.shared.discovery.kubernetes import KubernetesPoolDiscovery
from tests.support.fake_kube import FakeKubeApiServer, running_fake_kube
from tests.support.poll import async_wait_until, wait_until

NS = "llm"
POOL = "pool"
APP = {"app": "vllm"}
DEADLINE = 10.0  # generous for a busy machine; a change normally lands within milliseconds
PODS_PATH = f"/api/v1/namespaces/{NS}/pods"


@pytest.fixture
async def fake() -> AsyncIterator[FakeKubeApiServer]:
    server = FakeKubeApiServer()
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@pytest.fixture
def kubeconfig(fake: FakeKubeApiServer, tmp_path: Path) -> Path:
    return fake.write_kubeconfig(tmp_path / "kubeconfig", namespace=NS)


class Run:
    """A discovery running as a task, with every snapshot it published."""

    def __init__(self, discovery: KubernetesPoolDiscovery) -> None:
        self.discovery = discovery
        self.snapshots: list[PoolSnapshot] = []
        self.counted: list[str] = []

    @property
    def last(self) -> PoolSnapshot:
        assert self.snapshots, "nothing published"
        return self.snapshots[-1]

    async def names(self, *expected: str, what: str = "", ready: tuple[str, ...] | None = None) -> PoolSnapshot:
        """Wait until the last published snapshot holds exactly these backend names and, of them, exactly the
        ``ready`` ones ready (None: all of them)."""
        want = tuple(sorted(expected))
        want_ready = want if ready is None else tuple(sorted(ready))

        def holds() -> bool:
            last = self.snapshots[-1] if self.snapshots else None
            return last is not None and last.names() == want and last.ready_names() == want_ready

        await async_wait_until(
            holds,
            timeout=DEADLINE,
            what=what or f"snapshot {want} ready {want_ready} (last: {self.last.backends if self.snapshots else None})",
        )
        return self.last

    async def counts(self, name: str, at_least: int) -> None:
        await async_wait_until(
            lambda: self.discovery.status()["counts"].get(name, 0) >= at_least,  # type: ignore[attr-defined]
            timeout=DEADLINE,
            what=f"count {name} >= {at_least} (counts: {self.discovery.status()['counts']})",
        )


@contextlib.asynccontextmanager
async def running(kubeconfig: Path, **ref: Any) -> AsyncIterator[Run]:
    settings: dict[str, Any] = {"name": POOL, "kubeconfig": str(kubeconfig), "retry_max_seconds": 0.3} | ref
    run: Run
    discovery = KubernetesPoolDiscovery(InferencePoolRef(**settings), count=lambda name: run.counted.append(name))
    run = Run(discovery)
    task = asyncio.create_task(discovery.run(run.snapshots.append))
    try:
        yield run
        assert not task.done(), "run() ended by itself"
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def pod(fake: FakeKubeApiServer, name: str, ip: str | None, ready: bool = True, **kw: Any) -> None:
    labels = kw.pop("labels", APP)
    fake.put_pod(name, NS, labels, ip, ready, **kw)


async def watching(fake: FakeKubeApiServer) -> None:
    """Wait until the pool's and the pods' watches are open (a publication comes before the watch starts)."""
    await async_wait_until(
        lambda: fake.open_watches("pods") >= 1 and fake.open_watches("inferencepools") >= 1,
        timeout=DEADLINE,
        what="the pool and pods watches open",
    )


def requests_for(fake: FakeKubeApiServer, path: str, *, watch: bool) -> list[dict[str, str]]:
    return [q for m, p, q in fake.requests if p == path and ("watch" in q) == watch]


async def test_initial_sync_publishes_the_pods_with_an_ip_and_their_readiness(
    fake: FakeKubeApiServer, kubeconfig: Path
) -> None:
    fake.put_pool(POOL, NS, APP, [8000])
    pod(fake, "ready-a", "10.1.0.1", annotations={"z": "1", "a": "2"})
    pod(fake, "ready-b", "fd00::2")
    pod(fake, "unready", "10.1.0.3", ready=False)
    pod(fake, "no-ip", None)
    pod(fake, "terminating", "10.1.0.5")
    fake.start_terminating("terminating", NS)
    pod(fake, "other-app", "10.1.0.6", labels={"app": "other"})
    fake.put_pod("other-ns", "elsewhere", APP, "10.1.0.7", True)

    async with running(kubeconfig) as run:
        # the unready pod is published (not ready): readiness gates routing only; no IP or terminating: not at all
        snap = await run.names("ready-a", "ready-b", "unready", ready=("ready-a", "ready-b"))
        await watching(fake)
        assert run.discovery.synced
        a, b, u = snap.backends
        assert (a.ip, a.port, a.rank, a.pod, a.namespace, a.ready) == ("10.1.0.1", 8000, 0, "ready-a", NS, True)
        assert a.annotations == (("a", "2"), ("z", "1"))
        assert b.address == "[fd00::2]:8000"
        assert (u.address, u.ready) == ("10.1.0.3:8000", False)
        assert snap.source == f"inference_pool {NS}/{POOL}"
        assert snap.version == str(fake.resource_version)
        status = run.discovery.status()
        assert status["synced"] is True and status["backends"] == 3 and status["pods"] == 5
        assert status["published_pods"] == 3 and status["live_pods"] == 2
        assert status["source"] == f"inference_pool {NS}/{POOL}" and status["last_error"] is None
        assert len(run.snapshots) == 1, "one publication for the initial sync"
        assert "list" in run.counted
        watch = requests_for(fake, PODS_PATH, watch=True)[0]
        assert watch["allowWatchBookmarks"] == "true" and watch["labelSelector"] == "app=vllm"
        assert watch["timeoutSeconds"] == "300"


async def test_pods_added_unready_deleted_and_rescheduled(fake: FakeKubeApiServer, kubeconfig: Path) -> None:
    fake.put_pool(POOL, NS, APP, [8000])
    pod(fake, "a", "10.1.0.1")
    async with running(kubeconfig) as run:
        await run.names("a")
        pod(fake, "b", "10.1.0.2")
        await run.names("a", "b", what="pod b added")
        published = len(run.snapshots)
        fake.set_ready("a", NS, False)  # a change of the ready flag alone is published
        await run.names("a", "b", ready=("b",), what="pod a made unready: still published, not ready")
        assert len(run.snapshots) == published + 1
        fake.set_ready("a", NS, True)
        await run.names("a", "b", what="pod a ready again")
        fake.delete_pod("b", NS)
        await run.names("a", what="pod b deleted")
        # rescheduled: the old pod goes, a new one (new name, new IP) comes up, first unready
        fake.delete_pod("a", NS)
        pod(fake, "a2", "10.1.0.9", ready=False)
        await run.names("a2", ready=(), what="a deleted, its replacement not ready yet")
        fake.set_ready("a2", NS, True)
        snap = await run.names("a2", what="the replacement ready")
        assert snap.backends[0].address == "10.1.0.9:8000"
        # a pod leaving the selector (labels changed) leaves the pool
        pod(fake, "a2", "10.1.0.9", labels={"app": "drained"})
        await run.names(what="a2 relabelled out of the selector")
        assert run.discovery.status()["pods"] == 0
        # graceful deletion: deletionTimestamp set, the pod still exists
        pod(fake, "c", "10.1.0.3")
        await run.names("c")
        fake.start_terminating("c", NS)
        await run.names(what="c terminating")
        # an ended pod (evicted: phase Failed; or Succeeded) keeps its podIP, which another pod may reuse: gone
        pod(fake, "d", "10.1.0.4")
        pod(fake, "e", "10.1.0.5")
        await run.names("d", "e")
        fake.set_phase("d", NS, "Failed")
        await run.names("e", what="d evicted")
        fake.set_phase("e", NS, "Succeeded")
        await run.names(what="e succeeded")


async def test_a_pod_moved_to_a_new_ip_and_new_annotations_is_republished(
    fake: FakeKubeApiServer, kubeconfig: Path
) -> None:
    fake.put_pool(POOL, NS, APP, [8000])
    pod(fake, "a", "10.1.0.1")
    async with running(kubeconfig) as run:
        await run.names("a")
        pod(fake, "a", "10.1.0.2")
        await async_wait_until(lambda: run.last.backends[0].ip == "10.1.0.2", timeout=DEADLINE, what="new IP")
        pod(fake, "a", "10.1.0.2", annotations={"kv-epp/events": "tcp://10.1.0.2:5557"})
        await async_wait_until(
            lambda: run.last.backends[0].annotation("kv-epp/events") == "tcp://10.1.0.2:5557",
            timeout=DEADLINE,
            what="annotation published",
        )


async def test_events_that_do_not_change_the_live_set_publish_nothing(
    fake: FakeKubeApiServer, kubeconfig: Path
) -> None:
    fake.put_pool(POOL, NS, APP, [8000])
    pod(fake, "a", "10.1.0.1")
    pod(fake, "pending", None)
    async with running(kubeconfig) as run:
        await run.names("a")
        published = len(run.snapshots)
        events = run.discovery.status()["counts"].get("watch_event", 0)  # type: ignore[attr-defined]
        pod(fake, "a", "10.1.0.1")  # MODIFIED, same content
        pod(fake, "pending", None, annotations={"x": "y"})  # a pod that is not published changed
        fake.set_ready("pending", NS, True)  # Ready without an IP is not published
        await run.counts("watch_event", events + 3)
        pod(fake, "b", "10.1.0.2")
        await run.names("a", "b")
        assert len(run.snapshots) == published + 1, [s.names() for s in run.snapshots]


async def test_410_gone_relists_and_catches_a_change_made_while_expired(
    fake: FakeKubeApiServer, kubeconfig: Path
) -> None:
    fake.put_pool(POOL, NS, APP, [8000])
    pod(fake, "a", "10.1.0.1")
    pod(fake, "b", "10.1.0.2")
    async with running(kubeconfig) as run:
        await run.names("a", "b")
        await watching(fake)
        lists = len(requests_for(fake, PODS_PATH, watch=False))
        fake.expire_watches()
        fake.delete_pod("a", NS)  # made while the watches are expired
        pod(fake, "c", "10.1.0.3")
        await run.names("b", "c")
        await run.counts("gone", 1)
        await run.counts("resync", 1)
        assert len(requests_for(fake, PODS_PATH, watch=False)) > lists, "the pods were listed again"
        pod(fake, "d", "10.1.0.4")  # the renewed watch works
        await run.names("b", "c", "d")


async def test_410_as_an_http_status_on_a_renewed_watch_relists(fake: FakeKubeApiServer, kubeconfig: Path) -> None:
    fake.put_pool(POOL, NS, APP, [8000])
    pod(fake, "a", "10.1.0.1")
    async with running(kubeconfig) as run:
        await run.names("a")
        await watching(fake)
        fake.watch_gone_as_http = True
        gone = run.discovery.status()["counts"].get("gone", 0)  # type: ignore[attr-defined]
        fake.drop_watches()  # the watches reconnect from their last version ...
        pod(fake, "b", "10.1.0.2")  # ... which is older than this change ...
        fake.expire_watches()  # ... compacted away: the renewed watch is answered 410
        await run.names("a", "b")
        await run.counts("gone", gone + 1)
        assert any(m == "GET" and p == PODS_PATH and "watch" in q for m, p, q in fake.requests)


async def test_bookmarks_advance_the_resource_version_of_the_next_watch(
    fake: FakeKubeApiServer, kubeconfig: Path
) -> None:
    fake.put_pool(POOL, NS, APP, [8000])
    pod(fake, "a", "10.1.0.1")
    async with running(kubeconfig) as run:
        await run.names("a")
        await watching(fake)
        listed_at = run.discovery.status()["resource_version"]
        fake.bump(7)  # writes elsewhere in the cluster: no event for this watch
        fake.put_pod("x", "elsewhere", APP, "10.9.9.9", True)
        current = str(fake.resource_version)
        assert current != listed_at
        fake.bookmark()
        await async_wait_until(
            lambda: run.discovery.status()["resource_version"] == current, timeout=DEADLINE, what="bookmark applied"
        )
        await run.counts("bookmark", 1)
        lists = len(requests_for(fake, PODS_PATH, watch=False))
        fake.close_watches()  # as timeoutSeconds would: the watch is renewed from the bookmark's version
        await async_wait_until(
            lambda: any(q.get("resourceVersion") == current for q in requests_for(fake, PODS_PATH, watch=True)),
            timeout=DEADLINE,
            what=f"a pods watch from resourceVersion {current}",
        )
        assert len(requests_for(fake, PODS_PATH, watch=False)) == lists, "a clean end is renewed, not relisted"
        assert len(run.snapshots) == 1
        pod(fake, "b", "10.1.0.2")
        await run.names("a", "b")


async def test_pool_target_ports_and_selector_changes(fake: FakeKubeApiServer, kubeconfig: Path) -> None:
    fake.put_pool(POOL, NS, APP, [8000])
    pod(fake, "a", "10.1.0.1")
    pod(fake, "s", "10.1.0.5", labels={"app": "sglang"})
    async with running(kubeconfig) as run:
        await run.names("a")
        fake.put_pool(POOL, NS, APP, [8000, 8001])  # two data-parallel ranks per pod
        snap = await run.names("a.rank0", "a.rank1")
        assert [(b.port, b.rank, b.pod) for b in snap.backends] == [(8000, 0, "a"), (8001, 1, "a")]
        fake.put_pool(POOL, NS, {"app": "sglang"}, [30000])
        snap = await run.names("s")
        assert snap.backends[0].address == "10.1.0.5:30000"
        assert run.discovery.status()["pool"] == {"match_labels": {"app": "sglang"}, "target_ports": [30000]}
        pod(fake, "a", "10.1.0.1", annotations={"v": "2"})  # the old selector's pods no longer matter
        pod(fake, "s2", "10.1.0.6", labels={"app": "sglang"})
        await run.names("s", "s2")


async def test_pool_missing_at_start_then_created_then_deleted(fake: FakeKubeApiServer, kubeconfig: Path) -> None:
    pod(fake, "a", "10.1.0.1")
    async with running(kubeconfig) as run:
        await async_wait_until(
            lambda: run.discovery.status()["last_error"] == f"inferencepool {NS}/{POOL} not found",
            timeout=DEADLINE,
            what="pool not found",
        )
        assert not run.discovery.synced and run.snapshots == []
        fake.put_pool(POOL, NS, APP, [8000])
        await run.names("a", what="the pool created while watched")
        assert run.discovery.synced and run.discovery.status()["last_error"] is None
        fake.delete_pool(POOL, NS)
        await run.names(what="the pool deleted while watched: an empty snapshot")
        assert run.discovery.status()["last_error"] == f"inferencepool {NS}/{POOL} not found"
        assert run.discovery.synced
        fake.put_pool(POOL, NS, APP, [8000])
        await run.names("a", what="the pool back")


async def test_an_outage_keeps_the_last_snapshot_and_recovers(fake: FakeKubeApiServer, kubeconfig: Path) -> None:
    fake.put_pool(POOL, NS, APP, [8000])
    pod(fake, "a", "10.1.0.1")
    pod(fake, "b", "10.1.0.2")
    async with running(kubeconfig) as run:
        await run.names("a", "b")
        await watching(fake)
        published = len(run.snapshots)
        fake.fail_requests(True)
        fake.drop_watches()
        errors = run.discovery.status()["counts"].get("error", 0)  # type: ignore[attr-defined]
        await run.counts("error", errors + 4)  # several retries failed
        status = run.discovery.status()
        assert "503" in str(status["last_error"]), status
        assert len(run.snapshots) == published and run.last.names() == ("a", "b"), "nothing published meanwhile"
        fake.delete_pod("a", NS)  # a change during the outage
        fake.fail_requests(False)
        await run.names("b", what="recovered, with the change made during the outage")
        await async_wait_until(lambda: run.discovery.status()["last_error"] is None, timeout=DEADLINE)


async def test_an_unreachable_api_server_keeps_the_snapshot(tmp_path: Path) -> None:
    server = FakeKubeApiServer()
    await server.start()
    kubeconfig = server.write_kubeconfig(tmp_path / "kubeconfig", namespace=NS)
    server.put_pool(POOL, NS, APP, [8000])
    pod(server, "a", "10.1.0.1")
    try:
        async with running(kubeconfig) as run:
            await run.names("a")
            await server.stop()  # connection refused from now on
            errors = run.discovery.status()["counts"].get("error", 0)  # type: ignore[attr-defined]
            await run.counts("error", errors + 3)
            assert run.last.names() == ("a",) and len(run.snapshots) == 1
            assert "Connect" in str(run.discovery.status()["last_error"])
    finally:
        await server.stop()


async def test_a_dropped_watch_resumes_from_its_last_version(fake: FakeKubeApiServer, kubeconfig: Path) -> None:
    fake.put_pool(POOL, NS, APP, [8000])
    pod(fake, "a", "10.1.0.1")
    async with running(kubeconfig) as run:
        await run.names("a")
        pod(fake, "b", "10.1.0.2")
        await run.names("a", "b")
        await watching(fake)
        last = run.discovery.status()["resource_version"]
        lists = len(requests_for(fake, PODS_PATH, watch=False))
        fake.drop_watches()
        await async_wait_until(
            lambda: any(q.get("resourceVersion") == last for q in requests_for(fake, PODS_PATH, watch=True)[1:]),
            timeout=DEADLINE,
            what="the watch renewed from its last version",
        )
        pod(fake, "c", "10.1.0.3")
        await run.names("a", "b", "c")
        assert len(requests_for(fake, PODS_PATH, watch=False)) == lists


async def test_max_pods_bounds_the_pod_map(fake: FakeKubeApiServer, kubeconfig: Path) -> None:
    fake.put_pool(POOL, NS, APP, [8000])
    for i in range(4):
        pod(fake, f"p{i}", f"10.1.0.{i + 1}")
    async with running(kubeconfig, max_pods=2) as run:
        await run.names("p0", "p1")
        status = run.discovery.status()
        assert status["pods"] == 2 and status["pods_ignored"] == 2
        assert status["counts"]["pod_over_limit"] == 2  # type: ignore[index]
        pod(fake, "p4", "10.1.0.5")  # still full: ignored
        await run.counts("pod_over_limit", 3)
        fake.delete_pod("p0", NS)
        await run.names("p1")
        pod(fake, "p3", "10.1.0.4", annotations={"changed": "1"})  # a slot is free: its next event enters
        await run.names("p1", "p3")
        assert run.discovery.status()["pods"] == 2


async def test_the_pods_are_listed_in_pages(
    fake: FakeKubeApiServer, kubeconfig: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kube, "LIST_PAGE_SIZE", 2)
    fake.put_pool(POOL, NS, APP, [8000])
    for i in range(5):
        pod(fake, f"p{i}", f"10.1.0.{i + 1}")
    async with running(kubeconfig) as run:
        await run.names(*(f"p{i}" for i in range(5)))
        lists = requests_for(fake, PODS_PATH, watch=False)
        assert [q.get("limit") for q in lists] == ["2", "2", "2"]
        assert [bool(q.get("continue")) for q in lists] == [False, True, True]


async def test_credentials_from_kubeconfig_env_and_namespace_from_its_context(
    fake: FakeKubeApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = fake.write_kubeconfig(tmp_path / "from-env", namespace=NS)
    monkeypatch.setenv("KUBECONFIG", f"{tmp_path / 'missing'}:{path}")
    fake.put_pool(POOL, NS, APP, [8000])
    pod(fake, "a", "10.1.0.1")
    ref = InferencePoolRef(name=POOL, retry_max_seconds=0.3)  # no namespace, no kubeconfig path
    discovery = KubernetesPoolDiscovery(ref, service_account_dir=str(tmp_path / "no-service-account"))
    snapshots: list[PoolSnapshot] = []
    task = asyncio.create_task(discovery.run(snapshots.append))
    try:
        await async_wait_until(lambda: bool(snapshots) and snapshots[-1].names() == ("a",), timeout=DEADLINE)
        assert discovery.status()["source"] == f"inference_pool {NS}/{POOL}"
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_a_wrong_token_is_an_error_and_publishes_nothing(fake: FakeKubeApiServer, tmp_path: Path) -> None:
    fake.put_pool(POOL, NS, APP, [8000])
    pod(fake, "a", "10.1.0.1")
    path = fake.write_kubeconfig(tmp_path / "kubeconfig", namespace=NS)
    path.write_text(path.read_text().replace(str(fake.token), "wrong-token"))
    async with running(path) as run:
        await run.counts("error", 2)
        assert "401" in str(run.discovery.status()["last_error"])
        assert run.snapshots == [] and not run.discovery.synced


def test_the_thread_hosted_fake_serves_a_discovery_run_elsewhere(tmp_path: Path) -> None:
    """running_fake_kube: the fake on its own thread, mutated from this (synchronous) test."""
    with running_fake_kube() as fake:
        kubeconfig = fake.write_kubeconfig(tmp_path / "kubeconfig", namespace=NS)
        fake.put_pool(POOL, NS, APP, [8000])
        fake.put_pod("a", NS, APP, "10.1.0.1", True)
        snapshots: list[PoolSnapshot] = []
        loop = asyncio.new_event_loop()
        discovery = KubernetesPoolDiscovery(InferencePoolRef(name=POOL, kubeconfig=str(kubeconfig)))
        task = loop.create_task(discovery.run(snapshots.append))

        def names() -> tuple[str, ...] | None:
            loop.run_until_complete(asyncio.sleep(0.02))
            return snapshots[-1].names() if snapshots else None

        try:
            wait_until(lambda: names() == ("a",), timeout=DEADLINE)
            fake.put_pod("b", NS, APP, "10.1.0.2", True)
            wait_until(lambda: names() == ("a", "b"), timeout=DEADLINE)
            fake.delete_pod("a", NS)
            wait_until(lambda: names() == ("b",), timeout=DEADLINE)
            assert any(p == PODS_PATH and "watch" in q for _, p, q in fake.requests)
            assert fake.open_watches() == 1
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                loop.run_until_complete(task)
            loop.close()


async def test_watches_ended_by_timeout_seconds_are_renewed_without_a_list(
    fake: FakeKubeApiServer, kubeconfig: Path
) -> None:
    fake.put_pool(POOL, NS, APP, [8000])
    pod(fake, "a", "10.1.0.1")
    async with running(kubeconfig, watch_timeout_seconds=1) as run:
        await run.names("a")
        await async_wait_until(
            lambda: len(requests_for(fake, PODS_PATH, watch=True)) >= 3, timeout=DEADLINE, what="renewed watches"
        )
        pod(fake, "b", "10.1.0.2")
        await run.names("a", "b")
        assert all(q["timeoutSeconds"] == "1" for q in requests_for(fake, PODS_PATH, watch=True))
        assert len(requests_for(fake, PODS_PATH, watch=False)) == 1
        assert "error" not in run.discovery.status()["counts"]  # type: ignore[operator]


# -- a watch that goes silent, a 410 storm, the server's periodic bookmarks --------------------------------------


async def test_a_stalled_watch_is_noticed_and_renewed_within_the_idle_timeout(
    fake: FakeKubeApiServer, kubeconfig: Path
) -> None:
    """The server keeps the watch connections open and sends nothing: with watch_idle_timeout_seconds 1 (not the
    300 s + 60 s the read timeout used to be) both watches are renewed from their last version, no re-list, and a
    change made meanwhile arrives. The deadline (10 s) is far below the old bound, so the test fails without the
    idle timeout."""
    fake.bookmark_interval = 0.2  # as the real server (every minute there): a quiet watch that works is not stalled
    fake.put_pool(POOL, NS, APP, [8000])
    pod(fake, "a", "10.1.0.1")
    async with running(kubeconfig, watch_idle_timeout_seconds=1.0) as run:
        await run.names("a")
        await watching(fake)
        last = run.discovery.status()["resource_version"]
        watches = len(requests_for(fake, PODS_PATH, watch=True))
        lists = len(requests_for(fake, PODS_PATH, watch=False))
        fake.stall_watches()
        pod(fake, "b", "10.1.0.2")  # queued behind the stall: the stalled stream never sends it
        await run.counts("watch_stalled", 2)  # the pool's watch and the pods' watch
        await run.names("a", "b", what="the change, through the renewed watch")
        renewed = requests_for(fake, PODS_PATH, watch=True)[watches:]
        assert renewed and renewed[0]["resourceVersion"] == last, "renewed from its last version"
        assert len(requests_for(fake, PODS_PATH, watch=False)) == lists, "a stall is renewed, not re-listed"
        assert "error" not in run.discovery.status()["counts"]  # type: ignore[operator]
        fake.unstall_watches()


async def test_a_server_that_holds_new_watches_unanswered_is_retried(fake: FakeKubeApiServer, kubeconfig: Path) -> None:
    """Stalled before the answer's headers (an open connection, no bytes): the idle timeout covers that too."""
    fake.put_pool(POOL, NS, APP, [8000])
    pod(fake, "a", "10.1.0.1")
    async with running(kubeconfig, watch_idle_timeout_seconds=0.5) as run:
        await run.names("a")
        await watching(fake)
        fake.stall_watches(new_too=True)  # the open watches go silent, the next ones get no answer at all
        stalled = run.discovery.status()["counts"].get("watch_stalled", 0)  # type: ignore[attr-defined]
        await run.counts("watch_stalled", stalled + 3)
        fake.unstall_watches()
        pod(fake, "b", "10.1.0.2")
        await run.names("a", "b")


async def test_periodic_bookmarks_keep_a_quiet_watch_alive(fake: FakeKubeApiServer, kubeconfig: Path) -> None:
    """The real server sends a bookmark about every minute; here every 0.1 s, with an idle timeout of 2 s: a quiet
    watch is never taken as stalled (the bookmarks show it is alive)."""
    fake.bookmark_interval = 0.1
    fake.put_pool(POOL, NS, APP, [8000])
    pod(fake, "a", "10.1.0.1")
    async with running(kubeconfig, watch_idle_timeout_seconds=2.0) as run:
        await run.names("a")
        await watching(fake)
        bookmarks = run.discovery.status()["counts"].get("bookmark", 0)  # type: ignore[attr-defined]
        await run.counts("bookmark", bookmarks + 60)  # at least 3 s of quiet, in bookmarks (two watches)
        assert "watch_stalled" not in run.discovery.status()["counts"]  # type: ignore[operator]
        assert len(requests_for(fake, PODS_PATH, watch=True)) == 1


@pytest.mark.parametrize("as_http", [False, True])
async def test_a_410_storm_backs_off_after_the_first_resync(
    fake: FakeKubeApiServer, kubeconfig: Path, as_http: bool
) -> None:
    """Every watch answered 410: the first re-list is at once, the next ones wait the capped backoff
    (retry_max_seconds 0.4 here), counted "resync_backoff"; when watches work again the streak ends."""
    fake.put_pool(POOL, NS, APP, [8000])
    pod(fake, "a", "10.1.0.1")
    async with running(kubeconfig, retry_max_seconds=0.4) as run:
        await run.names("a")
        await watching(fake)
        fake.expire_watches()  # one 410: re-listed at once, no backoff
        await run.counts("resync", 1)
        await watching(fake)
        pod(fake, "b", "10.1.0.2")
        await run.names("a", "b")
        assert "resync_backoff" not in run.discovery.status()["counts"]  # type: ignore[operator]

        lists = len(requests_for(fake, PODS_PATH, watch=False))
        fake.watch_gone_as_http = as_http
        fake.gone_storm = True
        t0 = asyncio.get_running_loop().time()
        fake.close_watches()  # every watch from now on is answered 410
        await async_wait_until(
            lambda: len(requests_for(fake, PODS_PATH, watch=False)) >= lists + 6, timeout=30, what="6 re-lists"
        )
        elapsed = asyncio.get_running_loop().time() - t0
        # the backoff's shortest possible waits before re-lists 2..6 (jitter 0.5-1 x 0.1, 0.2, 0.4, 0.4, 0.4 s):
        # a tight loop makes its 6 re-lists in milliseconds; a busy machine only makes them slower
        assert elapsed >= 0.5 * (0.1 + 0.2 + 0.4 + 0.4 + 0.4) - 0.05, elapsed
        assert run.discovery.status()["counts"]["resync_backoff"] >= 4  # type: ignore[index]
        fake.gone_storm = False
        pod(fake, "c", "10.1.0.3")
        await run.names("a", "b", "c", what="watches work again")
        await watching(fake)  # both followers past any wait the storm's tail began
        marks = run.discovery.status()["counts"].get("bookmark", 0)  # type: ignore[attr-defined]
        fake.bookmark()  # each open watch delivers something: both streaks end
        await run.counts("bookmark", marks + 2)
        backoffs = run.discovery.status()["counts"]["resync_backoff"]  # type: ignore[index]
        fake.expire_watches()  # a single 410 after the storm: re-listed at once again, no wait
        pod(fake, "d", "10.1.0.4")
        await run.names("a", "b", "c", "d")
        await watching(fake)
        counts = run.discovery.status()["counts"]
        assert counts["resync_backoff"] == backoffs, counts  # type: ignore[index]


async def test_the_api_client_sockets_have_tcp_keepalive(fake: FakeKubeApiServer, kubeconfig: Path) -> None:
    """A peer gone without a FIN or RST is noticed by the kernel's keepalive probes, not only by the idle timeout:
    the real socket of a request to the (fake) API server has SO_KEEPALIVE and the probe timings set."""
    fake.put_pool(POOL, NS, APP, [8000])
    access = kube_access.load_kube_access(InferencePoolRef(name=POOL, kubeconfig=str(kubeconfig)))
    async with kube_access.make_http_client(access) as client, client.stream("GET", PODS_PATH.lstrip("/")) as resp:
        assert resp.status_code == 200
        sock = resp.extensions["network_stream"].get_extra_info("socket")
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) != 0
        if hasattr(socket, "TCP_KEEPIDLE"):
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == kube_access.KEEPALIVE_IDLE_SECONDS
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == kube_access.KEEPALIVE_COUNT
