"""The chart wires ext_proc authentication between its Envoy and the pickers by default (issue 21), rendered offline
(the Helm SDK wheel): the token Secret, mounted in the picker container only and named by its config; Envoy's
bootstrap, a Secret, sending it (tests/unit/charts/test_envoy.py checks the bootstrap itself, and
tests/integration/test_extproc_exposure.py runs it through the real Envoy); the pods roll when the token changes and
only then; ``extprocAuth.mode: none`` is the explicit opt-out."""

from __future__ import annotations

import base64
import hashlib
from typing import Any

import helm_python as helm
import pytest
import yaml

from charts import chart_variants as cv

README = cv.CHART / "README.md"
TOKEN_DIR = "/etc/kv-epp/extproc-auth"


def pod_spec(objs: list[dict[str, Any]], deployment: str) -> dict[str, Any]:
    spec: dict[str, Any] = cv.find(objs, "Deployment", deployment)["spec"]["template"]["spec"]
    return spec


def annotations(objs: list[dict[str, Any]], deployment: str) -> dict[str, str]:
    meta: dict[str, str] = cv.find(objs, "Deployment", deployment)["spec"]["template"]["metadata"]["annotations"]
    return meta


def token_of(objs: list[dict[str, Any]]) -> str:
    return base64.b64decode(cv.find(objs, "Secret", "kv-epp-extproc-token")["data"]["token"]).decode()


def mounts(spec: dict[str, Any], container: str) -> dict[str, str]:
    (c,) = [c for c in spec["containers"] if c["name"] == container]
    return {m["name"]: m["mountPath"] for m in c.get("volumeMounts", [])}


@pytest.mark.parametrize("mode", ["sidecar", "standalone", "none"])
def test_the_token_secret_is_mounted_in_the_picker_container_only(mode: str) -> None:
    objs = cv.objects(cv.merge(cv.REQUIRED, {"envoy": {"mode": mode}}))
    token = token_of(objs)
    assert len(token) == 48 and token.isalnum()
    picker_cfg = yaml.safe_load(cv.find(objs, "ConfigMap", "kv-epp-picker")["data"]["picker.yaml"])
    assert picker_cfg["extproc"]["auth"] == {"token_file": f"{TOKEN_DIR}/token"}
    assert picker_cfg["extproc"]["host"] == "0.0.0.0"  # beyond loopback: Envoy's Deployment and kubelet reach it
    spec = pod_spec(objs, "kv-epp-picker")
    assert mounts(spec, "picker")["extproc-token"] == TOKEN_DIR
    (volume,) = [v for v in spec["volumes"] if v["name"] == "extproc-token"]
    assert volume["secret"] == {
        "secretName": "kv-epp-extproc-token", "defaultMode": 0o440, "items": [{"key": "token", "path": "token"}]
    }  # fmt: skip
    envoy_pod = {"sidecar": "kv-epp-picker", "standalone": "kv-epp-envoy"}.get(mode)
    if envoy_pod is not None:  # Envoy reads its bootstrap (holding the token), never the picker's token file
        envoy_mounts = mounts(pod_spec(objs, envoy_pod), "envoy")
        assert "extproc-token" not in envoy_mounts and envoy_mounts["envoy-config"] == "/etc/envoy"
        (bootstrap,) = [v for v in pod_spec(objs, envoy_pod)["volumes"] if v["name"] == "envoy-config"]
        assert bootstrap["secret"]["secretName"] == "kv-epp-envoy"
        assert annotations(objs, envoy_pod)["checksum/extproc-token"] == hashlib.sha256(token.encode()).hexdigest()
        assert not [o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "kv-epp-envoy"]
    else:
        assert not [o for o in objs if o["metadata"]["name"] == "kv-epp-envoy"]
    assert annotations(objs, "kv-epp-picker")["checksum/extproc-token"] == hashlib.sha256(token.encode()).hexdigest()


