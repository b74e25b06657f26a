"""Admin HTTP (aiohttp, 127.0.0.1 by default): ``/metrics``, ``/healthz``, ``/readyz`` and the seed's ``/admin/*``,
with the bearer token and the cross-site checks; the features' route groups are ``picker.runtime.admin_routes``.
See docs/picker.md, "Admin".
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any, Protocol
from urllib.parse import urlsplit

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from picker.config import ConfigError, Settings
from picker.ops.llmd import exported
from picker.runtime.admin_routes import gemini_context_cache_routes, kv_index_routes, response_cache_routes
from picker.runtime.app import PickerApp
from picker.runtime.envoy_needs import response_cache_detail
from picker.runtime.errors import StartupError

log = logging.getLogger("kv_epp.admin")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class AdminRoutes(Protocol):
    """A feature that adds admin routes (GET/POST path -> handler)."""

    def admin_routes(self) -> list[web.RouteDef]: ...


def prefix_routing_stats(app: PickerApp) -> dict[str, Any]:
    """GET /admin/prefix-routing/stats in the seed's shape."""
    s = app.settings.prefix_routing
    c = app.recorder.counts
    total = sum(c.values())
    overflow_rate = c.get("overflow", 0) / total if total else 0.0
    return {
        "enabled": s.enabled,
        "config": {
            "max_prefix_length": s.max_prefix_length,
            "load_factor_epsilon": s.load_factor_epsilon,
            "virtual_nodes": s.virtual_nodes,
            "anthropic_cache_control_injection": s.anthropic_cache_control_injection,
        },
        "routing_decisions": {
            "total": total,
            "prefix_hash": c.get("prefix_hash", 0),
            "overflow": c.get("overflow", 0),
            "fallback": c.get("fallback", 0),
            "overflow_rate": f"{overflow_rate:.4f}",
        },
        "backend_distribution": [
            {"backend": name, "in_flight_requests": n} for name, n in app.pool.in_flight().items()
        ],
        "unique_prefixes": len(app.recorder.prefixes_seen),
    }


STATE_CHANGING = frozenset({"POST", "PUT", "DELETE", "PATCH"})


def bearer_token_matches(authorization: str, token: str) -> bool:
    """``Authorization: <scheme> <token>`` with the scheme ``Bearer`` in any case (RFC 7235); the token
    is compared in constant time."""
    scheme, _, credentials = authorization.strip().partition(" ")
    is_bearer = scheme.lower() == "bearer"
    same = hmac.compare_digest(credentials.strip().encode(), token.encode())
    return is_bearer and same


def cross_site_problem(request: web.Request, admin_host: str) -> str | None:
    """Why a state-changing /admin/* request may come from another site's page, or None.

    A page can send a cross-site POST without a CORS preflight only as a "simple request": a form or
    text/plain body, and always with its own Origin. Requiring ``application/json`` and, when Origin is
    present, the admin's own host:port (the listening socket, not the Host header a rebinding DNS name
    controls) leaves such a page nothing to send.
    """
    if request.content_type != "application/json":
        return "state-changing admin requests need Content-Type: application/json"
    origin = request.headers.get("Origin")
    if origin is not None and not _own_origin(request, origin, admin_host):
        return "cross-origin admin request refused"
    return None


def _own_origin(request: web.Request, origin: str, admin_host: str) -> bool:
    try:
        parts = urlsplit(origin)
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    except ValueError:
        return False
    sock = request.transport.get_extra_info("sockname") if request.transport is not None else None
    if not parts.hostname or not isinstance(sock, tuple) or port != sock[1]:
        return False
    host = parts.hostname.lower()
    try:
        local = ipaddress.ip_address(str(sock[0]).split("%")[0])
    except ValueError:
        return False
    if host == "localhost":
        return local.is_loopback
    if host == admin_host.lower() and admin_host not in ("0.0.0.0", "::", ""):
        return True  # the name the admin was configured to listen on
    try:
        return ipaddress.ip_address(host) == local
    except ValueError:
        return False


class AdminToken:
    """The token /admin/* requires, from ``admin.bearer_token`` or ``admin.bearer_token_file``.

    The file is read at construction (``ConfigError`` naming ``admin.bearer_token_file`` when it cannot be) and
    again when it changes (inode, mtime or size: a rotated Secret) or a config reload was applied, noticed at the
    next /admin/* request (the reload handler asks at once). A file that cannot be read keeps the token in force
    and logs ``event=admin_token_reload_failed`` once (the token is never logged)."""

    def __init__(self, app: PickerApp) -> None:
        self.app = app
        self._settings: Settings = app.settings
        self._stamp = self._file_stamp(app.settings)
        self._token = app.settings.admin.read_bearer_token()

    @staticmethod
    def _file_stamp(settings: Settings) -> tuple[int, int, int] | None:
        """(inode, mtime, size) of the token file (following symlinks: a Kubernetes Secret volume swaps its
        ``..data`` link on rotation), None without a file or when it cannot be read."""
        path = settings.admin.bearer_token_file
        if path is None:
            return None
        try:
            st = os.stat(path)
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def current(self) -> str | None:
        """The token in force (None: /admin/* is open); re-read when the settings were reloaded."""
        self.refresh()
        return self._token

    def refresh(self) -> str | None:
        """Re-read the token if the settings changed since the last read, or the token file did (a rotated
        Secret: one stat per /admin/* request, never on the request path); the problem when that failed."""
        settings = self.app.settings
        stamp = self._file_stamp(settings)
        if settings is self._settings and stamp == self._stamp:
            return None
        self._settings = settings
        self._stamp = stamp
        try:
            self._token = settings.admin.read_bearer_token()
        except ConfigError as exc:
            problem = "; ".join(f"{path}: {msg}" for path, msg in exc.problems)
            log.error("event=admin_token_reload_failed problem=%r (the previous token stays)", problem)
            return f"{problem} (the previous token stays)"
        return None


