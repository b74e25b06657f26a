"""What discovery reads of the API's objects, malformed ones included: an InferencePool's spec is refused with
the path of its bad field, a pod is parsed without raising whatever its status holds (only an unusable name is
refused), what a pod contributes to the published backends, and the priority an InferenceObjective gives our
pool (none for another pool's; a malformed one refused with its field and, when known, its name). The basic
live/ready cases and the first refusals are in test_kube_access.py."""

from __future__ import annotations

import re
from typing import Any

import pytest

from picker.shared.discovery.kube_objects import BadObjective, BadPool, Pod, parse_objective, parse_pod, parse_pool_spec

READY = [{"type": "Ready", "status": "True"}]


def pool(labels: Any = None, ports: Any = None) -> dict[str, Any]:
    return {
        "spec": {
            "selector": {"matchLabels": {"app": "vllm"} if labels is None else labels},
            "targetPorts": [{"number": 8000}] if ports is None else ports,
        }
    }


def pod(name: Any = "vllm-0", meta: Any = None, **status: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, **(meta or {})}, "status": status}


@pytest.mark.parametrize(
    ("obj", "where"),
    [
        ({}, "spec: missing"),
        ({"spec": "x"}, "spec: missing"),
        ({"spec": {"selector": "app=vllm", "targetPorts": [{"number": 1}]}}, "spec.selector.matchLabels: missing"),
        (pool(labels={}), "spec.selector.matchLabels: missing or empty"),  # would select every pod
        (pool(labels={"app": 1}), "spec.selector.matchLabels.app:"),
        (pool(labels={"app!": "x"}), "spec.selector.matchLabels.app!:"),
        (pool(labels={"app": "a=b"}), "spec.selector.matchLabels.app:"),
        (pool(ports={"number": 8000}), "spec.targetPorts: must list 1 to 8 ports"),
        (pool(ports=[{"number": 8000 + i} for i in range(9)]), "spec.targetPorts: must list 1 to 8 ports"),
        (pool(ports=[8000]), "spec.targetPorts[0].number"),
        (pool(ports=[{"number": "8000"}]), "spec.targetPorts[0].number"),
        (pool(ports=[{"number": True}]), "spec.targetPorts[0].number"),  # a bool is an int to Python, not a port
        (pool(ports=[{"number": 8000}, {"number": 65536}]), "spec.targetPorts[1].number"),
        (pool(ports=[{"number": 0}]), "spec.targetPorts[0].number"),
    ],
)
def test_a_pool_spec_that_cannot_be_used_is_refused_naming_the_field(obj: dict[str, Any], where: str) -> None:
    with pytest.raises(BadPool, match="^" + re.escape(where)):
        parse_pool_spec(obj)


def test_a_pool_spec_keeps_its_ports_in_order_and_its_selector_sorted() -> None:
    spec = parse_pool_spec(pool(labels={"tier": "gpu", "app": "vllm"}, ports=[{"number": 8001}, {"number": 8000}]))
    assert spec.target_ports == (8001, 8000)  # the port's index is the backend's rank
    assert spec.label_selector == "app=vllm,tier=gpu"
    assert spec == parse_pool_spec(
        pool(labels={"app": "vllm", "tier": "gpu"}, ports=[{"number": 8001}, {"number": 8000}])
    )


@pytest.mark.parametrize(
    ("pod_ip", "ip"),
    [("10.0.0.7", "10.0.0.7"), ("fd00:0:0::7", "fd00::7"), ("FD00::A", "fd00::a"), ("", None), ("10.0.0.300", None)],
)
def test_a_pods_ip_is_kept_in_canonical_form_and_an_unusable_one_is_no_ip(pod_ip: str, ip: str | None) -> None:
    assert parse_pod(pod(podIP=pod_ip))[1].ip == ip


@pytest.mark.parametrize("phase", ["Failed", "Succeeded"])
def test_an_ended_pod_is_not_published_even_with_its_ip_and_ready_condition(phase: str) -> None:
    """An evicted pod keeps its podIP until garbage-collected, and another pod may already have that IP."""
    _, p = parse_pod(pod(podIP="10.0.0.7", conditions=READY, phase=phase))
    assert p.terminating and not p.published and not p.live and p.view() is None
    assert parse_pod(pod(podIP="10.0.0.7", conditions=READY, phase="Running"))[1].live


@pytest.mark.parametrize(
    "obj",
    [
        {"metadata": {"name": "vllm-0"}},  # no status at all
        {"metadata": {"name": "vllm-0"}, "status": None},
        pod(conditions=None),
        pod(podIP="10.0.0.7", conditions=["Ready", None, {"type": "Ready"}, {"status": "True"}]),
        pod(podIP="10.0.0.7", conditions=[{"type": "Ready", "status": True}]),  # the API's status is the string "True"
        pod(meta={"annotations": None}, podIP="10.0.0.7"),
    ],
)
def test_a_malformed_status_is_a_pod_that_is_not_ready_never_an_error(obj: dict[str, Any]) -> None:
    name, p = parse_pod(obj)
    assert name == "vllm-0" and not p.ready and not p.live


