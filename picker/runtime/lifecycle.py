"""Picker lifecycle: start -> serve -> drain -> stop.

Starts the ext_proc gRPC server (with gRPC health: liveness, readiness and the ext_proc service
name), the optional separate health port, the admin HTTP server and the config watcher. SIGTERM and
SIGINT drain: readiness goes NOT_SERVING, open streams get ``drain_seconds`` to finish, then stop.
SIGHUP (or a changed config file) reloads the hot-reloadable sections.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import grpc
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from picker.extproc.service import ExternalProcessor
from picker.ops.admin import AdminRoutes, build_admin_app
from picker.runtime.app import PickerApp

log = logging.getLogger("kv_epp.server")

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
HEALTH_SERVICES = ("", "liveness", "readiness", EXT_PROC_SERVICE)
GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.so_reuseport", 0),
]
CONFIG_POLL_SECONDS = 1.0


class PickerServer:
    """Owns the servers and background tasks of one picker process."""

    def __init__(self, app: PickerApp, admin_extra: list[AdminRoutes] | None = None) -> None:
        self.app = app
        self.health = health.aio.HealthServicer()
        self._grpc: grpc.aio.Server | None = None
        self._health_grpc: grpc.aio.Server | None = None
        self._admin: web.AppRunner | None = None
        self._admin_extra = admin_extra or []
        self._tasks: list[asyncio.Task[None]] = []
        self._stopped = asyncio.Event()  # stop() has begun
        self._done = asyncio.Event()  # stop() has finished: servers closed, tasks ended
        self.background: list[Callable[[], Coroutine[Any, Any, None]]] = []  # extra long-running coroutines
        self.on_stop: list[Callable[[], Awaitable[None]]] = []
        self.extproc_port = 0
        self.admin_port = 0

    async def start(self) -> None:
        s = self.app.settings
        self._grpc = grpc.aio.server(options=GRPC_OPTIONS)
        pb_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessor(self.app), self._grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._grpc)
        self.extproc_port = self._grpc.add_insecure_port(f"{s.extproc.host}:{s.extproc.port}")
        await self._grpc.start()
        if s.extproc.health_port is not None and s.extproc.health_port != s.extproc.port:
            self._health_grpc = grpc.aio.server(options=GRPC_OPTIONS)
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self._health_grpc)
            self._health_grpc.add_insecure_port(f"{s.extproc.host}:{s.extproc.health_port}")
            await self._health_grpc.start()
        if s.admin.enabled:
            self._admin = web.AppRunner(build_admin_app(self.app, self._admin_extra), access_log=None)
            await self._admin.setup()
            site = web.TCPSite(self._admin, s.admin.host, s.admin.port)
            await site.start()
            server = getattr(site, "_server", None)
            sockets = getattr(server, "sockets", None) or []
            self.admin_port = sockets[0].getsockname()[1] if sockets else s.admin.port
        if self.app.config_path is not None:
            self._tasks.append(asyncio.create_task(self._watch_config()))
        for coro in self.background:
            self._tasks.append(asyncio.create_task(coro()))
        for svc in HEALTH_SERVICES:
            await self.health.set(svc, health_pb2.HealthCheckResponse.SERVING)
        self.app.ready = True
        log.info(
            "event=picker_started extproc_port=%d admin_port=%d strategy=%s backends=%d",
            self.extproc_port, self.admin_port, s.selection_strategy, len(s.pool.backends),
        )  # fmt: skip

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

    async def drain_and_stop(self) -> None:
        """Stop taking new work, let open streams finish (bounded), then stop everything."""
        if self._stopped.is_set():
            return
        self.app.draining = True
        for svc in ("readiness", EXT_PROC_SERVICE, ""):
            await self.health.set(svc, health_pb2.HealthCheckResponse.NOT_SERVING)
        grace = self.app.settings.extproc.drain_seconds
        log.info("event=picker_draining open_streams=%d grace_s=%.1f", self.app.open_streams, grace)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while self.app.open_streams > 0 and loop.time() < deadline:
            await asyncio.sleep(0.05)
        await self.stop()

    async def stop(self) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        for hook in self.on_stop:
            with contextlib.suppress(Exception):
                await hook()
        if self._grpc is not None:
            await self._grpc.stop(grace=0.5)
        if self._health_grpc is not None:
            await self._health_grpc.stop(grace=0.1)
        if self._admin is not None:
            await self._admin.cleanup()
        log.info("event=picker_stopped")
        self._done.set()

    async def wait(self) -> None:
        await self._done.wait()

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: asyncio.ensure_future(self.drain_and_stop()))
        loop.add_signal_handler(signal.SIGHUP, self.app.reload)
