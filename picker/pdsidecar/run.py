"""``kv-epp pd-sidecar``'s lifecycle: check the flags, start (the allowlist's source, the HTTP client, the listening
ports), print one ready line on stdout, serve until SIGTERM or SIGINT, drain (in-flight requests get
``--drain-seconds``), stop. A bad flag or a busy port: one ``error:`` line on stderr, exit 2.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from picker.pdsidecar.allowlist import Allowlist
from picker.pdsidecar.connectors import make_connector
from picker.pdsidecar.metrics import SidecarMetrics
from picker.pdsidecar.options import SidecarOptions, UsageError, options
from picker.pdsidecar.proxy import Sidecar
from picker.shared.config_files import ConfigError, one_line
from picker.shared.discovery import Discovery, make_discovery
from picker.shared.discovery.files import load_backends_file
from picker.shared.supervisor import TaskSupervisor

log = logging.getLogger("kv_epp.pd_sidecar")

STOP_TASKS_SECONDS = 5.0  # the allowlist's discovery task, cancelled at stop


def _allowlist(opts: SidecarOptions, metrics: SidecarMetrics) -> tuple[Allowlist, Discovery | None]:
    def changed() -> None:
        metrics.allowlist_targets.set(len(allowlist))
        metrics.allowlist_synced.set(1 if allowlist.synced else 0)

    if not opts.ssrf_protection:
        allowlist = Allowlist.off()
        return allowlist, None
    ref = opts.backends_file if opts.backends_file is not None else opts.inference_pool
    if ref is None:
        allowlist = Allowlist.static(opts.prefill_targets, changed)
        changed()
        return allowlist, None
    allowlist = Allowlist.follow(opts.allowlist_source(), changed)
    return allowlist, make_discovery(ref)


def _metrics_app(metrics: SidecarMetrics) -> web.Application:
    async def exposition(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/metrics", exposition)
    return app


def _bound_port(runner: web.AppRunner) -> int:
    """The port a runner's one site listens on (the one asked for, or the one the OS chose for 0)."""
    return int(runner.addresses[0][1])


class StartError(Exception):
    """The sidecar cannot start (a port cannot be bound, the backends file cannot be read): one ``error:`` line."""


@dataclass(frozen=True, slots=True)
class Running:
    """A started sidecar: what it listens on and its parts (tests read them)."""

    sidecar: Sidecar
    allowlist: Allowlist
    metrics: SidecarMetrics
    port: int
    metrics_port: int | None

    def ready_line(self) -> str:
        opts = self.sidecar.opts
        metrics_at = f"{opts.host}:{self.metrics_port}" if self.metrics_port is not None else "off"
        return (
            f"kv-epp pd-sidecar ready port={opts.host}:{self.port} engine={self.sidecar.engine} "
            f"connector={opts.kv_connector} allowlist={self.allowlist.source} metrics={metrics_at}"
        )


@contextlib.asynccontextmanager
async def started(opts: SidecarOptions) -> AsyncIterator[Running]:
    """The sidecar listening and its allowlist's source running; on exit it stops listening, gives in-flight
    requests ``--drain-seconds``, then cancels what is left and stops the source. StartError when it cannot
    start."""
    if opts.backends_file is not None:
        try:
            await asyncio.to_thread(load_backends_file, opts.backends_file.path)
        except ConfigError as exc:
            raise StartError("--backends-file " + "; ".join(f"{p}: {m}" for p, m in exc.problems)) from None
    metrics = SidecarMetrics(opts.kv_connector)
    allowlist, discovery = _allowlist(opts, metrics)
    sidecar = Sidecar(opts, make_connector(opts.kv_connector, opts.sglang_bootstrap_port), allowlist, metrics)
    supervisor = TaskSupervisor(logger=log)
    runners: list[web.AppRunner] = []
    await sidecar.open()
    try:
        # handler_cancellation: a client that goes away cancels its handler, and with it the upstream request;
        # auto_decompress off: a compressed request body is relayed as the client sent it
        runner = web.AppRunner(
            sidecar.app(), handler_cancellation=True, auto_decompress=False, access_log=None,
            shutdown_timeout=opts.drain_seconds,
        )  # fmt: skip
        runners.append(runner)
        await runner.setup()
        metrics_port = None
        try:
            await web.TCPSite(runner, opts.host, opts.port).start()
            if opts.metrics_port is not None:
                metrics_runner = web.AppRunner(_metrics_app(metrics), access_log=None, shutdown_timeout=1.0)
                runners.append(metrics_runner)
                await metrics_runner.setup()
                await web.TCPSite(metrics_runner, opts.host, opts.metrics_port).start()
                metrics_port = _bound_port(metrics_runner)
        except OSError as exc:
            raise StartError(f"cannot listen: {exc}") from None
        if discovery is not None:
            supervisor.spawn("allowlist", lambda: discovery.run(allowlist.publish))
        if not allowlist.protecting:
            log.warning("event=ssrf_protection_off (prefill legs go to any host a request names: unsafe)")
        yield Running(sidecar, allowlist, metrics, _bound_port(runner), metrics_port)
        log.info("event=draining seconds=%g", opts.drain_seconds)
    finally:
        for r in runners:  # stops listening, waits for in-flight handlers up to --drain-seconds, then cancels them
            await r.cleanup()
        await supervisor.stop(STOP_TASKS_SECONDS)
        await sidecar.close()
        log.info("event=stopped")


async def serve(opts: SidecarOptions) -> int:
    """Run until SIGTERM or SIGINT; 0 after the drain, 2 when the sidecar cannot start."""
    try:
        async with started(opts) as running:
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)
            print(running.ready_line(), flush=True)  # stdout: the line a supervisor or a test waits for
            await stop.wait()
    except StartError as exc:
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return 2
    return 0


def main(args: argparse.Namespace) -> int:
    """``kv-epp pd-sidecar``: exit 0 after a drain, 2 with one ``error:`` line on a bad flag or a busy port."""
    try:
        opts = options(args)
    except UsageError as exc:
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(serve(opts))
    except KeyboardInterrupt:  # Ctrl-C before the signal handlers were installed
        return 130