def fresh_render(values: dict[str, Any]) -> list[dict[str, Any]]:
    """One render without the renderer's cache (lookup finds nothing, as with helm template or Argo CD)."""
    with helm.Chart.load(cv.CHART) as chart:
        text = chart.render(values, name=cv.RELEASE, namespace=cv.NAMESPACE, is_install=True)
    return [d for p, t in text.items() if not p.endswith("NOTES.txt") for d in yaml.safe_load_all(t) if d]


@pytest.mark.parametrize("mode", ["sidecar", "standalone"])
def test_a_new_token_rolls_the_pods_and_a_config_change_is_told_apart(mode: str) -> None:
    """Without lookup each render makes a new token: the token's checksum changes (the picker and Envoy read the
    token at start, so both roll), the bootstrap's checksum does not (it leaves the token out), so a pod rolls for
    a config change only when the config changed. One render's Secret, bootstrap and checksums agree."""
    values = cv.merge(cv.REQUIRED, {"envoy": {"mode": mode}})
    first, second = fresh_render(values), fresh_render(values)
    assert token_of(first) != token_of(second)
    envoy_pod = "kv-epp-picker" if mode == "sidecar" else "kv-epp-envoy"
    for pod in {"kv-epp-picker", envoy_pod}:
        assert annotations(first, pod)["checksum/extproc-token"] != annotations(second, pod)["checksum/extproc-token"]
    config = "checksum/envoy-config"
    assert annotations(first, envoy_pod)[config] == annotations(second, envoy_pod)[config]
    bootstrap = base64.b64decode(cv.find(first, "Secret", "kv-epp-envoy")["data"]["envoy.json"]).decode()
    assert f"Bearer {token_of(first)}" in bootstrap


def test_mode_none_is_the_explicit_opt_out() -> None:
    objs = cv.objects(cv.values_of("extproc-unauthenticated"))
    assert not [o for o in objs if o["kind"] == "Secret" and o["metadata"]["name"] == "kv-epp-extproc-token"]
    picker_cfg = yaml.safe_load(cv.find(objs, "ConfigMap", "kv-epp-picker")["data"]["picker.yaml"])
    assert picker_cfg["extproc"]["auth"] == {"allow_unauthenticated": True}
    spec = pod_spec(objs, "kv-epp-picker")
    assert "extproc-token" not in mounts(spec, "picker")
    assert "checksum/extproc-token" not in annotations(objs, "kv-epp-picker")
    policy = cv.find(objs, "NetworkPolicy", "kv-epp-picker")  # only the named gateway reaches ext_proc
    extproc_rules = [r for r in policy["spec"]["ingress"] if any(p["port"] == "extproc" for p in r["ports"])]
    assert [r["from"] for r in extproc_rules] == [[cv.GATEWAY_PEER]]
    with pytest.raises(helm.HelmValuesError, match="/extprocAuth/mode"):
        cv.render(cv.merge(cv.REQUIRED, {"extprocAuth": {"mode": "mtls"}}))


def test_notes_and_readme_say_who_may_open_streams() -> None:
    notes = cv.render(cv.values_of("no-envoy"))
    (text,) = [t for p, t in notes.items() if p.endswith("NOTES.txt")]
    assert "kv-epp-extproc-token" in text and "configure your gateway to send it" in text
    rendered = cv.render(cv.values_of("extproc-unauthenticated"))
    (open_notes,) = [t for p, t in rendered.items() if p.endswith("NOTES.txt")]
    assert "WARNING: ext_proc accepts streams without authentication" in open_notes
    section = README.read_text().split("## ext_proc authentication", 1)[1].split("\n## ", 1)[0]
    for needed in ("extprocAuth.mode", "lookup", "helm template", "allow_unauthenticated", "UNAUTHENTICATED",
                   "checksum/extproc-token", "networkPolicy", "max_streams_per_peer"):  # fmt: skip
        assert needed in section, needed
