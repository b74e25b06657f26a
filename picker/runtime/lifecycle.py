"""Picker lifecycle: start (every port bound, or a one-line ``StartupError``) → serve → drain (not ready, the
propagation delay, refuse, let streams finish) → a bounded stop; readiness published when an input changes.
See docs/picker.md, "Lifecycle".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import grpc
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from picker.config import loopback_host, unauthenticated_exposure
from picker.extproc.service import ExternalProcessor
from picker.runtime.admin import AdminRoutes, build_admin_app
from picker.runtime.app import PickerApp
from picker.runtime.envoy_needs import response_cache_log_fields
from picker.runtime.errors import StartupError
from picker.runtime.tls import (
    BearerTokenInterceptor,
    ServerTls,
    TlsSetupError,
    bind_is_loopback,
    read_token,
    server_tls,
)
from picker.shared.supervisor import TaskFailure, TaskSupervisor

log = logging.getLogger("kv_epp.server")

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
# Readiness under every name a gateway probes ("inference-extension": the GIE conformance manifests and
# the llm-d chart); liveness stays SERVING until the process exits.
READINESS_SERVICES = ("", "readiness", EXT_PROC_SERVICE, "inference-extension")
# What Envoy's active health check reads: SERVING from start until the drain, whatever else happens. A crashed
# background task turns readiness off (/readyz, kubelet) but the picker still routes (Tier 1 at worst), and
# Envoy must keep sending it streams: with no healthy picker Envoy answers 500 or fails open around it.
ACCEPTING_SERVICE = "kv-epp.accepting"
T = TypeVar("T")


def run_loop(main: Coroutine[Any, Any, T], loop: str = "auto") -> T:
    """Run the picker's event loop: uvloop when installed (``extproc.event_loop`` auto or uvloop), else
    asyncio's own. Measured here, one connection, 4 KB requests through Envoy: uvloop takes about 0.1 ms off
    the picker's added p50 (docs/operations.md, "Response modes and what they cost")."""
    if loop != "asyncio":
        try:
            import uvloop
        except ImportError:
            if loop == "uvloop":
                raise
        else:
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                return runner.run(main)
    return asyncio.run(main)


GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.so_reuseport", 0),
    # No BDP probing: the HTTP/2 receive window stays small, so Envoy cannot push megabytes of a body the
    # picker is about to refuse into gRPC's buffers (50 stalled 8 MiB uploads: RSS growth 74-140 MiB with
    # probing, 57-75 MiB without, for a 32 MiB body budget).
    ("grpc.http2.bdp_probe", 0),
]
CONFIG_POLL_SECONDS = 1.0
TASK_STOP_SECONDS = 5.0  # background tasks only wait on their own sockets: a few seconds is plenty
HOOK_STOP_SECONDS = 5.0  # one on_stop hook (closing a client session)
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _os_reason(exc: OSError) -> str:
    """``Address already in use`` rather than aiohttp's long ``[Errno 98] error while attempting ...``."""
    return os.strerror(exc.errno) if exc.errno else str(exc)


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _check_bindable(what: str, host: str, port: int) -> None:
    """Raise StartupError when ``host:port`` is taken.

    gRPC reports a busy port only after its C core has logged its own error line on stderr, so the
    port is tried here first (same SO_REUSEADDR semantics as gRPC's listener).
    """
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host.strip("[]") or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        raise StartupError(f"{what} {_hostport(host, port)}: cannot resolve host: {exc}") from None
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(addr)
            except OSError as exc:
                raise StartupError(f"{what} {_hostport(host, port)}: {_os_reason(exc)}") from None


def _grpc_port(
    server: grpc.aio.Server, what: str, host: str, port: int, credentials: grpc.ServerCredentials | None = None
) -> int:
    _check_bindable(what, host, port)
    try:
        if credentials is not None:
            return int(server.add_secure_port(_hostport(host, port), credentials))
        return int(server.add_insecure_port(_hostport(host, port)))
    except RuntimeError as exc:  # grpcio raises RuntimeError("Failed to bind ...") on a busy port
        raise StartupError(f"{what} {_hostport(host, port)}: cannot bind ({exc})") from None


