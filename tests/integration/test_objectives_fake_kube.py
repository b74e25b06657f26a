"""Flow control's priorities from InferenceObjective objects: a picker (``build_server``, in process, every port 0)
follows an InferencePool served by a FAKE Kubernetes API server (tests.support.fake_kube: real HTTP on loopback,
list + watch; it is not Kubernetes) and watches its InferenceObjectives. Objectives created, updated, moved to
another pool and deleted change ``/admin/flow-control``'s ``watched_objectives`` and the priority flow control
uses (``priority_of``); a malformed one is counted and skipped; the config's objectives win. Without the CRD the
pool is discovered and the picker is ready all the same, and the objectives are watched once the CRD appears.

Every InferenceObjective used is checked against the CRD's openAPIV3Schema (tests/data/crds/) with jsonschema first:
the valid ones pass it, the malformed one is refused by it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import jsonschema
import pytest
import yaml

from picker.config import parse_settings
from picker.runtime.compose import build_server
from picker.runtime.lifecycle import PickerServer
from tests.support.fake_kube import OBJECTIVES, FakeKubeApiServer
from tests.support.poll import async_wait_until

NS = "serving"
POOL = "vllm"
LABELS = {"app": "vllm"}
DEADLINE = 10.0  # generous for a busy machine; a change normally lands within milliseconds
CRD = Path(__file__).resolve().parents[1] / "data" / "crds" / "llm-d.ai_inferenceobjectives.yaml"


def crd_validator() -> Any:
    crd = yaml.safe_load(CRD.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha2"]
    checker = jsonschema.FormatChecker()

    @checker.checks("int32")
    def int32(value: object) -> bool:
        return not isinstance(value, int) or -(1 << 31) <= value < (1 << 31)

    schema = version["schema"]["openAPIV3Schema"]
    return jsonschema.Draft7Validator(schema, format_checker=checker)


VALIDATOR = crd_validator()


def objective(name: str, priority: Any = None, pool: str = POOL, **pool_ref: Any) -> dict[str, Any]:
    """An InferenceObjective manifest, checked against the CRD's schema."""
    spec: dict[str, Any] = {"poolRef": {"name": pool, **pool_ref}}
    if priority is not None:
        spec["priority"] = priority
    manifest = {"apiVersion": "llm-d.ai/v1alpha2", "kind": "InferenceObjective", "metadata": {"name": name}}
    manifest["spec"] = spec
    VALIDATOR.validate(manifest)
    return manifest


@pytest.fixture
async def fake() -> AsyncIterator[FakeKubeApiServer]:
    server = FakeKubeApiServer()
    await server.start()
    try:
        server.put_pool(POOL, NS, LABELS, [8000])
        server.put_pod("vllm-0", NS, LABELS, "10.0.0.1", True)
        yield server
    finally:
        await server.stop()


@contextlib.asynccontextmanager
async def picker(fake: FakeKubeApiServer, tmp_path: Path, **flow_control: Any) -> AsyncIterator[PickerServer]:
    kubeconfig = fake.write_kubeconfig(tmp_path / "kubeconfig", namespace=NS)
    settings = parse_settings(
        {
            "selection_strategy": "RoundRobin",
            "pool": {
                "inference_pool": {
                    "name": POOL, "namespace": NS, "kubeconfig": str(kubeconfig), "retry_max_seconds": 0.2,
                },
                "engine_metrics": {"enabled": False},
            },
            "flow_control": flow_control,
            "extproc": {"host": "127.0.0.1", "port": 0, "health_port": None, "tls": {"mode": "plaintext"}},
            "admin": {"port": 0},
        }
    )  # fmt: skip
    server = build_server(settings)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


async def admin(server: PickerServer, path: str) -> Any:
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session,
        session.get(f"http://127.0.0.1:{server.admin_port}{path}") as r,
    ):
        assert r.status == 200, await r.text()
        return await r.json() if path != "/metrics" else await r.text()


async def watched(server: PickerServer, count: int, **priorities: int) -> dict[str, Any]:
    """Wait until /admin/flow-control counts ``count`` watched objectives and flow control gives each named
    objective its priority; returns that answer."""
    flow = server.app.path.flow
    answer: dict[str, Any] = {}

    async def holds() -> bool:
        nonlocal answer
        answer = await admin(server, "/admin/flow-control")
        return answer["watched_objectives"] == count and all(
            flow.priority_of(name) == p for name, p in priorities.items()
        )

    await async_wait_until(
        holds,
        timeout=DEADLINE,
        interval=0.02,
        what=f"{count} watched, priorities {priorities} (last: {answer}, watched {flow.watched})",
    )
    return answer


def test_the_crd_schema_refuses_what_the_watch_skips() -> None:
    for bad in (
        {"spec": {"poolRef": {"name": POOL}, "priority": "high"}},
        {"spec": {"poolRef": {"name": POOL}, "priority": 1 << 31}},
        {"spec": {"priority": 1}},
    ):
        with pytest.raises(jsonschema.ValidationError):
            VALIDATOR.validate({"apiVersion": "llm-d.ai/v1alpha2", "kind": "InferenceObjective", **bad})