def test_annotations_are_kept_sorted_as_strings_and_a_malformed_map_is_none() -> None:
    _, p = parse_pod(pod(meta={"annotations": {"z": "1", "a": 2}}, podIP="10.0.0.7"))
    assert p.annotations == (("a", "2"), ("z", "1"))
    assert parse_pod(pod(meta={"annotations": ["a=1"]}, podIP="10.0.0.7"))[1].annotations == ()


@pytest.mark.parametrize("obj", [{}, {"metadata": None}, pod(name=None), pod(name=7), pod(name=""), pod(name=".x")])
def test_a_pod_without_a_usable_name_is_refused(obj: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="is not a usable backend name"):
        parse_pod(obj)


def test_what_the_published_backends_depend_on_changes_with_readiness_but_not_while_unpublished() -> None:
    ready = Pod("10.0.0.7", True, False, ())
    unready = Pod("10.0.0.7", False, False, ())
    assert ready.view() != unready.view()  # a ready flip is republished (the picker routes by it)
    assert unready.published and not unready.live
    gone = (Pod("10.0.0.7", True, True, ()), Pod(None, True, False, ()), Pod(None, False, True, ()))
    assert {p.view() for p in gone} == {None}  # terminating or without an IP: not a backend whatever else changes


@pytest.mark.parametrize(
    "obj",
    [{"metadata": "vllm-0"}, pod(conditions=5), {"metadata": {"name": "vllm-0"}, "status": "Running"}],
)
def test_a_pod_whose_metadata_or_status_has_the_wrong_type_is_refused_like_a_bad_name(obj: dict[str, Any]) -> None:
    try:
        parse_pod(obj)
    except ValueError:
        return
    # parsed: then it must at least be a pod that is not routed to
    assert not parse_pod(obj)[1].live


# -- InferenceObjectives -----------------------------------------------------------------------------------------

POOL_NAME = "vllm"


def objective(name: Any = "chat", priority: Any = 5, **ref: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"poolRef": {"name": POOL_NAME, **ref}}
    if priority is not None:
        spec["priority"] = priority
    return {"apiVersion": "llm-d.ai/v1alpha2", "kind": "InferenceObjective", "metadata": {"name": name}, "spec": spec}


@pytest.mark.parametrize(
    ("obj", "parsed"),
    [
        (objective(), ("chat", 5)),
        (objective(priority=-10), ("chat", -10)),
        (objective(priority=None), ("chat", 0)),  # unset: 0, as llm-d reads it
        (objective(priority=(1 << 31) - 1), ("chat", (1 << 31) - 1)),
        (objective(group="inference.networking.k8s.io", kind="InferencePool"), ("chat", 5)),  # the defaults, spelt
        (objective(name="batch", group="inference.networking.x-k8s.io"), ("batch", None)),  # another group's pool
        (objective(kind="Service"), ("chat", None)),
        (objective(group=""), ("chat", None)),
        ({**objective(), "spec": {"poolRef": {"name": "other"}, "priority": 5}}, ("chat", None)),  # another pool
        ({**objective(), "spec": {"poolRef": {"name": "other"}, "priority": "x"}}, ("chat", None)),  # not ours to judge
        ({**objective(), "metadata": {"name": "chat", "deletionTimestamp": "2026-01-01T00:00:00Z"}}, ("chat", None)),
    ],
)
def test_an_objective_gives_its_priority_for_our_pool_only(obj: dict[str, Any], parsed: tuple[str, int | None]) -> None:
    assert parse_objective(obj, POOL_NAME) == parsed


@pytest.mark.parametrize(
    ("obj", "name", "says"),
    [
        ([1], None, "not an object but list"),
        ({"spec": {}}, None, "metadata.name None is not an object name"),
        ({"metadata": [], "spec": {}}, None, "metadata.name None"),
        (objective(name=""), None, "metadata.name '' is not an object name"),
        (objective(name="x" * 254), None, "is not an object name"),
        (objective(name=7), None, "metadata.name 7"),
        ({"metadata": {"name": "chat"}}, "chat", "inferenceobjective chat: spec.poolRef is missing or not an object"),
        ({"metadata": {"name": "chat"}, "spec": {"poolRef": "vllm"}}, "chat", "spec.poolRef is missing"),
        ({"metadata": {"name": "chat"}, "spec": []}, "chat", "spec.poolRef is missing"),
        ({"metadata": {"name": "chat"}, "spec": {"poolRef": {}}}, "chat", "name, group or kind is not a string"),
        (objective(group=None), "chat", "name, group or kind is not a string"),
        (objective(priority="5"), "chat", "spec.priority '5' is not an int32"),
        (objective(priority=True), "chat", "spec.priority True is not an int32"),
        (objective(priority=1.5), "chat", "spec.priority 1.5 is not an int32"),
        (objective(priority=1 << 31), "chat", f"spec.priority {1 << 31} is not an int32"),
        (objective(priority=-(1 << 31) - 1), "chat", "is not an int32"),
    ],
)  # fmt: skip
def test_a_malformed_objective_is_refused_naming_the_field_and_its_name_when_known(
    obj: Any, name: str | None, says: str
) -> None:
    with pytest.raises(BadObjective, match=re.escape(says)) as caught:
        parse_objective(obj, POOL_NAME)
    assert caught.value.name == name and isinstance(caught.value, ValueError)
