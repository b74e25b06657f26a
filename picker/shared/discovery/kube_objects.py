"""What the InferencePool watcher reads of the API's objects: an InferencePool's spec (its pods' label selector
and target ports), a pod (its IP, whether it is being deleted, its Ready condition, its annotations) and an
InferenceObjective (its name, its pool and its priority). See docs/picker.md, "Pool discovery", and
docs/flow-control.md, "Flows, priorities and bands".
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from picker.shared.config_files import BACKEND_NAME_RE


class BadPool(Exception):
    """The InferencePool's spec cannot be used (the CRD's validation should make this unreachable)."""


@dataclass(frozen=True, slots=True)
class PoolSpec:
    match_labels: tuple[tuple[str, str], ...]  # sorted by key
    target_ports: tuple[int, ...]

    @property
    def label_selector(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.match_labels)


def parse_pool_spec(obj: Mapping[str, Any]) -> PoolSpec:
    """The selector and ports of an InferencePool object; BadPool naming the bad field."""
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        raise BadPool("spec: missing")
    selector = spec.get("selector")
    labels = selector.get("matchLabels") if isinstance(selector, dict) else None
    if not isinstance(labels, dict) or not labels:
        raise BadPool("spec.selector.matchLabels: missing or empty (a pool selecting every pod is refused)")
    for k, v in labels.items():
        if not isinstance(k, str) or not isinstance(v, str) or "," in k + v or "=" in k + v or "!" in k:
            raise BadPool(f"spec.selector.matchLabels.{k}: not a label key and value")
    ports = spec.get("targetPorts")
    if not isinstance(ports, list) or not 1 <= len(ports) <= 8:
        raise BadPool("spec.targetPorts: must list 1 to 8 ports")
    numbers: list[int] = []
    for i, p in enumerate(ports):
        n = p.get("number") if isinstance(p, dict) else None
        if not isinstance(n, int) or isinstance(n, bool) or not 0 < n < 65536 or n in numbers:
            raise BadPool(f"spec.targetPorts[{i}].number: must be a unique port in 1..65535")
        numbers.append(n)
    return PoolSpec(tuple(sorted(labels.items())), tuple(numbers))


@dataclass(frozen=True, slots=True)
class Pod:
    ip: str | None  # None: no usable IP yet
    ready: bool  # its Ready condition is True
    terminating: bool  # metadata.deletionTimestamp is set
    annotations: tuple[tuple[str, str], ...]

    @property
    def published(self) -> bool:
        """The pod is a backend of the snapshot (ready or not): it has an IP and is not being deleted."""
        return self.ip is not None and not self.terminating

    @property
    def live(self) -> bool:
        """Published and Ready: a backend the picker routes to."""
        return self.published and self.ready

    def view(self) -> tuple[str, bool, tuple[tuple[str, str], ...]] | None:
        """What the published backends depend on: nothing unless published."""
        return (self.ip, self.ready, self.annotations) if self.ip is not None and not self.terminating else None


def parse_pod(obj: Mapping[str, Any]) -> tuple[str, Pod]:
    """(pod name, what discovery keeps of it); ValueError when the object has no usable name, or its metadata,
    status or status.conditions has the wrong JSON type (named)."""
    if not isinstance(obj, Mapping):
        raise ValueError(f"pod: not an object but {type(obj).__name__}")
    meta = _object_or_none(obj.get("metadata"), "pod metadata")
    name = meta.get("name")
    if not isinstance(name, str) or not BACKEND_NAME_RE.fullmatch(name):
        raise ValueError(f"pod name {name!r} is not a usable backend name")
    status = _object_or_none(obj.get("status"), f"pod {name}: status")
    ip: str | None = status.get("podIP") or None
    if ip is not None:
        try:
            ip = str(ipaddress.ip_address(ip))
        except ValueError:
            ip = None
    conditions = status.get("conditions")
    if conditions is None:
        conditions = ()
    elif not isinstance(conditions, list):
        raise ValueError(f"pod {name}: status.conditions is not a list but {type(conditions).__name__}")
    ready = any(isinstance(c, dict) and c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    raw = meta.get("annotations") or {}
    annotations = tuple(sorted((str(k), str(v)) for k, v in raw.items())) if isinstance(raw, dict) else ()
    # A pod that has ended (Failed, e.g. Evicted, or Succeeded) keeps its podIP until it is garbage-collected,
    # and that IP may already belong to another pod: it counts as gone, like a terminating one (as in
    # EndpointSlices).
    ended = status.get("phase") in ("Failed", "Succeeded")
    return name, Pod(ip, ready, ended or bool(meta.get("deletionTimestamp")), annotations)


POOL_GROUP = "inference.networking.k8s.io"  # an InferenceObjective's spec.poolRef.group default
POOL_KIND = "InferencePool"  # its spec.poolRef.kind default
OBJECTIVE_NAME_MAX = 253  # a Kubernetes object name
INT32_MIN, INT32_MAX = -(1 << 31), (1 << 31) - 1  # spec.priority is an int32


class BadObjective(ValueError):
    """An InferenceObjective that cannot be read (the CRD's validation should make this unreachable); ``name`` is
    its metadata.name when that much could be read."""

    def __init__(self, message: str, name: str | None = None) -> None:
        super().__init__(message)
        self.name = name


def parse_objective(obj: Mapping[str, Any], pool: str) -> tuple[str, int | None]:
    """(name, priority) of an ``llm-d.ai/v1alpha2`` InferenceObjective for the InferencePool named ``pool`` in its
    namespace: the priority is ``spec.priority``, 0 when unset (as llm-d reads it), None when the object is not
    for this pool (``spec.poolRef`` names another pool, or a group or kind other than the InferencePool's) or is
    being deleted. BadObjective naming the field when it is malformed."""
    if not isinstance(obj, Mapping):
        raise BadObjective(f"inferenceobjective: not an object but {type(obj).__name__}")
    meta = obj.get("metadata")
    meta = meta if isinstance(meta, dict) else {}
    name = meta.get("name")
    if not isinstance(name, str) or not 0 < len(name) <= OBJECTIVE_NAME_MAX:
        raise BadObjective(f"inferenceobjective: metadata.name {name!r} is not an object name")
    if meta.get("deletionTimestamp"):
        return name, None
    spec = obj.get("spec")
    ref = spec.get("poolRef") if isinstance(spec, dict) else None
    if not isinstance(spec, dict) or not isinstance(ref, dict):
        raise BadObjective(f"inferenceobjective {name}: spec.poolRef is missing or not an object", name)
    ref_name, group, kind = ref.get("name"), ref.get("group", POOL_GROUP), ref.get("kind", POOL_KIND)
    if not isinstance(ref_name, str) or not ref_name or not isinstance(group, str) or not isinstance(kind, str):
        raise BadObjective(f"inferenceobjective {name}: spec.poolRef name, group or kind is not a string", name)
    if (ref_name, group, kind) != (pool, POOL_GROUP, POOL_KIND):
        return name, None
    priority = spec.get("priority")
    if priority is None:
        return name, 0
    if not isinstance(priority, int) or isinstance(priority, bool) or not INT32_MIN <= priority <= INT32_MAX:
        raise BadObjective(f"inferenceobjective {name}: spec.priority {priority!r} is not an int32", name)
    return name, priority


def _object_or_none(value: Any, field: str) -> Mapping[str, Any]:
    """A JSON object field: missing or null reads as empty; any other type is a ValueError naming the field."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{field} is not an object but {type(value).__name__}")
    return value
