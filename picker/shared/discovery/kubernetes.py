"""InferencePool discovery: follow an ``inference.networking.k8s.io/v1`` InferencePool and the Pods it selects (lists,
watches with bookmarks, resyncs on 410, stall detection, backoff) and publish snapshots. One module on purpose: one
state machine over the pool and its pods; credentials are ``kube_access``, the objects ``kube_objects``. The
list/watch machinery (``KubeFollower``) serves ``kube_objectives`` too. See docs/picker.md, "Pool discovery".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from typing import Any, NoReturn, TypeVar

import httpx2
import orjson

from picker.shared.discovery.config import InferencePoolRef
from picker.shared.discovery.kube_access import (
    REQUEST_TIMEOUT_SECONDS,
    SERVICE_ACCOUNT_DIR,
    load_kube_access,
    make_http_client,
)
from picker.shared.discovery.kube_objects import BadPool, Pod, PoolSpec, parse_pod, parse_pool_spec
from picker.shared.discovery.model import Count, DiscoveredBackend, PoolSnapshot, Publish, backend_name

log = logging.getLogger("kv_epp.discovery")

POOL_API = "apis/inference.networking.k8s.io/v1"
LIST_PAGE_SIZE = 500  # pods per list page (limit/continue): bounds one response's size
MAX_EVENT_BYTES = 16 << 20  # one watch event (a JSON line); etcd caps an object at 1.5 MiB
MAX_BODY_BYTES = 256 << 20  # one list page's body
MAX_ERROR_BODY_BYTES = 64 << 10  # the part of an error answer read for its Status message
WATCH_READ_GRACE_SECONDS = 60.0  # a watch stream silent this long past timeoutSeconds is taken as dead
BACKOFF_FIRST_SECONDS = 0.1
OVER_LIMIT_LOG_EVERY = 1000  # log the first object ignored past its bound (max_pods, ...), then every this many
_T = TypeVar("_T")


class _Gone(Exception):
    """410: the resourceVersion (or continue token) is too old; list again."""


class _ApiError(Exception):
    def __init__(self, code: int, message: str) -> None:
        self.code = code
        super().__init__(f"HTTP {code}: {message}" if code else message)


class _Stalled(Exception):
    """A watch sent nothing (no event, no bookmark) for the idle timeout: taken as dead."""


class _Backoff:
    """Capped exponential backoff with jitter: BACKOFF_FIRST_SECONDS doubling up to ``cap``."""

    def __init__(self, cap: float) -> None:
        self._cap = cap
        self._next = min(BACKOFF_FIRST_SECONDS, cap)

    def reset(self) -> None:
        self._next = min(BACKOFF_FIRST_SECONDS, self._cap)

    async def sleep(self) -> None:
        delay = self._next * random.uniform(0.5, 1.0)
        self._next = min(self._cap, self._next * 2)
        await asyncio.sleep(delay)


class _GoneStreak:
    """410s in a row: the first re-list is at once, each next one (no watch delivered anything in between) waits
    the capped backoff first, counted "resync_backoff", so a server that answers every watch 410 is not re-listed
    in a tight loop. ``reset`` when a watch delivers an event or a bookmark."""

    def __init__(self, cap: float, count: Count) -> None:
        self._backoff = _Backoff(cap)
        self._count = count
        self.streak = 0  # 410s since a watch last delivered something

    def note(self) -> None:
        self.streak += 1

    def reset(self) -> None:
        if self.streak:
            self.streak = 0
            self._backoff.reset()

    async def wait(self) -> None:
        """Before a (re-)list: nothing unless this is the second or later 410 in a row."""
        if self.streak > 1:
            self._count("resync_backoff")
            await self._backoff.sleep()


class KubeFollower:
    """What a follower of API objects shares: the HTTP requests (a list page, a watch stream), the counters, the
    failure state and its logs, the connection loop (``_connected``), a paged list (``_list_all``) and the
    list-then-watch loop (``_list_watch``). ``KubernetesPoolDiscovery`` follows the pool and its pods with it,
    ``kube_objectives.KubernetesObjectiveWatch`` the InferenceObjectives. ``count_prefix`` is put before every
    counter name given to ``count`` (not in ``status()``'s counts)."""

    count_prefix = ""

    def __init__(self, ref: InferencePoolRef, count: Count | None, service_account_dir: str) -> None:
        self._ref = ref
        self._count_cb = count
        self._sa_dir = service_account_dir
        self._namespace: str | None = ref.namespace
        self._counts: dict[str, int] = {}  # keys: a fixed set of counter names
        self._last_error: str | None = None
        self._failing = False  # a failure was logged and no success since
        self._stalls = 0  # stalled watches since a watch last delivered something (for the log level)
        self._ignored = 0  # objects ignored past the bound since the last list
        self._flush_pending = False

    @property
    def source(self) -> str:
        raise NotImplementedError

    def _ignore_one(self, counter: str, event: str, bound: str, limit: int) -> None:
        """One more object ignored past its bound: counted, logged the first time, then every OVER_LIMIT_LOG_EVERY."""
        self._ignored += 1
        self._count(counter)
        if self._ignored % OVER_LIMIT_LOG_EVERY == 1 or OVER_LIMIT_LOG_EVERY == 1:
            log.warning("event=%s source=%r %s=%d ignored=%d", event, self.source, bound, limit, self._ignored)

    def _schedule_flush(self) -> None:
        """Publish on the next loop turn: the events already read in the same chunk coalesce into one."""
        if not self._flush_pending:
            self._flush_pending = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        """Publish what changed since the last publication (and clear ``_flush_pending``)."""
        raise NotImplementedError

    def _hand_over(self, publish: Callable[[_T], None], value: _T) -> None:
        """``publish(value)``: the consumer's bug is logged, and must not stop the follower."""
        try:
            publish(value)
        except Exception:
            log.exception("event=discovery_publish_failed source=%r", self.source)

    async def _connected(self, follow: Callable[[httpx2.AsyncClient], Awaitable[None]]) -> NoReturn:
        """Load the credentials, make a client and ``follow`` with it; for ever (a bad kubeconfig is retried: it may
        be mounted or fixed)."""
        backoff = _Backoff(self._ref.retry_max_seconds)
        while True:
            try:
                access = await asyncio.to_thread(load_kube_access, self._ref, service_account_dir=self._sa_dir)
                client = await asyncio.to_thread(make_http_client, access)
            except Exception as exc:
                self._fail(f"{exc}")
                await backoff.sleep()
                continue
            self._namespace = access.namespace
            log.info("event=discovery_start source=%r credentials=%r", self.source, access.origin)
            async with client:
                await follow(client)

    async def _list_all(
        self, http: httpx2.AsyncClient, path: str, params: dict[str, str], take: Callable[[Any], None]
    ) -> str:
        """List ``path`` page by page (LIST_PAGE_SIZE items a page), calling ``take`` on each item; returns the
        list's resourceVersion."""
        rv = ""
        cont = ""
        while True:
            page = {**params, "limit": str(LIST_PAGE_SIZE)}
            if cont:
                page["continue"] = cont
            body = await self._get_json(http, path, page)
            meta = body.get("metadata") or {}
            rv = str(meta.get("resourceVersion") or rv)
            for item in body.get("items") or ():
                take(item)
            cont = str(meta.get("continue") or "")
            if not cont:
                return rv

    async def _list_watch(
        self,
        http: httpx2.AsyncClient,
        what: str,
        path: str,
        params: dict[str, str],
        relist: Callable[[], Awaitable[str]],
        on_event: Callable[[str, dict[str, Any], str], None],
    ) -> NoReturn:
        """List (``relist`` returns the list's resourceVersion), then watch ``path`` from that version with bookmarks,
        for ever: ``on_event(type, object, version)`` for each event, BOOKMARK included. A watch the server ends
        (timeoutSeconds) or that stalls is renewed from its last version; a 410 lists again (the second and later
        in a row after the backoff, ``_GoneStreak``); another error goes to ``_on_error`` and backs off."""
        backoff = _Backoff(self._ref.retry_max_seconds)
        gone = _GoneStreak(self._ref.retry_max_seconds, self._count)
        rv = ""
        params = {
            **params,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(self._ref.watch_timeout_seconds),
        }
        while True:
            try:
                if not rv:
                    await gone.wait()
                    rv = await relist()
                    backoff.reset()
                started, events = time.monotonic(), 0
                async with contextlib.aclosing(self._watch(http, path, params, rv)) as stream:
                    async for etype, obj in stream:
                        events += 1
                        gone.reset()
                        self._stalls = 0
                        rv = _resource_version(obj) or rv
                        self._count("bookmark" if etype == "BOOKMARK" else "watch_event")
                        on_event(etype, obj, rv)
                # the server ended the watch (timeoutSeconds): renew it from rv; one that ends at once backs off
                if events or time.monotonic() - started >= 1.0:
                    backoff.reset()
                else:
                    await backoff.sleep()
            except _Gone as exc:
                self._count("gone")
                gone.note()
                log.info("event=discovery_gone what=%s source=%r detail=%r", what, self.source, str(exc))
                rv = ""
            except _Stalled:
                self._stalled(what)
            except Exception as exc:
                self._on_error(what, exc)
                await backoff.sleep()

    def _on_error(self, what: str, exc: Exception) -> None:
        """A list or watch of ``what`` failed (it is retried after the backoff)."""
        self._fail(f"{what} of {self.source}: {_describe(exc)}")

    # --- HTTP ---

    async def _get_json(self, http: httpx2.AsyncClient, path: str, params: dict[str, str]) -> dict[str, Any]:
        async with http.stream("GET", path, params=params) as resp:
            if resp.status_code != 200:
                await _raise_for(resp)
            body = bytearray()
            async for chunk in resp.aiter_bytes():
                body += chunk
                if len(body) > MAX_BODY_BYTES:
                    raise _ApiError(0, f"GET {path}: the answer is over {MAX_BODY_BYTES} bytes")
        data = orjson.loads(body)
        if not isinstance(data, dict):
            raise _ApiError(0, f"GET {path}: the answer is not a JSON object")
        return data

    async def _watch(
        self, http: httpx2.AsyncClient, path: str, params: dict[str, str], rv: str
    ) -> AsyncGenerator[tuple[str, dict[str, Any]], None]:
        """One watch request from ``rv``: yields (type, object) for ADDED, MODIFIED, DELETED and BOOKMARK;
        raises _Gone on 410 (status or ERROR event), _Stalled when nothing arrives for the idle timeout (the
        answer's headers included), _ApiError on another error; returns when the server ends the stream."""
        self._count("watch")
        timeout = httpx2.Timeout(REQUEST_TIMEOUT_SECONDS, read=self.watch_read_timeout)
        query = {**params, "watch": "1", "resourceVersion": rv}
        try:
            async with contextlib.aclosing(self._watch_stream(http, path, query, timeout)) as stream:
                async for item in stream:
                    yield item
        except httpx2.ReadTimeout:
            raise _Stalled(f"GET {path}: nothing for {self.watch_read_timeout:g} s") from None

    @property
    def watch_read_timeout(self) -> float:
        """How long a watch may send nothing: ``watch_idle_timeout_seconds``, at most ``watch_timeout_seconds`` +
        WATCH_READ_GRACE_SECONDS (the server ends the stream itself by then)."""
        ref = self._ref
        return min(ref.watch_idle_timeout_seconds, ref.watch_timeout_seconds + WATCH_READ_GRACE_SECONDS)

    async def _watch_stream(
        self, http: httpx2.AsyncClient, path: str, query: dict[str, str], timeout: httpx2.Timeout
    ) -> AsyncGenerator[tuple[str, dict[str, Any]], None]:
        async with http.stream("GET", path, params=query, timeout=timeout) as resp:
            if resp.status_code != 200:
                await _raise_for(resp)
            self._ok()
            buf = bytearray()
            async for chunk in resp.aiter_bytes():
                buf += chunk
                start = 0
                while (end := buf.find(b"\n", start)) >= 0:
                    if end > start:
                        yield _decode_event(bytes(buf[start:end]))
                    start = end + 1
                del buf[:start]
                if len(buf) > MAX_EVENT_BYTES:
                    raise _ApiError(0, f"a watch event over {MAX_EVENT_BYTES} bytes")
            if buf.strip():
                yield _decode_event(bytes(buf))

    # --- bookkeeping ---

    def _count(self, name: str) -> None:
        self._counts[name] = self._counts.get(name, 0) + 1
        if self._count_cb is not None:
            try:
                self._count_cb(self.count_prefix + name)
            except Exception:
                log.exception("event=discovery_count_failed name=%s", name)

    def _fail(self, message: str, *, log_it: bool = True) -> None:
        self._count("error")
        self._last_error = message
        if log_it and not self._failing:
            log.warning(
                "event=discovery_error source=%r error=%r (retrying; the last snapshot is kept)", self.source, message
            )
        elif log_it:
            log.debug("event=discovery_error source=%r error=%r", self.source, message)
        self._failing = self._failing or log_it

    def _stalled(self, what: str) -> None:
        """A watch sent nothing for the idle timeout: renewed from its last version at once (the wait itself spaces
        the renewals). Logged at info the first time in a row, then at debug."""
        self._count("watch_stalled")
        self._stalls += 1
        level = logging.INFO if self._stalls == 1 else logging.DEBUG
        log.log(
            level,
            "event=discovery_watch_stalled what=%s source=%r idle_s=%g (renewed from its last version)",
            what,
            self.source,
            self.watch_read_timeout,
        )

    def _ok(self) -> None:
        """A request succeeded: the trouble is over (but for ``_standing_error``)."""
        if self._failing:
            log.info("event=discovery_recovered source=%r", self.source)
        self._failing = False
        self._last_error = self._standing_error()

    def _standing_error(self) -> str | None:
        """The error still reported after a request succeeded (none here)."""
        return None


class KubernetesPoolDiscovery(KubeFollower):
    """Follows one InferencePool and its pods (docs/picker.md, "Pool discovery"); implements ``Discovery``.

    Bounds: the pod map holds at most ``ref.max_pods`` pods (a pod past it is ignored until a slot frees and the
    pod changes or the pods are listed again; counted as "pod_over_limit" and logged); one list page is
    LIST_PAGE_SIZE pods, one watch event at most MAX_EVENT_BYTES. Counters ("list", "watch", "watch_event",
    "bookmark", "gone", "resync", "resync_backoff", "watch_stalled", "error", "pod_over_limit") go to ``count``
    and to ``status()``."""

    def __init__(
        self,
        ref: InferencePoolRef,
        count: Count | None = None,
        *,
        service_account_dir: str = SERVICE_ACCOUNT_DIR,
    ) -> None:
        super().__init__(ref, count, service_account_dir)
        self._synced = False
        self._publish: Publish | None = None
        self._pool_found: bool | None = None  # None: not read yet
        self._target: PoolSpec | None = None  # the pool's spec as last read
        self._spec: PoolSpec | None = None  # the spec the pod map was listed with
        self._pods: dict[str, Pod] = {}
        self._pods_rv = ""
        self._pool_rv = ""
        self._ignored = 0  # pods ignored past max_pods since the last list
        self._published: tuple[DiscoveredBackend, ...] | None = None
        self._flush_pending = False

    # --- Discovery ---

    @property
    def synced(self) -> bool:
        return self._synced

    @property
    def source(self) -> str:
        return f"inference_pool {self._namespace or '?'}/{self._ref.name}"

    def status(self) -> dict[str, object]:
        pool: dict[str, object] | None = None
        if self._target is not None:
            pool = {"match_labels": dict(self._target.match_labels), "target_ports": list(self._target.target_ports)}
        return {
            "source": self.source,
            "synced": self._synced,
            "backends": len(self._published or ()),
            "pods": len(self._pods),
            "published_pods": sum(1 for p in self._pods.values() if p.published),  # an IP, not terminating
            "live_pods": sum(1 for p in self._pods.values() if p.live),  # published and Ready: routed to
            "pods_ignored": self._ignored,
            "pool_found": self._pool_found,
            "pool": pool,
            "resource_version": self._pods_rv,
            "pool_resource_version": self._pool_rv,
            "last_error": self._last_error,
            "counts": dict(self._counts),
        }

    async def run(self, publish: Publish) -> None:
        self._publish = publish
        await self._connected(self._follow_pool)

    # --- the pool ---

    def _pools_path(self) -> str:
        return f"{POOL_API}/namespaces/{self._namespace}/inferencepools"

    def _pods_path(self) -> str:
        return f"api/v1/namespaces/{self._namespace}/pods"

    async def _follow_pool(self, http: httpx2.AsyncClient) -> None:
        """List and watch the pool for ever; start, restart or stop the pod follower as its spec changes."""
        backoff = _Backoff(self._ref.retry_max_seconds)
        gone = _GoneStreak(self._ref.retry_max_seconds, self._count)
        pods_task: asyncio.Task[None] | None = None
        rv = ""
        params = {"fieldSelector": f"metadata.name={self._ref.name}"}
        try:
            while True:
                try:
                    if not rv:
                        await gone.wait()
                        body = await self._get_json(http, self._pools_path(), params)
                        self._count("list")
                        rv = str(body["metadata"]["resourceVersion"])
                        items = body.get("items") or []
                        pods_task = await self._set_pool(http, items[0] if items else None, pods_task)
                        self._pool_rv = rv
                        self._ok()
                    started, events = time.monotonic(), 0
                    watch_params = {
                        **params,
                        "allowWatchBookmarks": "true",
                        "timeoutSeconds": str(self._ref.watch_timeout_seconds),
                    }
                    async with contextlib.aclosing(self._watch(http, self._pools_path(), watch_params, rv)) as stream:
                        async for etype, obj in stream:
                            events += 1
                            gone.reset()
                            self._stalls = 0
                            rv = _resource_version(obj) or rv
                            self._pool_rv = rv
                            if etype == "BOOKMARK":
                                self._count("bookmark")
                                continue
                            self._count("watch_event")
                            pods_task = await self._set_pool(http, None if etype == "DELETED" else obj, pods_task)
                    if events or time.monotonic() - started >= 1.0:
                        backoff.reset()
                    else:  # a server that ends every watch at once must not make this loop spin
                        await backoff.sleep()
                except _Gone as exc:
                    self._count("gone")
                    self._count("resync")
                    gone.note()
                    log.info("event=discovery_gone what=inferencepool source=%r detail=%r", self.source, str(exc))
                    rv = ""
                except _Stalled:
                    self._stalled("inferencepool")
                except Exception as exc:
                    self._fail(f"inferencepool {self._namespace}/{self._ref.name}: {_describe(exc)}")
                    await backoff.sleep()
        finally:
            if pods_task is not None:
                pods_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await pods_task

    async def _set_pool(
        self, http: httpx2.AsyncClient, obj: Mapping[str, Any] | None, pods_task: asyncio.Task[None] | None
    ) -> asyncio.Task[None] | None:
        """Apply the pool as read (None: it does not exist); returns the pod follower now running."""
        if obj is None:
            was_found = self._pool_found
            self._pool_found = False
            self._target = None
            self._last_error = f"inferencepool {self._namespace}/{self._ref.name} not found"
            if pods_task is not None:
                pods_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await pods_task
            if was_found:  # deleted while watched: the pool is empty now (the only empty publication)
                log.warning("event=inferencepool_deleted source=%r", self.source)
                self._pods, self._spec, self._ignored = {}, None, 0
                self._flush()
            elif was_found is None:
                log.warning("event=inferencepool_not_found source=%r", self.source)
            return None
        try:
            spec = parse_pool_spec(obj)
        except BadPool as exc:  # keep following what we had
            self._fail(f"inferencepool {self._namespace}/{self._ref.name}: {exc}")
            return pods_task
        self._pool_found = True
        if spec == self._target and pods_task is not None and not pods_task.done():
            return pods_task
        if self._target is not None and spec != self._target:
            log.info(
                "event=inferencepool_changed source=%r selector=%r target_ports=%s",
                self.source,
                spec.label_selector,
                list(spec.target_ports),
            )
        self._target = spec
        if pods_task is not None:
            pods_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pods_task
        return asyncio.create_task(self._follow_pods(http, spec), name=f"discovery-pods-{self._ref.name}")

    # --- the pods ---

    async def _follow_pods(self, http: httpx2.AsyncClient, spec: PoolSpec) -> None:
        """List the pods the spec selects, then watch them; list again after 410 Gone. For ever."""
        relist = self._spec is not None  # a first list for this spec after another one is a resync too

        async def list_pods() -> str:
            nonlocal relist
            if relist:
                self._count("resync")
            rv = await self._list_pods(http, spec)
            relist = True
            return rv

        def on_event(etype: str, obj: dict[str, Any], rv: str) -> None:
            self._pods_rv = rv
            if etype != "BOOKMARK":
                self._apply_pod_event(etype, obj)

        params = {"labelSelector": spec.label_selector}
        await self._list_watch(http, "pods", self._pods_path(), params, list_pods, on_event)

    async def _list_pods(self, http: httpx2.AsyncClient, spec: PoolSpec) -> str:
        """List every selected pod (page by page) and replace the pod map at once; returns the list's version."""
        pods: dict[str, Pod] = {}
        ignored = 0

        def take(item: Any) -> None:
            nonlocal ignored
            try:
                name, pod = parse_pod(item)
            except ValueError as exc:
                self._fail(f"pods of {self.source}: {exc}", log_it=False)
                return
            if name not in pods and len(pods) >= self._ref.max_pods:
                ignored += 1
                return
            pods[name] = pod

        rv = await self._list_all(http, self._pods_path(), {"labelSelector": spec.label_selector}, take)
        self._count("list")
        self._pods, self._spec, self._pods_rv = pods, spec, rv
        self._ignored = 0
        for _ in range(ignored):
            self._over_limit()
        self._synced = True
        self._ok()
        self._flush()
        return rv

    def _apply_pod_event(self, etype: str, obj: Mapping[str, Any]) -> None:
        try:
            name, pod = parse_pod(obj)
        except ValueError as exc:
            self._fail(f"pods of {self.source}: {exc}", log_it=False)
            return
        old = self._pods.get(name)
        if etype == "DELETED":
            if old is not None:
                del self._pods[name]
                if old.view() is not None:
                    self._schedule_flush()
            return
        if old is None and len(self._pods) >= self._ref.max_pods:
            self._over_limit()
            return
        self._pods[name] = pod
        if (old.view() if old is not None else None) != pod.view():
            self._schedule_flush()

    def _over_limit(self) -> None:
        self._ignore_one("pod_over_limit", "discovery_pods_over_limit", "max_pods", self._ref.max_pods)

    # --- publication ---

    def _flush(self) -> None:
        self._flush_pending = False
        if not self._synced or self._publish is None:
            return
        backends = self._backends()
        if backends == self._published:
            return
        self._published = backends
        self._hand_over(self._publish, PoolSnapshot(backends, source=self.source, version=self._pods_rv))

    def _backends(self) -> tuple[DiscoveredBackend, ...]:
        spec = self._spec
        if spec is None:
            return ()
        ports = spec.target_ports
        out = [
            DiscoveredBackend(
                name=backend_name(name, rank, len(ports)),
                ip=pod.ip,
                port=port,
                rank=rank,
                pod=name,
                namespace=self._namespace or "",
                annotations=pod.annotations,
                ready=pod.ready,
                role=pod.role,
            )
            for name, pod in self._pods.items()
            if pod.ip is not None and not pod.terminating
            for rank, port in enumerate(ports)
        ]
        out.sort(key=lambda b: b.name)
        return tuple(out)

    def _standing_error(self) -> str | None:
        """A missing pool stays the reported error after a success."""
        return self._last_error if self._pool_found is False else None


def _resource_version(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata")
    return str(meta.get("resourceVersion") or "") if isinstance(meta, dict) else ""


def _decode_event(line: bytes) -> tuple[str, dict[str, Any]]:
    event = orjson.loads(line)
    etype = event.get("type") if isinstance(event, dict) else None
    obj = event.get("object") if isinstance(event, dict) else None
    if not isinstance(obj, dict):
        raise _ApiError(0, f"a watch event without an object: {line[:200]!r}")
    if etype == "ERROR":
        code = obj.get("code")
        message = str(obj.get("message") or obj.get("reason") or "")
        if code == 410:
            raise _Gone(message)
        raise _ApiError(code if isinstance(code, int) else 0, f"watch ERROR event: {message}")
    if etype not in ("ADDED", "MODIFIED", "DELETED", "BOOKMARK"):
        raise _ApiError(0, f"unknown watch event type {etype!r}")
    return etype, obj


async def _raise_for(resp: httpx2.Response) -> None:
    body = bytearray()
    async for chunk in resp.aiter_bytes():
        body += chunk
        if len(body) > MAX_ERROR_BODY_BYTES:
            break
    message = bytes(body[:500]).decode("utf-8", "replace").strip()
    with contextlib.suppress(ValueError):
        data = orjson.loads(body)
        if isinstance(data, dict) and data.get("message"):
            message = str(data["message"])
    if resp.status_code == 410:
        raise _Gone(message)
    raise _ApiError(resp.status_code, f"{resp.request.method} {resp.request.url.path}: {message}")


def api_error_code(exc: BaseException) -> int | None:
    """The HTTP status of an error answer the API server gave (None: another failure)."""
    return exc.code if isinstance(exc, _ApiError) else None


def _describe(exc: BaseException) -> str:
    if isinstance(exc, _ApiError):
        return str(exc)
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
