"""InferencePool discovery without a server: where the credentials and the namespace come from (the way
kubectl finds them), the config models, and what makes a pod live and a pool spec usable."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from picker.shared.discovery.config import BackendsFileRef, InferencePoolRef, canonical_ip_port
from picker.shared.discovery.kube_access import KubeConfigError, load_kube_access, make_http_client
from picker.shared.discovery.kube_objects import BadPool, parse_pod, parse_pool_spec


def kubeconfig(path: Path, server: str, namespace: str | None = None, *, user: bool = True) -> Path:
    context: dict[str, Any] = {"cluster": "c"}
    if user:
        context["user"] = "u"
    if namespace:
        context["namespace"] = namespace
    doc = {
        "clusters": [
            {"name": "c", "cluster": {"server": server}},
            {"name": "c2", "cluster": {"server": "https://other:6443"}},
        ],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [
            {"name": "main", "context": context},
            {"name": "other", "context": {"cluster": "c2", "user": "u", "namespace": "other-ns"}},
        ],
        "current-context": "main",
    }
    path.write_text(json.dumps(doc))
    return path


@pytest.fixture
def service_account(tmp_path: Path) -> Path:
    sa = tmp_path / "sa"
    sa.mkdir()
    (sa / "token").write_text("sa-token\n")
    (sa / "namespace").write_text("in-cluster-ns")
    (sa / "ca.crt").write_text("")
    return sa


REF = InferencePoolRef(name="pool")
IN_CLUSTER = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}


def test_in_cluster_service_account_first(service_account: Path, tmp_path: Path) -> None:
    env = IN_CLUSTER | {"KUBECONFIG": str(kubeconfig(tmp_path / "kc", "http://from-env:1"))}
    access = load_kube_access(REF, service_account_dir=str(service_account), environ=env)
    assert access.config.cluster.server == "https://10.96.0.1:443"
    assert access.config.cluster.certificate_auth == str(service_account / "ca.crt")
    assert access.config.user is not None and access.config.user.token == "sa-token"
    assert access.namespace == "in-cluster-ns" and access.origin == "in-cluster service account"
    v6 = load_kube_access(
        REF, service_account_dir=str(service_account), environ=IN_CLUSTER | {"KUBERNETES_SERVICE_HOST": "fd00::1"}
    )
    assert v6.config.cluster.server == "https://[fd00::1]:443"


def test_then_kubeconfig_env_first_existing_file(tmp_path: Path) -> None:
    path = kubeconfig(tmp_path / "kc", "http://from-env:1", namespace="ctx-ns")
    env = {"KUBECONFIG": f"{tmp_path / 'missing'}:{path}"}  # a token file without the service env is not in-cluster
    access = load_kube_access(REF, service_account_dir=str(tmp_path / "none"), environ=env)
    assert access.config.cluster.server == "http://from-env:1"
    assert access.namespace == "ctx-ns" and access.origin == str(path)


def test_then_home_kube_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".kube").mkdir()
    kubeconfig(tmp_path / ".kube" / "config", "http://home:1")
    access = load_kube_access(REF, service_account_dir=str(tmp_path / "none"), environ={})
    assert access.config.cluster.server == "http://home:1" and access.namespace == "default"


def test_nothing_found_says_where_it_looked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(KubeConfigError, match=r"no Kubernetes credentials.*~/\.kube/config"):
        load_kube_access(REF, service_account_dir=str(tmp_path / "none"), environ={})


def test_an_explicit_kubeconfig_and_context(tmp_path: Path, service_account: Path) -> None:
    path = kubeconfig(tmp_path / "kc", "http://main:1", namespace="ctx-ns")
    ref = InferencePoolRef(name="pool", kubeconfig=str(path), context="other")
    access = load_kube_access(ref, service_account_dir=str(tmp_path / "none"), environ=IN_CLUSTER)
    assert access.config.cluster.server == "https://other:6443" and access.namespace == "other-ns"
    # the service account's namespace comes before the context's; the ref's before both
    access = load_kube_access(ref, service_account_dir=str(service_account), environ={})
    assert access.namespace == "in-cluster-ns"
    explicit = ref.model_copy(update={"namespace": "mine"})
    assert load_kube_access(explicit, service_account_dir=str(service_account), environ={}).namespace == "mine"
    with pytest.raises(KubeConfigError, match="Context 'nope' not found"):
        load_kube_access(ref.model_copy(update={"context": "nope"}), service_account_dir="/none", environ={})
    with pytest.raises(KubeConfigError, match="not found"):
        load_kube_access(InferencePoolRef(name="p", kubeconfig=str(tmp_path / "x")), environ={})
    (tmp_path / "broken").write_text("clusters: 3\n")
    with pytest.raises(KubeConfigError, match="cannot use"):
        load_kube_access(InferencePoolRef(name="p", kubeconfig=str(tmp_path / "broken")), environ={})


async def test_a_context_without_a_user_is_unauthenticated(tmp_path: Path) -> None:
    path = kubeconfig(tmp_path / "kc", "http://127.0.0.1:1", user=False)
    access = load_kube_access(InferencePoolRef(name="p", kubeconfig=str(path)), environ={})
    async with make_http_client(access) as client:
        assert str(client.base_url).startswith("http://127.0.0.1:1")


def test_the_config_models() -> None:
    ref = InferencePoolRef(name="pool")
    assert (ref.namespace, ref.kubeconfig, ref.watch_timeout_seconds, ref.retry_max_seconds, ref.max_pods) == (
        None,
        None,
        300,
        10.0,
        10_000,
    )
    for bad in (
        {"name": "Pool"},
        {"name": "p" * 64},
        {"name": "a.b"},
        {"name": "ok", "namespace": "-x"},
        {"name": "ok", "max_pods": 0},
        {"name": "ok", "watch_timeout_seconds": 0},
        {"name": "ok", "x": 1},
    ):
        with pytest.raises(ValidationError):
            InferencePoolRef(**bad)
    with pytest.raises(ValidationError):
        ref.name = "other"  # type: ignore[misc]
    assert BackendsFileRef(path="b.yaml").poll_seconds == 1.0
    with pytest.raises(ValidationError):
        BackendsFileRef(path="")
    assert canonical_ip_port("[fd00:0::1]:80") == "[fd00::1]:80"


def pod(**status: Any) -> dict[str, Any]:
    meta = status.pop("metadata", {})
    return {"metadata": {"name": "p-0", **meta}, "status": status}


READY = [{"type": "Ready", "status": "True"}]


def test_what_makes_a_pod_live() -> None:
    assert parse_pod(pod(podIP="10.0.0.1", conditions=READY))[1].live
    assert not parse_pod(pod(podIP="10.0.0.1", conditions=[{"type": "Ready", "status": "False"}]))[1].live
    assert not parse_pod(pod(conditions=READY))[1].live
    assert not parse_pod(pod(podIP="not-an-ip", conditions=READY))[1].live
    terminating = pod(podIP="10.0.0.1", conditions=READY, metadata={"deletionTimestamp": "2026-01-01T00:00:00Z"})
    assert not parse_pod(terminating)[1].live
    name, p = parse_pod(pod(podIP="10.0.0.1", conditions=READY, metadata={"annotations": {"b": "1", "a": "2"}}))
    assert name == "p-0" and p.annotations == (("a", "2"), ("b", "1"))
    with pytest.raises(ValueError, match="backend name"):
        parse_pod({"metadata": {"name": "../x"}})


def test_pool_specs() -> None:
    spec = parse_pool_spec(
        {
            "spec": {
                "selector": {"matchLabels": {"b": "2", "a": "1"}},
                "targetPorts": [{"number": 8000}, {"number": 8001}],
            }
        }
    )
    assert spec.label_selector == "a=1,b=2" and spec.target_ports == (8000, 8001)
    bad: list[tuple[dict[str, Any], str]] = [
        ({"spec": {"targetPorts": [{"number": 1}]}}, "spec.selector.matchLabels"),
        ({"spec": {"selector": {"matchLabels": {"a": "1"}}, "targetPorts": []}}, "spec.targetPorts"),
        (
            {"spec": {"selector": {"matchLabels": {"a": "1"}}, "targetPorts": [{"number": 1}, {"number": 1}]}},
            "spec.targetPorts[1].number",
        ),
        (
            {"spec": {"selector": {"matchLabels": {"a": "1,b=2"}}, "targetPorts": [{"number": 1}]}},
            "spec.selector.matchLabels.a",
        ),
    ]
    for obj, where in bad:
        with pytest.raises(BadPool, match="^" + re.escape(where)):
            parse_pool_spec(obj)
