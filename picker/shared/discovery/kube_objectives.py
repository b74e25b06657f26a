"""Objects of the pool that llm-d declares as custom resources, listed and watched in the pool's namespace with the
list/watch machinery of ``kubernetes.KubeFollower`` (pages, bookmarks, 410 resyncs, stall detection, backoff):
``PoolObjectWatch`` publishes ``{name: value}`` of those whose ``spec.poolRef`` is the pool. Here its first use,
``KubernetesObjectiveWatch``: the ``llm-d.ai/v1alpha2`` InferenceObjectives as ``{objective name: priority}``, which
flow control reads (docs/flow-control.md, "Flows, priorities and bands"); ``kube_rewrites`` follows the
InferenceModelRewrites with it.

A watch runs beside the pool's discovery, never inside it: an error here (the CRD not installed, RBAC refusing it,
a malformed object) is counted and logged and changes nothing of the pool.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

import httpx2

from picker.shared.discovery.config import InferencePoolRef
from picker.shared.discovery.kube_access import SERVICE_ACCOUNT_DIR
from picker.shared.discovery.kube_objects import BadPoolObject, parse_objective
from picker.shared.discovery.kubernetes import KubeFollower, api_error_code
from picker.shared.discovery.model import Count

log = logging.getLogger("kv_epp.discovery")

OBJECTIVES_API = "apis/llm-d.ai/v1alpha2"
MAX_OBJECTIVES = 10_000  # objectives of the pool kept; one past it is ignored, counted "over_limit" and logged
LOG_EVERY = 1000  # log the first malformed object, then every this many

V = TypeVar("V")
PublishObjectives = Callable[[dict[str, int]], None]


class PoolObjectWatch(KubeFollower, Generic[V]):
    """Follows the objects of one ``llm-d.ai/v1alpha2`` resource (``plural``) whose ``spec.poolRef`` is the
    InferencePool ``ref`` names, and publishes ``{name: value}`` (a new dict at each change, after the first
    complete list; ``_parse`` reads an object's value). A 404 on the resource (the CRD is not installed) publishes
    ``{}``, is logged once (again only after it was found) and retried with the backoff.

    Bounds: at most ``max_objects`` objects; one list page is LIST_PAGE_SIZE objects. Counters ("list", "watch",
    "watch_event", "bookmark", "gone", "resync", "resync_backoff", "watch_stalled", "error", "not_found",
    "malformed", "over_limit") go to ``count`` prefixed ``count_prefix`` and to ``status()``."""

    plural = ""  # the resource: inferenceobjectives, ...
    noun = ""  # status()'s key for the count of objects kept, and of those ignored past the bound (<noun>_ignored)
    crd_kind = ""  # for the log of a missing CRD
    without_crd = ""  # what the picker does without the CRD, for that log

    def __init__(
        self,
        ref: InferencePoolRef,
        publish: Callable[[dict[str, V]], None],
        count: Count | None = None,
        *,
        service_account_dir: str = SERVICE_ACCOUNT_DIR,
        max_objects: int,
    ) -> None:
        super().__init__(ref, count, service_account_dir)
        self._publish = publish
        self._max = max_objects
        self._objects: dict[str, V] = {}
        self._published: dict[str, V] | None = None  # None: nothing published yet
        self._listed = False  # a complete list was read (or the CRD is known to be absent)
        self._found: bool | None = None  # the resource is served (None: not asked yet)
        self._rv = ""
        self._malformed = 0

    def parse_object(self, obj: Mapping[str, Any]) -> tuple[str, V | None]:
        """(name, value) of an object; value None when it is not for this pool. BadPoolObject when malformed."""
        raise NotImplementedError

    @property
    def source(self) -> str:
        return f"{self.plural} {self._namespace or '?'} poolRef={self._ref.name}"

    def status(self) -> dict[str, object]:
        return {
            "source": self.source,
            "synced": self._listed and self._found is True,
            "crd_found": self._found,
            self.noun: len(self._objects),
            f"{self.noun}_ignored": self._ignored,
            "malformed": self._malformed,
            "resource_version": self._rv,
            "last_error": self._last_error,
            "counts": dict(self._counts),
        }

    async def run(self) -> None:
        """For ever; an error is retried, never raised (this must not stop beside the pool's discovery)."""
        await self._connected(self._follow)

    def _path(self) -> str:
        return f"{OBJECTIVES_API}/namespaces/{self._namespace}/{self.plural}"

    async def _follow(self, http: httpx2.AsyncClient) -> None:
        listed_once = False

        async def relist() -> str:
            nonlocal listed_once
            if listed_once:
                self._count("resync")
            rv = await self._list(http)
            listed_once = True
            return rv

        await self._list_watch(http, self.plural, self._path(), {}, relist, self._on_event)

    async def _list(self, http: httpx2.AsyncClient) -> str:
        objects: dict[str, V] = {}
        ignored = 0

        def take(item: Any) -> None:
            nonlocal ignored
            name, value = self._parse(item)
            if name is None or value is None:
                return
            if name not in objects and len(objects) >= self._max:
                ignored += 1
                return
            objects[name] = value

        rv = await self._list_all(http, self._path(), {}, take)
        self._count("list")
        if self._found is False:
            log.info("event=%s_found source=%r", self.plural, self.source)
        self._found, self._listed = True, True
        self._objects, self._rv, self._ignored = objects, rv, 0
        for _ in range(ignored):
            self._over_limit()
        self._ok()
        self._flush()
        return rv

    def _on_event(self, etype: str, obj: dict[str, Any], rv: str) -> None:
        self._rv = rv
        if etype == "BOOKMARK":
            return
        name, value = self._parse(obj)
        if name is None:
            return
        if etype == "DELETED" or value is None:  # gone, moved to another pool, or malformed: not ours
            if self._objects.pop(name, None) is not None:
                self._schedule_flush()
            return
        if name not in self._objects and len(self._objects) >= self._max:
            self._over_limit()
            return
        if self._objects.get(name) != value:
            self._objects[name] = value
            self._schedule_flush()

    def _parse(self, obj: Any) -> tuple[str | None, V | None]:
        """(name, value) of an object; (name or None, None) when it is not ours or malformed (counted, logged)."""
        try:
            return self.parse_object(obj)
        except BadPoolObject as exc:
            self._malformed += 1
            self._count("malformed")
            if self._malformed % LOG_EVERY == 1 or LOG_EVERY == 1:
                log.warning(
                    "event=%s_malformed source=%r error=%r malformed=%d (skipped)",
                    self.plural[:-1],
                    self.source,
                    str(exc),
                    self._malformed,
                )
            return exc.name, None

    def _over_limit(self) -> None:
        self._ignore_one("over_limit", f"{self.plural}_over_limit", f"max_{self.noun}", self._max)

    def _on_error(self, what: str, exc: Exception) -> None:
        if api_error_code(exc) != 404:
            super()._on_error(what, exc)
            return
        self._count("not_found")
        self._last_error = f"{what} of {self.source}: not found (is the {self.crd_kind} CRD installed?)"
        if self._found is not False:  # once, until it is found again
            log.warning(
                "event=%s_not_found source=%r (the %s CRD is not installed, or not llm-d.ai/v1alpha2: %s; retrying)",
                self.plural,
                self.source,
                self.crd_kind,
                self.without_crd,
            )
        self._found, self._listed = False, True
        self._objects, self._ignored = {}, 0
        self._flush()

    def _flush(self) -> None:
        self._flush_pending = False
        if not self._listed or self._objects == self._published:
            return
        self._published = dict(self._objects)
        self._hand_over(self._publish, dict(self._objects))


class KubernetesObjectiveWatch(PoolObjectWatch[int]):
    """Follows the InferenceObjectives of the InferencePool ``ref`` names and publishes ``{name: priority}``
    (``PoolObjectWatch``; unset priority: 0). Bound: at most ``max_objectives`` objectives. Counters are prefixed
    ``objectives_``."""

    count_prefix = "objectives_"
    plural = "inferenceobjectives"
    noun = "objectives"
    crd_kind = "InferenceObjective"
    without_crd = "priorities come from flow_control.objectives only"

    def __init__(
        self,
        ref: InferencePoolRef,
        publish: PublishObjectives,
        count: Count | None = None,
        *,
        service_account_dir: str = SERVICE_ACCOUNT_DIR,
        max_objectives: int = MAX_OBJECTIVES,
    ) -> None:
        super().__init__(ref, publish, count, service_account_dir=service_account_dir, max_objects=max_objectives)

    def parse_object(self, obj: Mapping[str, Any]) -> tuple[str, int | None]:
        return parse_objective(obj, self._ref.name)


__all__ = ["MAX_OBJECTIVES", "KubernetesObjectiveWatch", "PoolObjectWatch", "PublishObjectives"]
