"""What the InferencePool watcher reads of the API's objects: an InferencePool's spec (its pods' label selector
and target ports), a pod (its IP, whether it is being deleted, its Ready condition, its annotations), an
InferenceObjective (its name, its pool and its priority) and an InferenceModelRewrite (its name, age, pool and
rules). See docs/picker.md, "Pool discovery", docs/flow-control.md, "Flows, priorities and bands", and
docs/llm-d-compat.md, "InferenceModelRewrite".
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from picker.shared.config_files import BACKEND_NAME_RE
from picker.shared.discovery.model import ROLE_LABEL, role_of


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
    role: str = "both"  # P/D: its llm-d.ai/role label (model.role_of)

    @property
    def published(self) -> bool:
        """The pod is a backend of the snapshot (ready or not): it has an IP and is not being deleted."""
        return self.ip is not None and not self.terminating

    @property
    def live(self) -> bool:
        """Published and Ready: a backend the picker routes to."""
        return self.published and self.ready

    def view(self) -> tuple[str, bool, tuple[tuple[str, str], ...], str] | None:
        """What the published backends depend on: nothing unless published."""
        if self.ip is None or self.terminating:
            return None
        return (self.ip, self.ready, self.annotations, self.role)


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
    labels = meta.get("labels")
    role = role_of(str(labels.get(ROLE_LABEL) or "")) if isinstance(labels, dict) else "both"
    # A pod that has ended (Failed, e.g. Evicted, or Succeeded) keeps its podIP until it is garbage-collected,
    # and that IP may already belong to another pod: it counts as gone, like a terminating one (as in
    # EndpointSlices).
    ended = status.get("phase") in ("Failed", "Succeeded")
    return name, Pod(ip, ready, ended or bool(meta.get("deletionTimestamp")), annotations, role)


POOL_GROUP = "inference.networking.k8s.io"  # an InferenceObjective's spec.poolRef.group default
POOL_KIND = "InferencePool"  # its spec.poolRef.kind default
OBJECTIVE_NAME_MAX = 253  # a Kubernetes object name
INT32_MIN, INT32_MAX = -(1 << 31), (1 << 31) - 1  # spec.priority is an int32


class BadPoolObject(ValueError):
    """An object of the pool (an InferenceObjective, an InferenceModelRewrite) that cannot be read (the CRD's
    validation should make this unreachable); ``name`` is its metadata.name when that much could be read."""

    def __init__(self, message: str, name: str | None = None) -> None:
        super().__init__(message)
        self.name = name


class BadObjective(BadPoolObject):
    """An InferenceObjective that cannot be read."""


class BadModelRewrite(BadPoolObject):
    """An InferenceModelRewrite that cannot be read."""


def _pool_object_head(obj: Mapping[str, Any], pool: str, what: str, bad: type[BadPoolObject]) -> tuple[str, Any]:
    """(name, spec) of a namespaced object that names its InferencePool in ``spec.poolRef``; spec None when the
    object is not for ``pool`` (another pool, or a group or kind other than the InferencePool's) or is being
    deleted. ``bad`` naming the field when the head is malformed."""
    if not isinstance(obj, Mapping):
        raise bad(f"{what}: not an object but {type(obj).__name__}")
    meta = obj.get("metadata")
    meta = meta if isinstance(meta, dict) else {}
    name = meta.get("name")
    if not isinstance(name, str) or not 0 < len(name) <= OBJECTIVE_NAME_MAX:
        raise bad(f"{what}: metadata.name {name!r} is not an object name")
    if meta.get("deletionTimestamp"):
        return name, None
    spec = obj.get("spec")
    ref = spec.get("poolRef") if isinstance(spec, dict) else None
    if not isinstance(spec, dict) or not isinstance(ref, dict):
        raise bad(f"{what} {name}: spec.poolRef is missing or not an object", name)
    ref_name, group, kind = ref.get("name"), ref.get("group", POOL_GROUP), ref.get("kind", POOL_KIND)
    if not isinstance(ref_name, str) or not ref_name or not isinstance(group, str) or not isinstance(kind, str):
        raise bad(f"{what} {name}: spec.poolRef name, group or kind is not a string", name)
    if (ref_name, group, kind) != (pool, POOL_GROUP, POOL_KIND):
        return name, None
    return name, spec


def parse_objective(obj: Mapping[str, Any], pool: str) -> tuple[str, int | None]:
    """(name, priority) of an ``llm-d.ai/v1alpha2`` InferenceObjective for the InferencePool named ``pool`` in its
    namespace: the priority is ``spec.priority``, 0 when unset (as llm-d reads it), None when the object is not
    for this pool (``spec.poolRef`` names another pool, or a group or kind other than the InferencePool's) or is
    being deleted. BadObjective naming the field when it is malformed."""
    name, spec = _pool_object_head(obj, pool, "inferenceobjective", BadObjective)
    if spec is None:
        return name, None
    priority = spec.get("priority")
    if priority is None:
        return name, 0
    if not isinstance(priority, int) or isinstance(priority, bool) or not INT32_MIN <= priority <= INT32_MAX:
        raise BadObjective(f"inferenceobjective {name}: spec.priority {priority!r} is not an int32", name)
    return name, priority


MODEL_NAME_MAX = 1024  # a model name in a rewrite (a match's value, a target); Hugging Face ids are far shorter
MAX_REWRITE_RULES = 256  # rules of one InferenceModelRewrite; more is refused as malformed
MAX_RULE_ITEMS = 256  # matches, and targets, of one rule; more is refused as malformed
MAX_REWRITE_WEIGHT = 1_000_000  # the CRD's bound of a target's weight


@dataclass(frozen=True, slots=True)
class RewriteTarget:
    """One weighted target of a rule: the model a request is rewritten to. ``weight`` None: unset (every target
    of a rule unweighted: an even split; some weighted: an unweighted one is never chosen, as llm-d does)."""

    model: str
    weight: int | None = None


@dataclass(frozen=True, slots=True)
class RewriteRule:
    """A rule: the exact model names it matches (empty: a generic rule, for any model no exact rule matches) and
    its weighted targets (at least one)."""

    models: tuple[str, ...]
    targets: tuple[RewriteTarget, ...]


@dataclass(frozen=True, slots=True)
class ModelRewrite:
    """An InferenceModelRewrite (watched, or from the config's ``model_rewrites``): its name, its age (``created``:
    metadata.creationTimestamp as a POSIX time, None for a config entry, which counts as older than any object)
    and its rules in order."""

    name: str
    rules: tuple[RewriteRule, ...]
    created: float | None = None


def parse_model_rewrite(obj: Mapping[str, Any], pool: str) -> tuple[str, ModelRewrite | None]:
    """(name, rewrite) of an ``llm-d.ai/v1alpha2`` InferenceModelRewrite for the InferencePool named ``pool`` in its
    namespace; rewrite None when it is not for this pool or is being deleted (as ``parse_objective``).
    BadModelRewrite naming the field when it is malformed: a rule without targets, a match type other than
    ``Exact``, a weight outside 1..1,000,000, an empty model name, more than MAX_REWRITE_RULES rules or
    MAX_RULE_ITEMS matches or targets in a rule."""
    what = "inferencemodelrewrite"
    name, spec = _pool_object_head(obj, pool, what, BadModelRewrite)
    if spec is None:
        return name, None

    def bad(field: str, why: str) -> BadModelRewrite:
        return BadModelRewrite(f"{what} {name}: {field} {why}", name)

    meta = obj.get("metadata")
    stamp = meta.get("creationTimestamp") if isinstance(meta, dict) else None
    created: float | None = float("inf")  # unknown: the youngest (the API server always sets it)
    if stamp is not None:
        try:
            created = datetime.fromisoformat(str(stamp)).timestamp()
        except ValueError:
            raise bad("metadata.creationTimestamp", f"{str(stamp)[:64]!r} is not an RFC 3339 time") from None
    rules = spec.get("rules")
    if not isinstance(rules, list) or len(rules) > MAX_REWRITE_RULES:
        raise bad("spec.rules", f"must be a list of at most {MAX_REWRITE_RULES} rules")
    out: list[RewriteRule] = []
    for i, rule in enumerate(rules):
        at = f"spec.rules[{i}]"
        if not isinstance(rule, dict):
            raise bad(at, "is not an object")
        matches = rule.get("matches") or []
        if not isinstance(matches, list) or len(matches) > MAX_RULE_ITEMS:
            raise bad(f"{at}.matches", f"must be a list of at most {MAX_RULE_ITEMS} matches")
        models: list[str] = []
        for j, m in enumerate(matches):
            model = m.get("model") if isinstance(m, dict) else None
            if not isinstance(model, dict):
                raise bad(f"{at}.matches[{j}].model", "is missing or not an object")
            if model.get("type", "Exact") != "Exact":
                raise bad(f"{at}.matches[{j}].model.type", f"{model.get('type')!r} is not supported (only Exact)")
            models.append(_model_name(model.get("value"), f"{at}.matches[{j}].model.value", bad))
        targets = rule.get("targets")
        if not isinstance(targets, list) or not 0 < len(targets) <= MAX_RULE_ITEMS:
            raise bad(f"{at}.targets", f"must list 1 to {MAX_RULE_ITEMS} targets")
        parsed: list[RewriteTarget] = []
        for j, t in enumerate(targets):
            if not isinstance(t, dict):
                raise bad(f"{at}.targets[{j}]", "is not an object")
            weight = t.get("weight")
            if weight is not None and (
                not isinstance(weight, int) or isinstance(weight, bool) or not 1 <= weight <= MAX_REWRITE_WEIGHT
            ):
                raise bad(f"{at}.targets[{j}].weight", f"{weight!r} is not an integer in 1..{MAX_REWRITE_WEIGHT}")
            target = _model_name(t.get("modelRewrite"), f"{at}.targets[{j}].modelRewrite", bad)
            parsed.append(RewriteTarget(target, weight))
        out.append(RewriteRule(tuple(dict.fromkeys(models)), tuple(parsed)))
    return name, ModelRewrite(name, tuple(out), created)


def _model_name(value: Any, field: str, bad: Any) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MODEL_NAME_MAX:
        raise bad(field, f"must be a model name of 1 to {MODEL_NAME_MAX} characters")
    return value


def _object_or_none(value: Any, field: str) -> Mapping[str, Any]:
    """A JSON object field: missing or null reads as empty; any other type is a ValueError naming the field."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{field} is not an object but {type(value).__name__}")
    return value
