"""The InferenceObjectives of an InferencePool: list and watch ``llm-d.ai/v1alpha2`` InferenceObjective objects in
the pool's namespace (with the list/watch machinery of ``kubernetes.KubeFollower``: pages, bookmarks, 410 resyncs,
stall detection, backoff) and publish ``{objective name: priority}`` of those whose ``spec.poolRef`` is the pool.
Flow control reads the priorities from it (docs/flow-control.md, "Flows, priorities and bands").

It runs beside the pool's discovery, never inside it: an error here (the CRD not installed, RBAC refusing it, a
malformed object) is counted and logged and changes nothing of the pool.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import httpx2

from picker.shared.discovery.config import InferencePoolRef
from picker.shared.discovery.kube_access import SERVICE_ACCOUNT_DIR
from picker.shared.discovery.kube_objects import BadObjective, parse_objective
from picker.shared.discovery.kubernetes import KubeFollower, api_error_code
from picker.shared.discovery.model import Count

log = logging.getLogger("kv_epp.discovery")

OBJECTIVES_API = "apis/llm-d.ai/v1alpha2"
MAX_OBJECTIVES = 10_000  # objectives of the pool kept; one past it is ignored, counted "over_limit" and logged
LOG_EVERY = 1000  # log the first malformed object, then every this many

PublishObjectives = Callable[[dict[str, int]], None]


class KubernetesObjectiveWatch(KubeFollower):
    """Follows the InferenceObjectives of the InferencePool ``ref`` names and publishes ``{name: priority}`` (a new
    dict at each change, after the first complete list). Unset priority: 0. A 404 on the resource (the CRD is not
    installed) publishes ``{}``, is logged once (again only after it was found) and retried with the backoff.

    Bounds: at most ``max_objectives`` objectives; one list page is LIST_PAGE_SIZE objects. Counters ("list",
    "watch", "watch_event", "bookmark", "gone", "resync", "resync_backoff", "watch_stalled", "error", "not_found",
    "malformed", "over_limit") go to ``count`` prefixed ``objectives_`` and to ``status()``."""

    count_prefix = "objectives_"

    def __init__(
        self,
        ref: InferencePoolRef,
        publish: PublishObjectives,
        count: Count | None = None,
        *,
        service_account_dir: str = SERVICE_ACCOUNT_DIR,
        max_objectives: int = MAX_OBJECTIVES,
    ) -> None:
        super().__init__(ref, count, service_account_dir)
        self._publish = publish
        self._max = max_objectives
        self._objectives: dict[str, int] = {}
        self._published: dict[str, int] | None = None  # None: nothing published yet
        self._listed = False  # a complete list was read (or the CRD is known to be absent)
        self._found: bool | None = None  # the resource is served (None: not asked yet)
        self._rv = ""
        self._malformed = 0

    @property
    def source(self) -> str:
        return f"inferenceobjectives {self._namespace or '?'} poolRef={self._ref.name}"

    def status(self) -> dict[str, object]:
        return {
            "source": self.source,
            "synced": self._listed and self._found is True,
            "crd_found": self._found,
            "objectives": len(self._objectives),
            "objectives_ignored": self._ignored,
            "malformed": self._malformed,
            "resource_version": self._rv,
            "last_error": self._last_error,
            "counts": dict(self._counts),
        }

    async def run(self) -> None:
        """For ever; an error is retried, never raised (this must not stop beside the pool's discovery)."""
        await self._connected(self._follow)

    def _path(self) -> str:
        return f"{OBJECTIVES_API}/namespaces/{self._namespace}/inferenceobjectives"

    async def _follow(self, http: httpx2.AsyncClient) -> None:
        listed_once = False

        async def relist() -> str:
            nonlocal listed_once
            if listed_once:
                self._count("resync")
            rv = await self._list(http)
            listed_once = True
            return rv

        await self._list_watch(http, "inferenceobjectives", self._path(), {}, relist, self._on_event)

    async def _list(self, http: httpx2.AsyncClient) -> str:
        objectives: dict[str, int] = {}
        ignored = 0

        def take(item: Any) -> None:
            nonlocal ignored
            name, priority = self._parse(item)
            if name is None or priority is None:
                return
            if name not in objectives and len(objectives) >= self._max:
                ignored += 1
                return
            objectives[name] = priority

        rv = await self._list_all(http, self._path(), {}, take)
        self._count("list")
        if self._found is False:
            log.info("event=inferenceobjectives_found source=%r", self.source)
        self._found, self._listed = True, True
        self._objectives, self._rv, self._ignored = objectives, rv, 0
        for _ in range(ignored):
            self._over_limit()
        self._ok()
        self._flush()
        return rv

    def _on_event(self, etype: str, obj: dict[str, Any], rv: str) -> None:
        self._rv = rv
        if etype == "BOOKMARK":
            return
        name, priority = self._parse(obj)
        if name is None:
            return
        if etype == "DELETED" or priority is None:  # gone, moved to another pool, or malformed: not ours
            if self._objectives.pop(name, None) is not None:
                self._schedule_flush()
            return
        if name not in self._objectives and len(self._objectives) >= self._max:
            self._over_limit()
            return
        if self._objectives.get(name) != priority:
            self._objectives[name] = priority
            self._schedule_flush()

    def _parse(self, obj: Any) -> tuple[str | None, int | None]:
        """(name, priority) of an object; (name or None, None) when it is not ours or malformed (counted, logged)."""
        try:
            return parse_objective(obj, self._ref.name)
        except BadObjective as exc:
            self._malformed += 1
            self._count("malformed")
            if self._malformed % LOG_EVERY == 1 or LOG_EVERY == 1:
                log.warning(
                    "event=inferenceobjective_malformed source=%r error=%r malformed=%d (skipped)",
                    self.source,
                    str(exc),
                    self._malformed,
                )
            return exc.name, None

    def _over_limit(self) -> None:
        self._ignore_one("over_limit", "inferenceobjectives_over_limit", "max_objectives", self._max)

    def _on_error(self, what: str, exc: Exception) -> None:
        if api_error_code(exc) != 404:
            super()._on_error(what, exc)
            return
        self._count("not_found")
        self._last_error = f"{what} of {self.source}: not found (is the InferenceObjective CRD installed?)"
        if self._found is not False:  # once, until it is found again
            log.warning(
                "event=inferenceobjectives_not_found source=%r (the InferenceObjective CRD is not installed, or "
                "not llm-d.ai/v1alpha2: priorities come from flow_control.objectives only; retrying)",
                self.source,
            )
        self._found, self._listed = False, True
        self._objectives, self._ignored = {}, 0
        self._flush()

    def _flush(self) -> None:
        self._flush_pending = False
        if not self._listed or self._objectives == self._published:
            return
        self._published = dict(self._objectives)
        self._hand_over(self._publish, dict(self._objectives))


__all__ = ["MAX_OBJECTIVES", "KubernetesObjectiveWatch", "PublishObjectives"]
