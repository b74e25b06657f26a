"""examples/pd/model-servers.yaml (docs/pd.md, "Running it on Kubernetes") stays usable: every object passes the
strict Kubernetes schemas (the InferencePool its CRD's), the sidecar's arguments parse as ``kv-epp pd-sidecar``'s,
and the parts agree: the pool's target port is the sidecar's port and the prefill engines' port, the decode
engine listens where the sidecar sends, the role labels are llm-d's and the pool selects both roles."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

from picker.pdsidecar.options import options
from picker.runtime.cli import build_parser
from picker.shared.discovery.model import ROLE_LABEL, role_of

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "pd" / "model-servers.yaml"
CRD = ROOT / "tests" / "data" / "crds" / "inference.networking.k8s.io_inferencepools.yaml"
KUBERNETES = "1.35.0"


def objects() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d]


def by_kind(kind: str) -> list[dict[str, Any]]:
    return [o for o in objects() if o["kind"] == kind]


def flag(args: list[str], name: str) -> str:
    (value,) = [a.split("=", 1)[1] for a in args if a.startswith(name + "=")]
    return value


def test_every_object_passes_its_schema() -> None:
    crd = yaml.safe_load(CRD.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    pool_schema = jsonschema.Draft7Validator(version["schema"]["openAPIV3Schema"])
    kinds = []
    for obj in objects():
        kinds.append(obj["kind"])
        if obj["kind"] == "InferencePool":
            pool_schema.validate(obj)
        else:
            kubernetes_validate.validate(obj, KUBERNETES, strict=True)
    assert sorted(kinds) == ["Deployment", "Deployment", "InferencePool", "Role", "RoleBinding", "ServiceAccount"]


def test_the_parts_agree() -> None:
    (pool,) = by_kind("InferencePool")
    (target,) = [p["number"] for p in pool["spec"]["targetPorts"]]
    selector = pool["spec"]["selector"]["matchLabels"]
    roles = {}
    for d in by_kind("Deployment"):
        labels = d["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items()  # the pool selects every model server
        role = role_of(labels[ROLE_LABEL])
        assert role == labels[ROLE_LABEL]  # a role value the picker knows as it is
        containers = {c["name"]: c for c in d["spec"]["template"]["spec"]["containers"]}
        roles[role] = containers
    prefill_engine = roles["prefill"]["vllm"]["args"]
    assert flag(prefill_engine, "--port") == str(target)  # a prefill endpoint is its engine
    sidecar = roles["decode"]["pd-sidecar"]
    assert sidecar["command"] == ["kv-epp"]
    args = build_parser().parse_args(sidecar["args"])
    opts = options(args)
    assert opts.port == target  # a decode endpoint is its sidecar
    assert flag(roles["decode"]["vllm"]["args"], "--port") == str(opts.model_server_port)
    ref = opts.inference_pool
    assert ref is not None and (ref.namespace, ref.name) == (pool["metadata"]["namespace"], pool["metadata"]["name"])
    (role,) = by_kind("Role")
    assert {"pods", "inferencepools"} == {r for rule in role["rules"] for r in rule["resources"]}
    decode_pod = by_kind("Deployment")[1]["spec"]["template"]["spec"]
    assert decode_pod["serviceAccountName"] == "pd-sidecar" and decode_pod["automountServiceAccountToken"] is True
