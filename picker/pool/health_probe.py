"""Active health: a replica that accepts connections and never answers leaves rotation within seconds (a
suspicion starts one bounded ``GET /health``; no answer ejects, answers readmit).
See docs/picker.md, "Active health".
"""

from __future__ import annotations

import asyncio
import functools
import logging

import aiohttp

from picker.config import HealthProbeConfig
from picker.ops.metrics import PickerMetrics
from picker.pool.pool import Pool

log = logging.getLogger("kv_epp.health_probe")

MAX_BODY_BYTES = 64 * 1024
# suspicions whose probe also keeps the endpoint out of routing while it runs (when another is eligible): a client
# that gave up with no byte is a strong hint; a slow metrics scrape is a weak one (a busy engine answers late)
QUARANTINE_REASONS = frozenset({"client_abort"})
MAX_CONNECTIONS = 64


class HealthProber:
    """Probes suspected endpoints; ejects the ones that do not answer and readmits them when they do."""

    def __init__(self, pool: Pool, metrics: PickerMetrics | None = None) -> None:
        self.pool = pool
        self.metrics = metrics
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._session: aiohttp.ClientSession | None = None
        self._closed = False
        pool.suspicion_listener = self.suspect

    def _config(self) -> HealthProbeConfig:
        return self.pool.cfg.health.probe

    @property
    def probing(self) -> frozenset[str]:
        return frozenset(self._tasks)

    def suspect(self, name: str, reason: str) -> None:
        """A hint that ``name`` may hang: probe it now, unless it is being probed already."""
        if self.metrics is not None:
            self.metrics.child(self.metrics.health_suspicions, name, reason).inc()
        cfg = self._config()
        endpoint = self.pool.endpoint(name)
        if self._closed or not cfg.enabled or endpoint is None or name in self._tasks:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not on the event loop (a synchronous caller): nothing can be scheduled
            return
        log.info("event=health_suspicion backend=%s address=%s reason=%s", name, endpoint.address, reason)
        quarantine = reason in QUARANTINE_REASONS
        if quarantine:  # from now: the next request already avoids it
            self.pool.probing(name, endpoint.address, True)
        task = loop.create_task(self._check(name, endpoint.address, quarantine), name=f"health-probe-{name}")
        self._tasks[name] = task
        task.add_done_callback(functools.partial(self._done, name))

    def _done(self, name: str, task: asyncio.Task[None]) -> None:
        if self._tasks.get(name) is task:
            del self._tasks[name]
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("event=health_probe_crashed backend=%s error=%r", name, exc)

    def _current(self, name: str, address: str) -> bool:
        endpoint = self.pool.endpoint(name)
        return endpoint is not None and endpoint.address == address

    async def _check(self, name: str, address: str, quarantine: bool) -> None:
        try:
            answered = await self.probe(name, address)
        finally:
            if quarantine:
                self.pool.probing(name, address, False)
        if answered or not self._current(name, address):
            return
        self.pool.probe_failed(name, address)
        streak = 0
        while self.pool.probe_ejected(name) and self._current(name, address):
            cfg = self._config()
            await asyncio.sleep(cfg.interval_ms / 1000)
            if not self._current(name, address):
                return
            streak = streak + 1 if await self.probe(name, address) else 0
            if streak >= cfg.readmit_after:
                self.pool.probe_ok(name, address)
                return

    async def probe(self, name: str, address: str) -> bool:
        """One GET of the health path: True when it answered (any status below 500) within the timeout."""
        cfg = self._config()
        try:
            async with asyncio.timeout(cfg.timeout_ms / 1000):
                async with self._get_session().get(f"http://{address}{cfg.path}", allow_redirects=False) as resp:
                    await resp.content.read(MAX_BODY_BYTES)
                    outcome = "ok" if resp.status < 500 else "status_5xx"
        except TimeoutError:
            outcome = "timeout"
        except (aiohttp.ClientError, OSError, ValueError):
            outcome = "error"
        if self.metrics is not None:
            self.metrics.child(self.metrics.health_probes, name, outcome).inc()
        if outcome != "ok":
            log.warning("event=health_probe_failed backend=%s address=%s outcome=%s", name, address, outcome)
        return outcome == "ok"

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=MAX_CONNECTIONS, force_close=True),
                headers={"User-Agent": "kv-epp"},
            )
        return self._session

    async def close(self) -> None:
        self._closed = True
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()


__all__ = ["HealthProber"]
