"""The InferenceModelRewrite watch without an API server (an in-process ``httpx2.MockTransport``): what an object
parses to (the CRD's fields, checked against its openAPIV3Schema in tests/data/crds first), what a malformed one
says, and what a list and the events publish. The follower's own rules (bookmarks, 410s, a missing CRD, bounds) are
``PoolObjectWatch``'s, tested with the objectives (test_kube_objectives.py); the whole run against the fake API
server, with the picker, is tests/integration/test_model_rewrites_fake_kube.py."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import httpx2
import jsonschema
import pytest
import yaml

from picker.shared.discovery.config import InferencePoolRef
from picker.shared.discovery.kube_objects import (
    BadModelRewrite,
    ModelRewrite,
    RewriteRule,
    RewriteTarget,
    parse_model_rewrite,
)
from picker.shared.discovery.kube_rewrites import KubernetesModelRewriteWatch

NS = "llm"
POOL = "vllm"
CRD = Path(__file__).resolve().parents[5] / "tests" / "data" / "crds" / "llm-d.ai_inferencemodelrewrites.yaml"


def schema() -> jsonschema.Draft7Validator:
    crd = yaml.safe_load(CRD.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha2"]
    return jsonschema.Draft7Validator(version["schema"]["openAPIV3Schema"])


VALIDATOR = schema()


def rewrite(name: str, rules: list[dict[str, Any]], pool: str = POOL, created: str = "2026-01-01T00:00:00Z") -> dict:
    obj = {
        "apiVersion": "llm-d.ai/v1alpha2", "kind": "InferenceModelRewrite",
        "metadata": {"name": name, "creationTimestamp": created, "resourceVersion": "1"},
        "spec": {"poolRef": {"name": pool}, "rules": rules},
    }  # fmt: skip
    return obj


def canary(model: str = "m", v1: int = 90, v2: int = 10) -> dict[str, Any]:
    return {
        "matches": [{"model": {"type": "Exact", "value": model}}],
        "targets": [{"modelRewrite": f"{model}-v1", "weight": v1}, {"modelRewrite": f"{model}-v2", "weight": v2}],
    }


def test_a_rewrite_parses_to_its_rules_in_order_with_its_age() -> None:
    obj = rewrite("r", [canary(), {"targets": [{"modelRewrite": "fallback"}]}])
    VALIDATOR.validate(obj)
    name, parsed = parse_model_rewrite(obj, POOL)
    assert name == "r" and parsed == ModelRewrite(
        "r",
        (
            RewriteRule(("m",), (RewriteTarget("m-v1", 90), RewriteTarget("m-v2", 10))),
            RewriteRule((), (RewriteTarget("fallback", None),)),  # no matches: a generic rule
        ),
        1767225600.0,  # 2026-01-01T00:00:00Z
    )
    assert parse_model_rewrite(rewrite("r", [canary()], pool="other"), POOL) == ("r", None)
    gone = rewrite("r", [canary()])
    gone["metadata"]["deletionTimestamp"] = "2026-01-02T00:00:00Z"
    assert parse_model_rewrite(gone, POOL) == ("r", None)


@pytest.mark.parametrize(
    ("rules", "says"),
    [
        ("x", "spec.rules must be a list"),
        ([{"matches": [{"model": {"type": "Prefix", "value": "m"}}], "targets": [{"modelRewrite": "t"}]}],
         "spec.rules[0].matches[0].model.type 'Prefix' is not supported"),
        ([{"matches": [{"model": {"value": ""}}], "targets": [{"modelRewrite": "t"}]}],
         "spec.rules[0].matches[0].model.value must be a model name"),
        ([{"matches": [{}], "targets": [{"modelRewrite": "t"}]}], "spec.rules[0].matches[0].model is missing"),
        ([{"matches": [{"model": {"value": "m"}}]}], "spec.rules[0].targets must list 1 to"),
        ([canary(v1=0)], "spec.rules[0].targets[0].weight 0 is not an integer in 1..1000000"),
        ([canary(v2=True)], "spec.rules[0].targets[1].weight True"),
        ([{"targets": [{"weight": 1}]}], "spec.rules[0].targets[0].modelRewrite must be a model name"),
        ([canary()] * 257, "at most 256 rules"),
    ],
)  # fmt: skip
def test_a_malformed_rewrite_is_refused_naming_the_field(rules: Any, says: str) -> None:
    with pytest.raises(BadModelRewrite, match=re.escape(says)) as caught:
        parse_model_rewrite(rewrite("bad", rules), POOL)
    assert caught.value.name == "bad"


async def test_a_list_and_events_publish_the_pools_rewrites_and_skip_a_malformed_one() -> None:
    published: list[dict[str, ModelRewrite]] = []
    counted: list[str] = []
    ref = InferencePoolRef(name=POOL, namespace=NS, retry_max_seconds=0.1)
    watch = KubernetesModelRewriteWatch(ref, published.append, counted.append, max_rewrites=2)
    items = [rewrite("a", [canary("a")]), rewrite("bad", [{"targets": []}]), rewrite("theirs", [canary()], "x")]
    body = {"kind": "InferenceModelRewriteList", "metadata": {"resourceVersion": "42"}, "items": items}
    path = f"/apis/llm-d.ai/v1alpha2/namespaces/{NS}/inferencemodelrewrites"

    def handler(request: httpx2.Request) -> httpx2.Response:
        assert request.url.path == path
        return httpx2.Response(200, json=body)

    async with httpx2.AsyncClient(transport=httpx2.MockTransport(handler), base_url="https://kube.test/") as http:
        assert await watch._list(http) == "42"
    assert list(published[0]) == ["a"] and published[0]["a"].rules[0].models == ("a",)
    assert counted == ["rewrites_malformed", "rewrites_list"]
    watch._on_event("ADDED", rewrite("b", [canary("b")]), "43")
    watch._on_event("ADDED", rewrite("c", [canary("c")]), "44")  # past max_rewrites: ignored, counted
    watch._on_event("MODIFIED", rewrite("a", [canary("a", 50, 50)]), "45")
    await asyncio.sleep(0)
    assert sorted(published[-1]) == ["a", "b"] and published[-1]["a"].rules[0].targets[0].weight == 50
    assert counted.count("rewrites_over_limit") == 1
    watch._on_event("DELETED", rewrite("a", [canary("a")]), "46")
    await asyncio.sleep(0)
    assert sorted(published[-1]) == ["b"]
    status = watch.status()
    assert status["rewrites"] == 1 and status["malformed"] == 1 and status["rewrites_ignored"] == 1
    assert status["source"] == f"inferencemodelrewrites {NS} poolRef={POOL}"