def _admin_token(app: PickerApp) -> AdminToken:
    """The app's AdminToken; an unreadable token file stops the start-up with one line naming the key."""
    try:
        return AdminToken(app)
    except ConfigError as exc:
        raise StartupError("; ".join(f"{path}: {msg}" for path, msg in exc.problems)) from None


def build_admin_app(app: PickerApp, extra: list[AdminRoutes] | None = None) -> web.Application:
    """The admin app; raises ``StartupError`` when ``admin.bearer_token_file`` cannot be read."""
    token = _admin_token(app)
    admin_host = app.settings.admin.host

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path.startswith("/admin"):
            required = token.current()
            if required and not bearer_token_matches(request.headers.get("Authorization", ""), required):
                return web.json_response({"error": "unauthorized"}, status=401)
            if request.method in STATE_CHANGING:
                problem = cross_site_problem(request, admin_host)
                if problem is not None:
                    return web.json_response({"error": problem}, status=403)
        return await handler(request)

    async def metrics(_: web.Request) -> web.Response:
        app.refresh_gauges()
        llmd = app.recorder.llmd_collector
        llmd.deferred = True  # llm-d's request families: rendered below, off the event loop (they are most of it)
        try:
            body = generate_latest(exported(app.metrics.registry, app.settings.metrics.compat))
        finally:
            llmd.deferred = False
        series = llmd.request_series()
        if series:
            body += await asyncio.to_thread(llmd.render_requests, series)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(_: web.Request) -> web.Response:
        """200 or 503 with ``PickerApp.readiness``'s detail: status, reason, pool, feeds (caught_up, stale,
        connecting per live backend); with Tier 4 also the feed checks (``kv_feeds``), which never decide."""
        r = app.readiness()
        body = dict(r.body)
        cache = response_cache_detail(app.settings, app.response_cache.miss_bodies, app.response_cache.stored)
        if cache is not None:  # the Envoy response mode the cache needs, whether response bodies reach it
            body["response_cache"] = cache
        if app.extproc_access is not None:  # who may open streams; a "warning" when anyone who reaches it may
            body["extproc"] = app.extproc_access
        if app.shared_load is not None:  # detail only: without the shared view the picker routes on its own counts
            body["shared_load"] = app.shared_load.status()
        if app.path.flow.cfg.enabled:  # detail only: a saturated pool queues, it is not unready
            body["flow_control"] = app.path.flow.stats()
        if app.tier4 is not None:  # detail only: a wrong feed costs Tier 4, never the picker's routing
            body["kv_feeds"] = app.tier4.checks.report()
            if app.tier4.unmatched_models:
                body["kv_unmatched_models"] = app.tier4.unmatched_report()
        return web.json_response(body, status=200 if r.ready else 503)

    async def prefix_stats(_: web.Request) -> web.Response:
        return web.json_response(prefix_routing_stats(app))

    async def pool(_: web.Request) -> web.Response:
        body = {
            "backends": app.pool.health_snapshot(),
            "ttft_model": app.pool.cost_model(),
            "pool": app.pool_status(),
            "discovery": app.discovery.status() if app.discovery is not None else None,
            "disaggregation": app.path.disagg.report(),  # P/D (docs/pd.md): settings, roles, the transfer fit
            # the load view shared with the other pickers (docs/scale-out.md)
            "shared_load": app.shared_load.status() if app.shared_load is not None else {"enabled": False},
        }
        return web.json_response(body)

    async def experiments(_: web.Request) -> web.Response:
        """The experiment's arms, their counts and the decision log's (docs/experiments.md)."""
        return web.json_response(app.path.experiments.stats())

    async def flow_control(_: web.Request) -> web.Response:
        body = app.path.flow.stats()
        if app.objective_watch is not None:  # where watched_objectives come from, and how that goes
            body["objective_watch"] = app.objective_watch.status()
        return web.json_response(body)

    async def model_rewrites(_: web.Request) -> web.Response:
        """The model rewrites in force (config and watched) and the watch's state (docs/llm-d-compat.md)."""
        body = app.path.rewrites.stats()
        if app.rewrite_watch is not None:
            body["rewrite_watch"] = app.rewrite_watch.status()
        return web.json_response(body)

    async def reload(_: web.Request) -> web.Response:
        applied, messages = app.reload()
        problem = token.refresh()  # the token file is re-read with the reload, not at the next request only
        if problem is not None:
            messages = [*messages, problem]
        return web.json_response({"success": applied, "messages": messages}, status=200 if applied else 400)

    web_app = web.Application(middlewares=[auth], client_max_size=1 << 20)
    web_app.add_routes(
        [
            web.get("/metrics", metrics),
            web.get("/healthz", healthz),
            web.get("/readyz", readyz),
            web.get("/admin/prefix-routing/stats", prefix_stats),
            web.get("/admin/pool", pool),
            web.get("/admin/flow-control", flow_control),
            web.get("/admin/experiments", experiments),
            web.get("/admin/model-rewrites", model_rewrites),
            web.post("/admin/config/reload", reload),
        ]
    )
    web_app.add_routes(kv_index_routes(app))
    web_app.add_routes(gemini_context_cache_routes(app))
    web_app.add_routes(response_cache_routes(app))
    for provider in extra or []:
        web_app.add_routes(provider.admin_routes())
    return web_app