async def test_objectives_created_updated_moved_and_deleted_change_the_priorities(
    fake: FakeKubeApiServer, tmp_path: Path
) -> None:
    fake.put_object(OBJECTIVES, NS, objective("chat", 10))
    fake.put_object(OBJECTIVES, NS, objective("batch", -5))
    fake.put_object(OBJECTIVES, NS, objective("plain"))  # priority unset: 0
    fake.put_object(OBJECTIVES, NS, objective("theirs", 99, pool="other"))
    fake.put_object(OBJECTIVES, NS, objective("pinned", 5))
    fake.put_object(OBJECTIVES, "elsewhere", objective("remote", 7))  # another namespace
    async with picker(fake, tmp_path, objectives={"pinned": {"priority": 100}}) as server:
        answer = await watched(server, 4, chat=10, batch=-5, plain=0, theirs=0, remote=0, pinned=100)
        status = answer["objective_watch"]
        assert status["synced"] is True and status["crd_found"] is True and status["objectives"] == 4
        assert status["source"] == f"inferenceobjectives {NS} poolRef={POOL}"
        await async_wait_until(lambda: server.app.readiness().ready, timeout=DEADLINE, what="ready")
        assert server.app.pool.names() == ("vllm-0",)

        fake.put_object(OBJECTIVES, NS, objective("chat", 20))  # updated
        await watched(server, 4, chat=20)
        fake.put_object(OBJECTIVES, NS, objective("new", 3, group="inference.networking.k8s.io"))  # created
        await watched(server, 5, new=3)
        fake.delete_object(OBJECTIVES, NS, "batch")  # deleted
        await watched(server, 4, batch=0)
        fake.put_object(OBJECTIVES, NS, objective("plain", 1, pool="other"))  # moved to another pool
        await watched(server, 3, plain=0)
        fake.put_object(OBJECTIVES, NS, objective("theirs", 8))  # moved to ours
        await watched(server, 4, theirs=8)

        # malformed (the CRD's validation would refuse it; the fake does not): counted, skipped, dropped if known
        bad = {"metadata": {"name": "chat"}, "spec": {"poolRef": {"name": POOL}, "priority": "high"}}
        with pytest.raises(jsonschema.ValidationError):
            VALIDATOR.validate(bad)
        fake.put_object(OBJECTIVES, NS, bad)
        answer = await watched(server, 3, chat=0, theirs=8, new=3)
        assert answer["objective_watch"]["malformed"] == 1

        metrics = await admin(server, "/metrics")
        for event in ("objectives_list", "objectives_watch_event", "objectives_malformed"):
            assert f'continuum_picker_discovery_events_total{{event="{event}"}}' in metrics, event
        assert 'continuum_picker_discovery_events_total{event="objectives_error"} 0.0' in metrics
        assert server.not_ready_reason is None and server.app.readiness().ready


async def test_without_the_crd_the_pool_is_discovered_and_the_objectives_follow_once_it_is_installed(
    fake: FakeKubeApiServer, tmp_path: Path
) -> None:
    fake.uninstall(OBJECTIVES)
    async with picker(fake, tmp_path) as server:
        await async_wait_until(lambda: server.app.readiness().ready, timeout=DEADLINE, what="ready")
        assert server.app.pool.names() == ("vllm-0",)

        async def not_found() -> bool:
            status = (await admin(server, "/admin/flow-control"))["objective_watch"]
            return status["crd_found"] is False and status["counts"].get("not_found", 0) >= 2  # retried

        await async_wait_until(not_found, timeout=DEADLINE, interval=0.02, what="the 404 seen and retried")
        assert server.app.path.flow.watched == {}
        fake.put_pod("vllm-1", NS, LABELS, "10.0.0.2", True)  # discovery goes on meanwhile
        await async_wait_until(lambda: len(server.app.pool.names()) == 2, timeout=DEADLINE, what="vllm-1 joined")

        fake.install(OBJECTIVES)
        fake.put_object(OBJECTIVES, NS, objective("chat", 10))
        answer = await watched(server, 1, chat=10)
        assert answer["objective_watch"]["crd_found"] is True and answer["objective_watch"]["last_error"] is None

        fake.uninstall(OBJECTIVES)  # the CRD deleted: its objects go with it
        await watched(server, 0, chat=0)
        assert server.not_ready_reason is None and server.app.readiness().ready


async def test_watch_objectives_false_watches_nothing(fake: FakeKubeApiServer, tmp_path: Path) -> None:
    fake.put_object(OBJECTIVES, NS, objective("chat", 10))
    async with picker(fake, tmp_path, watch_objectives=False) as server:
        await async_wait_until(lambda: server.app.readiness().ready, timeout=DEADLINE, what="ready")
        answer = await admin(server, "/admin/flow-control")
        assert answer["watched_objectives"] == 0 and "objective_watch" not in answer
        assert server.app.objective_watch is None
        assert not [p for _, p, _ in fake.requests if p.endswith("/inferenceobjectives")]