class PickerServer:
    """Owns the servers and background tasks of one picker process, from start to a bounded stop."""

    def __init__(self, app: PickerApp, admin_extra: list[AdminRoutes] | None = None) -> None:
        self.app = app
        self.health = health.aio.HealthServicer()
        self._started = False  # every port listens (ACCEPTING_SERVICE turns SERVING)
        self.servicer = ExternalProcessor(app.path, app.metrics, app.settings.extproc, app.sampling)
        self.supervisor = TaskSupervisor(
            on_failure=self._task_failed,
            logger=log,
            on_spawn=lambda name: self.app.metrics.background_task_failures.labels(name).inc(0),
        )
        self._grpc: grpc.aio.Server | None = None
        self._health_grpc: grpc.aio.Server | None = None
        self.tls = ServerTls(None, "off")  # the ext_proc port's credentials, set at start
        self.auth: BearerTokenInterceptor | None = None
        self._admin: web.AppRunner | None = None
        self._admin_extra = admin_extra or []
        self._stopping = False  # stop() has begun
        self._draining = False  # drain_and_stop() has begun
        self._refusing = False  # the drain refuses new streams (after its propagation)
        self._hurry = asyncio.Event()  # a second stop signal: skip the remaining waits
        self._done = asyncio.Event()  # stop() has finished: servers closed, tasks ended
        self._drain_task: asyncio.Task[None] | None = None
        self.background: list[Callable[[], Coroutine[Any, Any, None]]] = []  # extra long-running coroutines
        self.on_stop: list[Callable[[], Awaitable[None]]] = []
        self._readiness_inputs = asyncio.Event()  # set when something readiness depends on changed
        self._published_ready: bool | None = None  # what the readiness services say now (None: not yet set)
        self._publishing = asyncio.Lock()  # one publication at a time: a stale one never overwrites a newer one
        app.on_readiness_inputs = self._readiness_inputs.set
        self.extproc_port = 0
        self.health_port = 0
        self.admin_port = 0

    # -- start ------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Bind every port and start serving; on failure close what started and raise."""
        try:
            await self._start_servers()
        except BaseException:
            await self._close_servers()
            await self._close_clients()  # built with the app (e.g. Tier 4's tokenizer): closed even if unused
            raise
        if self.app.config_path is not None:
            self.supervisor.spawn("config-watcher", self._watch_config)
        if self.app.discovery is not None:
            self.supervisor.spawn("pool-discovery", self.app.follow_discovery)
        for coro in self.background:
            self.supervisor.spawn(self._task_name(coro), coro)
        await self.health.set("liveness", SERVING)
        self.app.ready = True
        self._started = True
        await self._publish_readiness()
        self.supervisor.spawn("readiness", self._follow_readiness)
        s = self.app.settings
        log.info(
            "event=picker_started extproc_port=%d health_port=%d admin_port=%d strategy=%s pool=%s backends=%d %s %s",
            self.extproc_port, self.health_port, self.admin_port, s.selection_strategy, self.app.pool_source,
            len(self.app.pool.names()), self._tls_fields(), response_cache_log_fields(s),
        )  # fmt: skip

    def _tls_fields(self) -> str:
        """``tls=on cert=files serial=.. sha256=.. client_cert=required token=off``: never a secret."""
        if not self.tls.on:
            return f"tls=off token={'on' if self.auth else 'off'}"
        info = self.tls.info
        cert = f" serial={info.serial} sha256={info.sha256} not_after={info.not_after}" if info else ""
        return (
            f"tls=on cert={self.tls.source}{cert} client_cert={'required' if self.tls.client_auth else 'off'} "
            f"token={'on' if self.auth else 'off'}"
        )

    def _check_exposure(self) -> None:
        """Refuse ext_proc beyond loopback without client authentication (unless ``allow_unauthenticated``): the
        config check decides for an IP literal, a name is resolved here. Allowed, it is warned and shown in
        ``/readyz`` (``PickerApp.extproc_access``)."""
        x = self.app.settings.extproc
        loopback = bind_is_loopback(x.host)
        refused = unauthenticated_exposure(x, loopback)
        if refused is not None:
            raise StartupError(f"{refused[0]}: {refused[1]}")
        access: dict[str, object] = {
            "host": x.host,
            "loopback": loopback,
            "client_auth": list(x.client_authentication),
            "max_streams_per_peer": x.max_streams_per_peer,
        }
        if not loopback and not x.client_authentication:  # allowed: extproc.auth.allow_unauthenticated
            risk = "anyone who reaches the port can open streams, hold in-flight leases and steer routing"
            access["warning"] = (
                f"extproc.auth.allow_unauthenticated: ext_proc listens beyond loopback without client authentication; "
                f"{risk}"
            )
            if loopback_host(x.host) is None:  # an IP literal was warned already (event=config_warning)
                log.warning(
                    "event=config_warning path=extproc.auth.allow_unauthenticated message=%r",
                    f"{x.host!r} resolves beyond loopback and ext_proc has no client authentication: {risk}",
                )
        self.app.extproc_access = access

    async def _start_servers(self) -> None:
        s = self.app.settings
        self._check_exposure()
        refused = self.app.metrics.extproc_refused_streams
        for reason in ("unauthenticated", "peer_limit"):  # from the start: increase() sees the first refusal
            self.app.metrics.child(refused, reason).inc(0)
        try:
            self.tls = server_tls(s.extproc)
            if s.extproc.auth.token_file is not None:
                unauthenticated = self.app.metrics.child(refused, "unauthenticated")
                self.auth = BearerTokenInterceptor(read_token(s.extproc.auth.token_file), unauthenticated.inc)
        except TlsSetupError as exc:
            raise StartupError(f"ext_proc tls: {exc}") from None
        interceptors = [self.auth] if self.auth is not None else []
        self._grpc = grpc.aio.server(options=GRPC_OPTIONS, interceptors=interceptors)
        pb_grpc.add_ExternalProcessorServicer_to_server(self.servicer, self._grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._grpc)
        creds = self.tls.credentials
        self.extproc_port = _grpc_port(self._grpc, "ext_proc port", s.extproc.host, s.extproc.port, creds)
        self.health_port = self.extproc_port
        # The separate health port is plaintext and serves only gRPC health: kubelet gRPC probes do not do TLS.
        if s.extproc.health_port is not None and s.extproc.health_port != s.extproc.port:
            self._health_grpc = grpc.aio.server(options=GRPC_OPTIONS)
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self._health_grpc)
            self.health_port = _grpc_port(self._health_grpc, "health port", s.extproc.host, s.extproc.health_port)
        if s.admin.enabled:
            await self._start_admin()
        await self._grpc.start()
        if self._health_grpc is not None:
            await self._health_grpc.start()

    async def _start_admin(self) -> None:
        s = self.app.settings.admin
        admin_app = build_admin_app(self.app, self._admin_extra)
        self._admin = web.AppRunner(admin_app, access_log=None)
        await self._admin.setup()
        site = web.TCPSite(self._admin, s.host, s.port)
        try:
            await site.start()
        except OSError as exc:  # aiohttp: "[Errno 98] error while attempting to bind ..."
            raise StartupError(f"admin port {_hostport(s.host, s.port)}: {_os_reason(exc)}") from None
        server = getattr(site, "_server", None)
        sockets = getattr(server, "sockets", None) or []
        self.admin_port = sockets[0].getsockname()[1] if sockets else s.port

    @staticmethod
    def _task_name(fn: Callable[..., Any]) -> str:
        """``Tier4.run`` for a bound method, the function's name otherwise: a short, fixed metric label."""
        name = str(getattr(fn, "__name__", "task"))
        owner = getattr(fn, "__self__", None)
        return f"{type(owner).__name__}.{name}" if owner is not None else name

    def ready_line(self) -> str:
        """The one line printed on stdout once every port listens: what a supervisor or a test waits for."""
        s = self.app.settings
        admin = _hostport(s.admin.host, self.admin_port) if self._admin is not None else "off"
        return (
            f"kv-epp ready extproc={_hostport(s.extproc.host, self.extproc_port)} "
            f"health={_hostport(s.extproc.host, self.health_port)} admin={admin} tls={'on' if self.tls.on else 'off'}"
        )

    async def _watch_config(self) -> None:
        path = self.app.config_path
        assert path is not None
        last = path.stat().st_mtime_ns if path.exists() else 0
        while True:
            await asyncio.sleep(CONFIG_POLL_SECONDS)
            try:
                mtime = path.stat().st_mtime_ns
            except OSError:
                continue
            if mtime != last:
                last = mtime
                self.app.reload()

    # -- readiness --------------------------------------------------------------------------------
    @property
    def not_ready_reason(self) -> str | None:
        """Why a background task made the picker not ready (the first crash), or None."""
        return self.app.task_failure

    async def _task_failed(self, failure: TaskFailure) -> None:
        self.app.metrics.background_task_failures.labels(failure.task).inc()
        if self.app.task_failure is None:
            self.app.task_failure = failure.reason
        await self._publish_readiness()

    async def _publish_readiness(self) -> float | None:
        """Evaluate readiness (``PickerApp.readiness``) and publish it where it changed: the readiness
        services, ``continuum_picker_ready``; ``kv-epp.accepting`` SERVING from start until the drain (or until
        it refuses streams: ``extproc.accepting_until``).
        Returns when readiness may change by itself (a feed's grace ends), or None."""
        async with self._publishing:
            r = self.app.readiness()
            ready = r.ready and self._started and self.supervisor.healthy
            if ready != self._published_ready:
                self._published_ready = ready
                for svc in READINESS_SERVICES:
                    await self.health.set(svc, SERVING if ready else NOT_SERVING)
                self.app.metrics.ready.set(1 if ready else 0)
                log.info("event=readiness ready=%s reason=%r", ready, r.body.get("reason"))
            refusing = self.app.draining if self.app.settings.extproc.accepting_until == "drain" else self._refusing
            accepting = self._started and not refusing
            await self.health.set(ACCEPTING_SERVICE, SERVING if accepting else NOT_SERVING)
            return r.due

    async def _follow_readiness(self) -> None:
        """Background (supervised): re-publish readiness whenever an input changed or a grace ends."""
        while True:
            self._readiness_inputs.clear()
            due = await self._publish_readiness()
            timeout = None if due is None else max(0.0, due - time.monotonic()) + 0.005
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._readiness_inputs.wait(), timeout)

    # -- drain and stop ---------------------------------------------------------------------------
    async def _pause(self, seconds: float, until: Coroutine[Any, Any, None] | None = None) -> None:
        """Wait ``seconds``, or less when ``until`` completes or a second signal hurries."""
        waits: list[asyncio.Future[Any]] = [asyncio.ensure_future(self._hurry.wait())]
        if until is not None:
            waits.append(asyncio.ensure_future(until))
        try:
            await asyncio.wait(waits, timeout=max(0.0, seconds), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    async def drain_and_stop(self) -> None:
        """Not ready, wait for propagation, refuse new streams, let open ones finish (bounded), stop."""
        if self._draining or self._stopping:
            return
        self._draining = True
        try:
            s = self.app.settings.extproc
            self.app.draining = True
            await self._publish_readiness()
            log.info(
                "event=picker_draining phase=not_ready propagation_s=%.1f open_streams=%d",
                s.drain_propagation_seconds, self.servicer.open_streams,
            )  # fmt: skip
            await self._pause(s.drain_propagation_seconds)
            self.servicer.admitting = False
            self.app.path.flow.close()  # what waits in flow control is answered 503 rejected-shutting-down
            self._refusing = True
            await self._publish_readiness()  # accepting_until "refusing": Envoy's health check learns it now
            log.info(
                "event=picker_draining phase=refusing open_streams=%d grace_s=%.1f",
                self.servicer.open_streams, s.drain_seconds,
            )  # fmt: skip
            if self.servicer.open_streams:
                await self._pause(s.drain_seconds, self.servicer.wait_idle())
            if self.servicer.open_streams:
                log.warning("event=picker_drain_deadline open_streams=%d", self.servicer.open_streams)
        except Exception as exc:  # a bug here must not keep the process from stopping
            log.error("event=picker_drain_failed error=%r", exc)
        finally:
            await self.stop()

    async def stop(self) -> None:
        """Stop now: refuse streams, stop ext_proc (cancelling open streams), tasks, clients, servers."""
        if self._stopping:
            await self._done.wait()
            return
        self._stopping = True
        self.app.draining = True
        self._refusing = True
        self.servicer.admitting = False
        try:
            if self._grpc is not None:
                await self._grpc.stop(grace=0)  # streams had their drain; none may outlive the clients below
                self._grpc = None
            stuck = await self.supervisor.stop(TASK_STOP_SECONDS)
            await self._close_clients()
            await self._close_servers()
            log.info(
                "event=picker_stopped refused_streams=%d unauthenticated=%d peer_limit=%d stuck_tasks=%d",
                self.servicer.refused, self.auth.refused if self.auth else 0, self.servicer.peer_refused, len(stuck),
            )  # fmt: skip
        finally:
            self._done.set()

    async def _close_clients(self) -> None:
        for hook in self.on_stop:
            try:
                await asyncio.wait_for(hook(), HOOK_STOP_SECONDS)
            except Exception as exc:  # TimeoutError included: one bad client must not block the rest
                log.warning("event=stop_hook_failed hook=%s error=%r", self._task_name(hook), exc)

    async def _close_servers(self) -> None:
        for server in (self._grpc, self._health_grpc):
            if server is not None:
                with contextlib.suppress(Exception):
                    await server.stop(grace=0)
        self._grpc = self._health_grpc = None
        if self._admin is not None:
            with contextlib.suppress(Exception):
                await self._admin.cleanup()
            self._admin = None

    async def wait(self) -> None:
        """Return once stop() has finished."""
        await self._done.wait()

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_stop_signal, sig)
        loop.add_signal_handler(signal.SIGHUP, self.app.reload)

    def _on_stop_signal(self, sig: signal.Signals) -> None:
        if self._drain_task is None:
            log.info("event=signal signal=%s action=drain", sig.name)
            self._drain_task = asyncio.get_running_loop().create_task(self.drain_and_stop(), name="drain")
        else:
            log.info("event=signal signal=%s action=hurry", sig.name)
            self._hurry.set()
