"""Model rewrites from InferenceModelRewrite objects: a picker (``build_server``, in process, every port 0) follows an
InferencePool served by a FAKE Kubernetes API server (tests.support.fake_kube: real HTTP on loopback, list + watch;
it is not Kubernetes) and watches its InferenceModelRewrites. Objects created, updated, moved to another pool and
deleted change ``/admin/model-rewrites`` and the model a request is sent on as; precedence between objects follows
their age, and the config's ``model_rewrites`` rank before them; a malformed one is counted and skipped. Without the
CRD the pool is discovered and the picker is ready all the same.

Every InferenceModelRewrite used is checked against the CRD's openAPIV3Schema (tests/data/crds/) with jsonschema
first: the valid ones pass it, the malformed one is refused by it."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import jsonschema
import pytest
import yaml

from picker.config import parse_settings
from picker.request.exchange import Exchange
from picker.request.path import Inbound
from picker.runtime.compose import build_server
from picker.runtime.lifecycle import PickerServer
from tests.support.fake_kube import MODEL_REWRITES, FakeKubeApiServer
from tests.support.poll import async_wait_until

NS = "serving"
POOL = "vllm"
LABELS = {"app": "vllm"}
DEADLINE = 10.0  # generous for a busy machine; a change normally lands within milliseconds
CRD = Path(__file__).resolve().parents[1] / "data" / "crds" / "llm-d.ai_inferencemodelrewrites.yaml"


def crd_validator() -> Any:
    crd = yaml.safe_load(CRD.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha2"]
    return jsonschema.Draft7Validator(version["schema"]["openAPIV3Schema"])


VALIDATOR = crd_validator()


def rewrite(name: str, model: str | None, *targets: str, pool: str = POOL, created: str | None = None) -> dict:
    """An InferenceModelRewrite manifest with one rule (``model`` None: a generic rule; targets unweighted),
    checked against the CRD's schema."""
    rule: dict[str, Any] = {"targets": [{"modelRewrite": t} for t in targets]}
    if model is not None:
        rule["matches"] = [{"model": {"type": "Exact", "value": model}}]
    meta: dict[str, Any] = {"name": name}
    if created is not None:
        meta["creationTimestamp"] = created
    manifest = {"apiVersion": "llm-d.ai/v1alpha2", "kind": "InferenceModelRewrite", "metadata": meta}
    manifest["spec"] = {"poolRef": {"name": pool}, "rules": [rule]}
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
async def picker(fake: FakeKubeApiServer, tmp_path: Path, **extra: Any) -> AsyncIterator[PickerServer]:
    kubeconfig = fake.write_kubeconfig(tmp_path / "kubeconfig", namespace=NS)
    settings = parse_settings(
        {
            "pool": {
                "inference_pool": {
                    "name": POOL, "namespace": NS, "kubeconfig": str(kubeconfig), "retry_max_seconds": 0.2,
                },
                "engine_metrics": {"enabled": False},
            },
            "extproc": {"host": "127.0.0.1", "port": 0, "health_port": None, "tls": {"mode": "plaintext"}},
            "admin": {"port": 0},
            **extra,
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


async def mapping(server: PickerServer, want: dict[str, str | None]) -> dict[str, Any]:
    """Wait until /admin/model-rewrites maps each model of ``want`` to that rewrite (None: to none); its answer."""
    answer: dict[str, Any] = {}

    async def holds() -> bool:
        nonlocal answer
        answer = await admin(server, "/admin/model-rewrites")
        got = {m: (answer["exact"].get(m) or answer["generic"] or {}).get("rewrite") for m in want}
        return got == want

    await async_wait_until(holds, timeout=DEADLINE, interval=0.02, what=f"rewrites {want} (last: {answer})")
    return answer


async def sent_as(server: PickerServer, model: str) -> str | None:
    """The model a chat request for ``model`` is sent on as (its exchange's body, else the client's)."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "q"}]}).encode()
    ex = await server.app.path.route(Inbound("/v1/chat/completions", {":method": "POST"}, body))
    assert isinstance(ex, Exchange)
    ex.end(completed=True)
    out = json.loads(ex.body_out) if ex.body_out is not None else json.loads(body)
    assert out["model"] == ex.facts.model
    return ex.facts.model


async def test_rewrites_created_updated_moved_and_deleted_change_the_served_model(
    fake: FakeKubeApiServer, tmp_path: Path
) -> None:
    fake.put_object(MODEL_REWRITES, NS, rewrite("alias", "chat", "chat-v1", created="2026-01-02T00:00:00Z"))
    fake.put_object(MODEL_REWRITES, NS, rewrite("older", "chat", "chat-v0", created="2026-01-01T00:00:00Z"))
    fake.put_object(MODEL_REWRITES, NS, rewrite("theirs", "code", "code-v9", pool="other"))
    fake.put_object(MODEL_REWRITES, "elsewhere", rewrite("remote", "code", "code-v8"))  # another namespace
    pinned = {"name": "pinned", "rules": [{"matches": [{"model": {"value": "doc"}}], "targets": [
        {"modelRewrite": "doc-config"}]}]}  # fmt: skip
    fake.put_object(MODEL_REWRITES, NS, rewrite("doc-watched", "doc", "doc-v1"))
    async with picker(fake, tmp_path, model_rewrites=[pinned]) as server:
        answer = await mapping(server, {"chat": "older", "code": None, "doc": "pinned"})  # the oldest; the config's
        status = answer["rewrite_watch"]
        assert status["synced"] is True and status["crd_found"] is True and status["rewrites"] == 3
        assert answer["configured"] == ["pinned"] and answer["watched"] == ["alias", "doc-watched", "older"]
        await async_wait_until(lambda: server.app.readiness().ready, timeout=DEADLINE, what="ready")
        assert await sent_as(server, "chat") == "chat-v0" and await sent_as(server, "doc") == "doc-config"
        assert await sent_as(server, "code") == "code"

        fake.delete_object(MODEL_REWRITES, NS, "older")  # deleted: the next oldest applies
        await mapping(server, {"chat": "alias"})
        assert await sent_as(server, "chat") == "chat-v1"
        fake.put_object(MODEL_REWRITES, NS, rewrite("alias", "chat", "chat-v2"))  # updated
        await async_wait_until(lambda: server.app.path.rewrites.table.exact["chat"].models == ("chat-v2",),
                               timeout=DEADLINE, what="alias updated")  # fmt: skip
        assert await sent_as(server, "chat") == "chat-v2"
        fake.put_object(MODEL_REWRITES, NS, rewrite("theirs", "code", "code-v9"))  # moved to ours
        fake.put_object(MODEL_REWRITES, NS, rewrite("catch-all", None, "default-model"))  # a generic rule
        await mapping(server, {"code": "theirs", "anything": "catch-all", "chat": "alias"})
        assert await sent_as(server, "code") == "code-v9" and await sent_as(server, "anything") == "default-model"
        fake.put_object(MODEL_REWRITES, NS, rewrite("alias", "chat", "chat-v2", pool="other"))  # moved away
        await mapping(server, {"chat": "catch-all"})

        # malformed (the CRD's validation would refuse it; the fake does not): counted, skipped, dropped if known
        bad = rewrite("theirs", "code", "code-v9")
        bad["spec"]["rules"][0]["targets"][0]["weight"] = 0
        with pytest.raises(jsonschema.ValidationError):
            VALIDATOR.validate(bad)
        fake.put_object(MODEL_REWRITES, NS, bad)
        answer = await mapping(server, {"code": "catch-all"})
        assert answer["rewrite_watch"]["malformed"] == 1

        metrics = await admin(server, "/metrics")
        for event in ("rewrites_list", "rewrites_watch_event", "rewrites_malformed"):
            assert f'continuum_picker_discovery_events_total{{event="{event}"}}' in metrics, event
        assert 'continuum_picker_discovery_events_total{event="rewrites_error"} 0.0' in metrics
        decision = 'model_name="chat",model_rewrite_name="older",target_model="chat-v0"'
        assert f"llm_d_epp_model_rewrite_decisions_total{{{decision}}} 1.0" in metrics
        assert server.not_ready_reason is None and server.app.readiness().ready


async def test_without_the_crd_the_pool_is_discovered_and_the_config_rewrites_apply(
    fake: FakeKubeApiServer, tmp_path: Path
) -> None:
    fake.uninstall(MODEL_REWRITES)
    pinned = {"name": "pinned", "rules": [{"matches": [{"model": {"value": "doc"}}], "targets": [
        {"modelRewrite": "doc-config"}]}]}  # fmt: skip
    async with picker(fake, tmp_path, model_rewrites=[pinned]) as server:
        await async_wait_until(lambda: server.app.readiness().ready, timeout=DEADLINE, what="ready")

        async def not_found() -> bool:
            status = (await admin(server, "/admin/model-rewrites"))["rewrite_watch"]
            return status["crd_found"] is False and status["counts"].get("not_found", 0) >= 2  # retried

        await async_wait_until(not_found, timeout=DEADLINE, interval=0.02, what="the 404 seen and retried")
        assert await sent_as(server, "doc") == "doc-config"
        fake.install(MODEL_REWRITES)
        fake.put_object(MODEL_REWRITES, NS, rewrite("chat", "chat", "chat-v1"))
        await mapping(server, {"chat": "chat", "doc": "pinned"})
        assert server.not_ready_reason is None and server.app.readiness().ready


async def test_watch_model_rewrites_false_watches_nothing(fake: FakeKubeApiServer, tmp_path: Path) -> None:
    fake.put_object(MODEL_REWRITES, NS, rewrite("chat", "chat", "chat-v1"))
    async with picker(fake, tmp_path, watch_model_rewrites=False) as server:
        await async_wait_until(lambda: server.app.readiness().ready, timeout=DEADLINE, what="ready")
        answer = await admin(server, "/admin/model-rewrites")
        assert answer["watched"] == [] and "rewrite_watch" not in answer and server.app.rewrite_watch is None
        assert await sent_as(server, "chat") == "chat"
        assert not [p for _, p, _ in fake.requests if p.endswith("/inferencemodelrewrites")]
