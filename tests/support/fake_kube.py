"""A FAKE Kubernetes API server for the discovery tests: just the part of the API that InferencePool discovery
uses, served over real HTTP by aiohttp on 127.0.0.1 (port 0).

It is not Kubernetes. It implements, for ``/api/v1/namespaces/{ns}/pods``,
``/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools[/{name}]`` and the namespaced custom
resources of ``CUSTOM_RESOURCES`` (``/apis/{group}/{version}/namespaces/{ns}/{plural}``: InferenceObjectives and
InferenceModelRewrites), each
of which can be uninstalled (404, as when its CRD is not installed) and installed again:

- GET list (``labelSelector`` with ``=``/``==``/``!=`` terms, ``fieldSelector`` on ``metadata.name`` /
  ``metadata.namespace``, ``limit`` + ``continue`` pages served from one snapshot) and GET of one pool;
- GET watch (``?watch=1``): a chunked stream of JSON lines, from ``resourceVersion`` (history replayed; an
  object that starts or stops matching the selector is ADDED or DELETED, as the real server does), with
  ``allowWatchBookmarks`` and ``timeoutSeconds`` (the stream ends cleanly then);
- one global, monotonically increasing resourceVersion (as etcd's revision);
- compaction (``expire_watches``): open watches get an ERROR event with code 410 and end; a watch, list or
  continue token older than the compaction point gets 410 Gone (for a watch as an ERROR event by default,
  as the watch cache answers, or as HTTP 410 with ``watch_gone_as_http = True``);
- an outage (``fail_requests``: 503 answers), an optional bearer token, and a record of every request;
- periodic bookmarks (``bookmark_interval``: to every watch that asked, when it has been quiet that long, as the
  real server's watch cache sends one about every minute);
- a stall (``stall_watches``: the open watch streams, and with ``new_too`` each new watch request, keep their
  connection open and send nothing, not even the headers of a new one, until ``unstall_watches``);
- a 410 storm (``gone_storm``: every watch request is answered 410 at once, as an ERROR event or, with
  ``watch_gone_as_http``, as the HTTP status).

Mutators (``put_pod`` ...) are plain methods to call on the server's own event loop; ``running_fake_kube``
hosts one on a thread for synchronous tests (the picker or listener as a subprocess) and exposes the same
mutators thread-safely.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import json
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from aiohttp import web

POOL_GROUP = "inference.networking.k8s.io"
POOL_VERSION = "v1"
PODS = "pods"
POOLS = "inferencepools"
OBJECTIVES = "inferenceobjectives"
MODEL_REWRITES = "inferencemodelrewrites"
# namespaced custom resources served generically: plural -> (group, version, kind)
CUSTOM_RESOURCES = {
    OBJECTIVES: ("llm-d.ai", "v1alpha2", "InferenceObjective"),
    MODEL_REWRITES: ("llm-d.ai", "v1alpha2", "InferenceModelRewrite"),
}
_KIND = {
    PODS: ("Pod", "v1"),
    POOLS: ("InferencePool", f"{POOL_GROUP}/{POOL_VERSION}"),
    **{plural: (kind, f"{group}/{version}") for plural, (group, version, kind) in CUSTOM_RESOURCES.items()},
}

MAX_HISTORY = 10_000  # events kept for watches from an older resourceVersion; older ones get 410
MAX_WATCH_QUEUE = 10_000  # events queued for one watch; a watcher that falls this far behind is ended with 410
MAX_CONTINUE_TOKENS = 100  # list page snapshots kept for `continue`; the oldest token is dropped (410 on use)
MAX_REQUESTS_RECORDED = 100_000  # `requests` keeps the most recent ones
DEFAULT_TOKEN = "fake-kube-token"

T = TypeVar("T")


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def _status_response(code: int, reason: str, message: str) -> web.Response:
    return web.json_response(_status(code, reason, message), status=code)


def _parse_label_selector(text: str) -> list[tuple[str, str, str]]:
    """``a=b,c!=d`` → [(key, op, value)]; only the equality forms the discovery code sends."""
    terms: list[tuple[str, str, str]] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        for op in ("!=", "==", "="):
            if op in part:
                key, _, value = part.partition(op)
                terms.append((key.strip(), "!=" if op == "!=" else "=", value.strip()))
                break
        else:
            raise ValueError(f"unsupported label selector term {part!r} (the fake knows =, == and !=)")
    return terms


def _parse_field_selector(text: str) -> dict[str, str]:
    fields: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        key = key.rstrip("=")
        value = value.lstrip("=")
        if not sep or key not in ("metadata.name", "metadata.namespace"):
            raise ValueError(f"unsupported field selector {part!r} (the fake knows metadata.name/namespace)")
        fields[key] = value
    return fields


@dataclass
class _Selector:
    labels: list[tuple[str, str, str]]
    fields: dict[str, str]

    def matches(self, obj: dict[str, Any] | None) -> bool:
        if obj is None:
            return False
        meta = obj["metadata"]
        have = meta.get("labels") or {}
        for key, op, value in self.labels:
            if (have.get(key) == value) != (op == "="):
                return False
        return all(meta.get(k.split(".", 1)[1]) == v for k, v in self.fields.items())


@dataclass
class _Event:
    rv: int
    resource: str
    namespace: str
    type: str  # ADDED, MODIFIED, DELETED
    obj: dict[str, Any]
    prev: dict[str, Any] | None  # the object before this change (None for ADDED)


@dataclass
class _Watch:
    resource: str
    namespace: str
    selector: _Selector
    bookmarks: bool
    queue: asyncio.Queue[dict[str, Any] | str] = field(default_factory=lambda: asyncio.Queue(MAX_WATCH_QUEUE))
    closed: bool = False

    def offer(self, item: dict[str, Any] | str) -> None:
        """Queue an event (or "close"/"drop"); a watcher too far behind is ended with 410, as a real server
        ends a watch it cannot keep up with."""
        if self.closed:
            return
        try:
            self.queue.put_nowait(item)
        except asyncio.QueueFull:
            self.closed = True
            with contextlib.suppress(asyncio.QueueEmpty):
                self.queue.get_nowait()
            self.queue.put_nowait({"type": "ERROR", "object": _status(410, "Expired", "watcher too slow")})

    def translate(self, ev: _Event) -> dict[str, Any] | None:
        """The event this watch sees: objects entering or leaving the selector are ADDED or DELETED."""
        if ev.resource != self.resource or ev.namespace != self.namespace:
            return None
        was, now = self.selector.matches(ev.prev), self.selector.matches(ev.obj)
        if ev.type == "DELETED":
            kind = "DELETED" if was else None
        elif was and now:
            kind = "MODIFIED"
        elif now:
            kind = "ADDED"
        elif was:
            kind = "DELETED"
        else:
            kind = None
        return None if kind is None else {"type": kind, "object": ev.obj}


class FakeKubeApiServer:
    """A FAKE Kubernetes API server (see the module docstring): pods, InferencePools and custom resources, list and
    watch.

    ``requests`` records (method, path, query) of every request, most recent last (the last
    MAX_REQUESTS_RECORDED kept). ``token``: the bearer token required (None: no auth)."""

    def __init__(self, token: str | None = DEFAULT_TOKEN) -> None:
        self.token = token
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self.watch_gone_as_http = False  # 410 for a too-old watch: an ERROR event (False) or HTTP 410 (True)
        self.gone_storm = False  # every watch request is answered 410 (see the module docstring)
        self.bookmark_interval: float | None = None  # seconds of quiet after which a watch gets a bookmark
        self._stall_new = False
        self._unstalled = asyncio.Event()
        self._rv = 1
        self._compacted = 0  # a resourceVersion below this is Gone
        self._objects: dict[str, dict[tuple[str, str], dict[str, Any]]] = {r: {} for r in _KIND}
        self._uninstalled: set[str] = set()  # custom resources answered 404 (their CRD is not installed)
        self._history: deque[_Event] = deque(maxlen=MAX_HISTORY)
        self._watches: list[_Watch] = []
        self._continues: dict[str, tuple[int, list[dict[str, Any]]]] = {}
        self._continue_ids = itertools.count(1)
        self._fail: int | bool = False
        self._runner: web.AppRunner | None = None
        self._port = 0
        self._stopping = False
        self._stalled = 0  # watch handlers silent now

    # --- lifecycle ---

    async def start(self) -> None:
        app = web.Application(middlewares=[self._middleware])
        pods = "/api/v1/namespaces/{ns}/pods"
        pools = f"/apis/{POOL_GROUP}/{POOL_VERSION}/namespaces/{{ns}}/inferencepools"
        app.add_routes(
            [
                web.get(pods, self._collection(PODS)),
                web.get(pools, self._collection(POOLS)),
                web.get(pools + "/{name}", self._get_pool),
                *(
                    web.get(f"/apis/{group}/{version}/namespaces/{{ns}}/{plural}", self._collection(plural))
                    for plural, (group, version, _) in CUSTOM_RESOURCES.items()
                ),
            ]
        )
        # handler_cancellation: a watch handler ends when its client disconnects
        # shutdown_timeout: stop() does not wait long for a handler still running
        self._runner = web.AppRunner(app, handle_signals=False, handler_cancellation=True, shutdown_timeout=2.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self._port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def stop(self) -> None:
        self._stopping = True  # a request arriving on a kept-alive connection meanwhile gets 503
        self.unstall_watches()
        for w in self._watches:
            w.offer("close")
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    @property
    def resource_version(self) -> int:
        """The current (last written) global resourceVersion."""
        return self._rv

    def write_kubeconfig(self, path: Path, namespace: str = "default") -> Path:
        """A kubeconfig whose current context points at this fake (with its token and ``namespace``)."""
        user: dict[str, Any] = {"token": self.token} if self.token else {}
        doc = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": user}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": namespace}}],
            "current-context": "fake",
        }
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=2))  # JSON is YAML
        return path

    # --- mutators (call on the server's event loop) ---

    def put_pool(self, name: str, namespace: str, match_labels: dict[str, str], target_ports: list[int]) -> None:
        """Create or update an InferencePool (inference.networking.k8s.io/v1)."""
        spec = {
            "selector": {"matchLabels": dict(match_labels)},
            "targetPorts": [{"number": p} for p in target_ports],
            "endpointPickerRef": {"name": "kv-epp", "port": {"number": 9002}},
        }
        prev = self._objects[POOLS].get((namespace, name))
        obj = {"metadata": self._meta(name, namespace, prev, {}, {}), "spec": spec}
        self._write(POOLS, namespace, name, obj, prev)

    def delete_pool(self, name: str, namespace: str) -> None:
        self._delete(POOLS, namespace, name)

    def put_pod(
        self,
        name: str,
        namespace: str,
        labels: dict[str, str],
        ip: str | None,
        ready: bool,
        annotations: dict[str, str] | None = None,
    ) -> None:
        """Create or update a pod: ``ip`` None = not scheduled yet (no podIP); ``ready`` its Ready condition."""
        prev = self._objects[PODS].get((namespace, name))
        meta = self._meta(name, namespace, prev, labels, annotations or {})
        if prev is not None and "deletionTimestamp" in prev["metadata"]:
            meta["deletionTimestamp"] = prev["metadata"]["deletionTimestamp"]
        status: dict[str, Any] = {
            "phase": "Running" if ip else "Pending",
            "conditions": [{"type": "Ready", "status": "True" if ready and ip else "False"}],
        }
        if ip:
            status["podIP"] = ip
            status["podIPs"] = [{"ip": ip}]
        obj = {"metadata": meta, "spec": {"containers": [{"name": "engine", "image": "fake"}]}, "status": status}
        self._write(PODS, namespace, name, obj, prev)

    def set_ready(self, name: str, namespace: str, ready: bool) -> None:
        prev = self._objects[PODS][(namespace, name)]
        obj = json.loads(json.dumps(prev))
        obj["status"]["conditions"] = [{"type": "Ready", "status": "True" if ready else "False"}]
        self._write(PODS, namespace, name, obj, prev)

    def start_terminating(self, name: str, namespace: str) -> None:
        """Graceful deletion's first step: the pod gets metadata.deletionTimestamp (a MODIFIED event) and stays
        until ``delete_pod``."""
        prev = self._objects[PODS][(namespace, name)]
        obj = json.loads(json.dumps(prev))
        obj["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
        self._write(PODS, namespace, name, obj, prev)

    def set_phase(self, name: str, namespace: str, phase: str) -> None:
        """The pod's status.phase (Failed: evicted, Succeeded: ran to completion); it keeps its podIP, as a real
        ended pod does until it is garbage-collected."""
        prev = self._objects[PODS][(namespace, name)]
        obj = json.loads(json.dumps(prev))
        obj.setdefault("status", {})["phase"] = phase
        self._write(PODS, namespace, name, obj, prev)

    def delete_pod(self, name: str, namespace: str) -> None:
        self._delete(PODS, namespace, name)

    def put_object(self, resource: str, namespace: str, obj: dict[str, Any]) -> None:
        """Create or update an object of a custom resource (``CUSTOM_RESOURCES``) from its manifest: its
        ``metadata.name``, ``metadata.labels`` and ``spec`` are kept, and at creation its ``creationTimestamp`` when
        given (objects of different ages; kind, apiVersion and the rest of the metadata are the server's)."""
        if resource not in CUSTOM_RESOURCES:
            raise ValueError(f"{resource!r} is not a custom resource of the fake ({', '.join(CUSTOM_RESOURCES)})")
        name = obj["metadata"]["name"]
        prev = self._objects[resource].get((namespace, name))
        meta = self._meta(name, namespace, prev, obj["metadata"].get("labels") or {}, {})
        created = obj["metadata"].get("creationTimestamp")
        if prev is None and created is not None:
            meta["creationTimestamp"] = created
        self._write(resource, namespace, name, {"metadata": meta, "spec": json.loads(json.dumps(obj["spec"]))}, prev)

    def delete_object(self, resource: str, namespace: str, name: str) -> None:
        self._delete(resource, namespace, name)

    def uninstall(self, resource: str) -> None:
        """As deleting the CRD: every object of ``resource`` is deleted (DELETED events), its open watches end, and
        its requests are answered 404 until ``install``."""
        for namespace, name in sorted(self._objects[resource]):
            self._delete(resource, namespace, name)
        self._uninstalled.add(resource)
        for w in self._watches:
            if w.resource == resource:
                w.offer("close")

    def install(self, resource: str) -> None:
        self._uninstalled.discard(resource)

    def expire_watches(self) -> None:
        """Compaction: every open watch gets an ERROR 410 and ends; anything older than now is Gone."""
        self._compacted = self._rv
        for w in self._watches:
            w.offer({"type": "ERROR", "object": _status(410, "Expired", f"too old resource version: {self._rv}")})
            w.offer("close")

    def bookmark(self) -> None:
        """A BOOKMARK at the current resourceVersion to each open watch that asked for bookmarks."""
        for w in self._watches:
            if w.bookmarks:
                w.offer(self._bookmark(w.resource))

    def _bookmark(self, resource: str) -> dict[str, Any]:
        kind, api = _KIND[resource]
        return {
            "type": "BOOKMARK",
            "object": {"kind": kind, "apiVersion": api, "metadata": {"resourceVersion": str(self._rv)}},
        }

    def close_watches(self) -> None:
        """End every open watch stream cleanly (as timeoutSeconds does)."""
        for w in self._watches:
            w.offer("close")

    def drop_watches(self) -> None:
        """Cut every open watch connection mid-stream (no final chunk): a dropped watch."""
        for w in self._watches:
            w.offer("drop")

    def stall_watches(self, new_too: bool = False) -> None:
        """Every open watch stream goes silent (its connection stays open, nothing more is sent); with ``new_too``
        each new watch request is held the same way before its headers. Until ``unstall_watches``."""
        self._unstalled.clear()
        self._stall_new = new_too
        for w in self._watches:
            w.offer("stall")

    def unstall_watches(self) -> None:
        """Stalled watches carry on (events queued meanwhile are sent); new ones are served again."""
        self._stall_new = False
        self._unstalled.set()

    def stalled_watches(self) -> int:
        """Watch requests held silent now (open streams and new requests)."""
        return self._stalled

    def bump(self, n: int = 1) -> None:
        """Advance the global resourceVersion (writes elsewhere in the cluster) without an event here."""
        self._rv += n

    def fail_requests(self, n_or_bool: int | bool) -> None:
        """Answer 503 to the next ``n`` requests (True: to every request until ``fail_requests(False)``)."""
        self._fail = n_or_bool

    def open_watches(self, resource: str = PODS) -> int:
        """How many watch streams on ``resource`` ("pods", "inferencepools", a custom resource) are open now."""
        return sum(1 for w in self._watches if w.resource == resource and not w.closed)

    # --- internals ---

    def _meta(
        self,
        name: str,
        namespace: str,
        prev: dict[str, Any] | None,
        labels: dict[str, str],
        annotations: dict[str, str],
    ) -> dict[str, Any]:
        meta: dict[str, Any] = {"name": name, "namespace": namespace, "uid": f"uid-{namespace}-{name}"}
        if prev is not None:
            meta["uid"] = prev["metadata"]["uid"]
            meta["creationTimestamp"] = prev["metadata"]["creationTimestamp"]
        else:
            meta["creationTimestamp"] = "2026-01-01T00:00:00Z"
        if labels:
            meta["labels"] = dict(labels)
        if annotations:
            meta["annotations"] = dict(annotations)
        return meta

    def _write(
        self, resource: str, namespace: str, name: str, obj: dict[str, Any], prev: dict[str, Any] | None
    ) -> None:
        self._rv += 1
        kind, api = _KIND[resource]
        obj = {"kind": kind, "apiVersion": api, **obj}
        obj["metadata"]["resourceVersion"] = str(self._rv)
        self._objects[resource][(namespace, name)] = obj
        self._emit(_Event(self._rv, resource, namespace, "ADDED" if prev is None else "MODIFIED", obj, prev))

    def _delete(self, resource: str, namespace: str, name: str) -> None:
        prev = self._objects[resource].pop((namespace, name))
        self._rv += 1
        obj = json.loads(json.dumps(prev))
        obj["metadata"]["resourceVersion"] = str(self._rv)
        self._emit(_Event(self._rv, resource, namespace, "DELETED", obj, prev))

    def _emit(self, ev: _Event) -> None:
        self._history.append(ev)
        for w in self._watches:
            out = w.translate(ev)
            if out is not None:
                w.offer(out)

    def _gone_below(self) -> int:
        """The oldest resourceVersion still served: compaction, or the start of the kept history."""
        floor = self._history[0].rv - 1 if len(self._history) == self._history.maxlen else 0
        return max(self._compacted, floor)

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Callable[[web.Request], Any]) -> web.StreamResponse:
        self.requests.append((request.method, request.path, dict(request.query)))
        if len(self.requests) > MAX_REQUESTS_RECORDED:
            del self.requests[: MAX_REQUESTS_RECORDED // 2]
        if self._stopping:
            return _status_response(503, "ServiceUnavailable", "the fake API server is stopping")
        if self._fail is True or (not isinstance(self._fail, bool) and self._fail > 0):
            if not isinstance(self._fail, bool):
                self._fail -= 1
            return _status_response(503, "ServiceUnavailable", "the fake API server is failing requests")
        if self.token is not None and request.headers.get("Authorization") != f"Bearer {self.token}":
            return _status_response(401, "Unauthorized", "Unauthorized")
        response: web.StreamResponse = await handler(request)
        return response

    def _collection(self, resource: str) -> Callable[[web.Request], Any]:
        async def handle(request: web.Request) -> web.StreamResponse:
            ns = request.match_info["ns"]
            if resource in self._uninstalled:
                return _status_response(404, "NotFound", "the server could not find the requested resource")
            try:
                selector = _Selector(
                    _parse_label_selector(request.query.get("labelSelector", "")),
                    _parse_field_selector(request.query.get("fieldSelector", "")),
                )
            except ValueError as exc:
                return _status_response(400, "BadRequest", str(exc))
            if request.query.get("watch") in ("1", "true", "True"):
                return await self._watch(request, resource, ns, selector)
            return self._list(request, resource, ns, selector)

        return handle

    def _list(self, request: web.Request, resource: str, ns: str, selector: _Selector) -> web.Response:
        rv_text = request.query.get("resourceVersion", "")
        if rv_text not in ("", "0") and int(rv_text) < self._gone_below():
            return _status_response(410, "Expired", f"too old resource version: {rv_text} ({self._rv})")
        token = request.query.get("continue")
        if token:
            if token not in self._continues:
                return _status_response(410, "Expired", "the continue token has expired")
            rv, items = self._continues.pop(token)
            if rv < self._compacted:
                return _status_response(410, "Expired", "the continue token has expired")
        else:
            rv = self._rv
            objs = [o for (n, _), o in sorted(self._objects[resource].items()) if n == ns and selector.matches(o)]
            items = [json.loads(json.dumps(o)) for o in objs]
        limit = int(request.query.get("limit", "0") or 0)
        meta: dict[str, Any] = {"resourceVersion": str(rv)}
        if limit > 0 and len(items) > limit:
            items, rest = items[:limit], items[limit:]
            token = f"c{next(self._continue_ids)}"
            self._continues[token] = (rv, rest)
            while len(self._continues) > MAX_CONTINUE_TOKENS:
                del self._continues[next(iter(self._continues))]
            meta["continue"] = token
            meta["remainingItemCount"] = len(rest)
        kind, api = _KIND[resource]
        for item in items:
            item.pop("kind", None)
            item.pop("apiVersion", None)
        return web.json_response({"kind": f"{kind}List", "apiVersion": api, "metadata": meta, "items": items})

    async def _get_pool(self, request: web.Request) -> web.Response:
        ns, name = request.match_info["ns"], request.match_info["name"]
        obj = self._objects[POOLS].get((ns, name))
        if obj is None:
            return _status_response(404, "NotFound", f'inferencepools.{POOL_GROUP} "{name}" not found')
        return web.json_response(obj)

    async def _stall(self) -> None:
        self._stalled += 1
        try:
            await self._unstalled.wait()
        finally:
            self._stalled -= 1

    async def _watch(self, request: web.Request, resource: str, ns: str, selector: _Selector) -> web.StreamResponse:
        if self._stall_new:
            await self._stall()  # the client sees an open connection and no answer
        rv_text = request.query.get("resourceVersion", "")
        gone = self.gone_storm or (rv_text not in ("", "0") and int(rv_text) < self._gone_below())
        if gone and self.watch_gone_as_http:
            return _status_response(410, "Expired", f"too old resource version: {rv_text} ({self._rv})")
        bookmarks = request.query.get("allowWatchBookmarks") in ("1", "true", "True")
        watch = _Watch(resource, ns, selector, bookmarks)
        if gone:
            watch.offer({"type": "ERROR", "object": _status(410, "Expired", f"too old resource version: {rv_text}")})
            watch.offer("close")
        elif rv_text in ("", "0"):  # no version: the current state as ADDED events, then changes
            for (n, _), o in sorted(self._objects[resource].items()):
                if n == ns and selector.matches(o):
                    watch.offer({"type": "ADDED", "object": o})
        else:
            since = int(rv_text)
            for ev in self._history:  # replay, then live events (no await in between: nothing is missed)
                if ev.rv > since:
                    out = watch.translate(ev)
                    if out is not None:
                        watch.offer(out)
        self._watches.append(watch)
        timeout = float(request.query.get("timeoutSeconds", "0") or 0) or None
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        try:
            await response.prepare(request)
            try:
                async with asyncio.timeout(timeout):
                    while True:
                        try:
                            item = await asyncio.wait_for(watch.queue.get(), self.bookmark_interval)
                        except TimeoutError:  # quiet for bookmark_interval: a bookmark, as the real server sends
                            if bookmarks:
                                await response.write(json.dumps(self._bookmark(resource)).encode() + b"\n")
                            continue
                        if item == "stall":
                            await self._stall()
                            continue
                        if item == "close":
                            break
                        if item == "drop":
                            if request.transport is not None:
                                request.transport.abort()
                            return response
                        await response.write(json.dumps(item).encode() + b"\n")
            except TimeoutError:
                pass  # timeoutSeconds: the stream ends cleanly
            await response.write_eof()
        except ConnectionError:
            pass  # the client went away
        finally:
            watch.closed = True
            self._watches.remove(watch)
        return response


class ThreadedFakeKube:
    """The FAKE API server run on its own event-loop thread (``running_fake_kube``): the same mutators, each
    carried out on the server's loop and waited for, so a synchronous test can call them."""

    def __init__(self, server: FakeKubeApiServer, loop: asyncio.AbstractEventLoop) -> None:
        self.server = server
        self._loop = loop

    def _call(self, fn: Callable[..., T], *args: Any) -> T:
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            try:
                fut.set_result(fn(*args))
            except BaseException as exc:
                fut.set_exception(exc)

        self._loop.call_soon_threadsafe(run)
        return fut.result(timeout=30)

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def requests(self) -> list[tuple[str, str, dict[str, str]]]:
        return self._call(lambda: list(self.server.requests))

    @property
    def resource_version(self) -> int:
        return self._call(lambda: self.server.resource_version)

    def write_kubeconfig(self, path: Path, namespace: str = "default") -> Path:
        return self.server.write_kubeconfig(path, namespace)

    def put_pool(self, name: str, namespace: str, match_labels: dict[str, str], target_ports: list[int]) -> None:
        self._call(self.server.put_pool, name, namespace, match_labels, target_ports)

    def delete_pool(self, name: str, namespace: str) -> None:
        self._call(self.server.delete_pool, name, namespace)

    def put_pod(
        self,
        name: str,
        namespace: str,
        labels: dict[str, str],
        ip: str | None,
        ready: bool,
        annotations: dict[str, str] | None = None,
    ) -> None:
        self._call(self.server.put_pod, name, namespace, labels, ip, ready, annotations)

    def set_ready(self, name: str, namespace: str, ready: bool) -> None:
        self._call(self.server.set_ready, name, namespace, ready)

    def start_terminating(self, name: str, namespace: str) -> None:
        self._call(self.server.start_terminating, name, namespace)

    def set_phase(self, name: str, namespace: str, phase: str) -> None:
        self._call(self.server.set_phase, name, namespace, phase)

    def delete_pod(self, name: str, namespace: str) -> None:
        self._call(self.server.delete_pod, name, namespace)

    def put_object(self, resource: str, namespace: str, obj: dict[str, Any]) -> None:
        self._call(self.server.put_object, resource, namespace, obj)

    def delete_object(self, resource: str, namespace: str, name: str) -> None:
        self._call(self.server.delete_object, resource, namespace, name)

    def uninstall(self, resource: str) -> None:
        self._call(self.server.uninstall, resource)

    def install(self, resource: str) -> None:
        self._call(self.server.install, resource)

    def expire_watches(self) -> None:
        self._call(self.server.expire_watches)

    def bookmark(self) -> None:
        self._call(self.server.bookmark)

    def close_watches(self) -> None:
        self._call(self.server.close_watches)

    def drop_watches(self) -> None:
        self._call(self.server.drop_watches)

    def bump(self, n: int = 1) -> None:
        self._call(self.server.bump, n)

    def stall_watches(self, new_too: bool = False) -> None:
        self._call(self.server.stall_watches, new_too)

    def unstall_watches(self) -> None:
        self._call(self.server.unstall_watches)

    def stalled_watches(self) -> int:
        return self._call(self.server.stalled_watches)

    def set_gone_storm(self, on: bool) -> None:
        def apply() -> None:
            self.server.gone_storm = on

        self._call(apply)

    def fail_requests(self, n_or_bool: int | bool) -> None:
        self._call(self.server.fail_requests, n_or_bool)

    def open_watches(self, resource: str = PODS) -> int:
        return self._call(self.server.open_watches, resource)


@contextlib.contextmanager
def running_fake_kube(token: str | None = DEFAULT_TOKEN) -> Iterator[ThreadedFakeKube]:
    """A FAKE Kubernetes API server on a thread of its own, for synchronous tests; stopped on exit."""
    loop = asyncio.new_event_loop()
    server = FakeKubeApiServer(token=token)
    started = threading.Event()

    def main() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(server.start())
        started.set()
        loop.run_forever()
        loop.run_until_complete(server.stop())
        loop.close()

    thread = threading.Thread(target=main, name="fake-kube-api", daemon=True)
    thread.start()
    if not started.wait(30):
        raise RuntimeError("the fake Kubernetes API server did not start")
    try:
        yield ThreadedFakeKube(server, loop)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
