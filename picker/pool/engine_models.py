"""What each engine serves: every pool endpoint's ``GET /v1/models`` (its base models and LoRA adapters, each adapter
with its ``parent``), read off the request path on a slow cadence, bounded in time, size and entries, and put in
the pool's snapshots as a ``ServedModels`` (``picker.routing.served_models``). Tier 4 resolves a request's model
with it; the cost model's LoRA affinity reads which endpoints list an adapter.
See docs/llm-d-compat.md, "LoRA".
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from picker.config import EngineModelsConfig
from picker.pool.endpoint_poller import EndpointPoller, Refused
from picker.pool.pool import Pool
from picker.routing.endpoints import Endpoint
from picker.routing.served_models import EndpointModels, ServedModels

log = logging.getLogger("kv_epp.engine_models")

THREAD_PARSE_BYTES = 256 * 1024  # a larger body is decoded in a worker thread (the event loop keeps serving)
MAX_NAME_CHARS = 1024  # a longer model id or parent is skipped
REQUEST_HEADERS = {"Accept": "application/json", "Accept-Encoding": "identity", "User-Agent": "kv-epp"}


class ModelsUnreadable(ValueError):
    """A ``/v1/models`` body that is not the OpenAI models list."""


def parse_models(body: bytes | str, max_models: int) -> EndpointModels:
    """The OpenAI models list (``{"data": [{"id", "parent", ...}]}``) → base models and adapters (id → parent).
    An entry that is not an object with a string ``id`` (and a string or null ``parent``) is skipped; at most
    ``max_models`` entries are kept (``truncated`` then). ModelsUnreadable when the body is not such a list."""
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise ModelsUnreadable(f"not JSON: {exc}"[:200]) from None
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list):
        raise ModelsUnreadable("no 'data' list")
    bases: set[str] = set()
    adapters: dict[str, str] = {}
    truncated = False
    for entry in data:
        if not isinstance(entry, dict):
            continue
        mid, parent = entry.get("id"), entry.get("parent")
        if not isinstance(mid, str) or not mid or len(mid) > MAX_NAME_CHARS:
            continue
        if parent is not None and (not isinstance(parent, str) or not parent or len(parent) > MAX_NAME_CHARS):
            continue
        if len(bases) + len(adapters) >= max_models:
            truncated = True
            break
        if parent is None or parent == mid:
            bases.add(mid)
        else:
            adapters[mid] = parent
    return EndpointModels(frozenset(bases), adapters, truncated)


@dataclass(slots=True)
class ReadResult:
    """One read: ``outcome`` ok, timeout, error (refused, reset, a status other than 200), too_large, unparsed."""

    outcome: str
    models: EndpointModels | None = None
    detail: str = ""


@dataclass(slots=True)
class _Target:
    """One endpoint's state (bound: one per endpoint of the pool)."""

    address: str
    models: EndpointModels | None = None  # the last good list, kept through failed reads
    failing: str | None = None  # the outcome of the current run of failures (logged once), None while ok


class EngineModelPoller(EndpointPoller[EngineModelsConfig]):
    """Reads every endpoint's models list each interval and publishes them to the pool (see module).

    ``run`` is the supervised background task; it reads ``pool.cfg.engine_models`` (hot-reloadable) before every
    round and while it waits. ``close`` closes the HTTP session (an ``on_stop`` hook)."""

    def __init__(
        self,
        pool: Pool,
        clock: Callable[[], float] = time.monotonic,
        config: Callable[[], EngineModelsConfig] | None = None,
    ) -> None:
        super().__init__(config or (lambda: pool.cfg.engine_models), clock)
        self.pool = pool
        self._targets: dict[str, _Target] = {}
        self._conflicts: frozenset[str] = frozenset()

    # -- one round ----------------------------------------------------------------------------------
    async def _round(self, cfg: EngineModelsConfig) -> object:
        return await self.poll_round(cfg)

    async def poll_round(self, cfg: EngineModelsConfig | None = None) -> dict[str, ReadResult]:
        """Read every endpoint of the pool once, concurrently (bounded); publish; return the results."""
        cfg = cfg or self._config()
        endpoints = self.pool.endpoints
        self._follow_pool()
        slots = asyncio.Semaphore(cfg.max_concurrency)
        results = await asyncio.gather(*(self._read(ep, cfg, slots) for ep in endpoints))
        self._follow_pool()  # a reload may have come during the round
        out: dict[str, ReadResult] = {}
        for ep, result in zip(endpoints, results, strict=True):
            target = self._targets.get(ep.name)
            if target is None or target.address != ep.address:
                continue  # left the pool (or moved) while it was read: its answer is not this endpoint's
            out[ep.name] = result
            self._record(ep.name, target, result)
        self._publish()
        return out

    async def _read(self, ep: Endpoint, cfg: EngineModelsConfig, slots: asyncio.Semaphore) -> ReadResult:
        async with slots:
            try:
                async with asyncio.timeout(cfg.timeout_ms / 1000):
                    body = await self._fetch(f"http://{ep.address}{cfg.path}", cfg.max_bytes)
            except TimeoutError:
                return ReadResult("timeout", detail=f"no complete answer within {cfg.timeout_ms} ms")
            except (aiohttp.ClientError, OSError, ValueError) as exc:
                return ReadResult("error", detail=f"{type(exc).__name__}: {exc}"[:200])
            if isinstance(body, ReadResult):
                return body
            try:
                if len(body) > THREAD_PARSE_BYTES:
                    models = await asyncio.to_thread(parse_models, body, cfg.max_models)
                else:
                    models = parse_models(body, cfg.max_models)
            except ModelsUnreadable as exc:
                return ReadResult("unparsed", detail=str(exc))
            return ReadResult("ok", models)

    async def _fetch(self, url: str, max_bytes: int) -> bytes | ReadResult:
        body = await self._get(url, REQUEST_HEADERS, max_bytes)
        return ReadResult(body.outcome, detail=body.detail) if isinstance(body, Refused) else body

    # -- state --------------------------------------------------------------------------------------
    def _follow_pool(self) -> None:
        """Targets = the pool's endpoints now: new ones added, removed or re-addressed ones dropped (with their
        lists: another engine at that address may serve something else)."""
        current = {ep.name: ep.address for ep in self.pool.endpoints}
        for name in [n for n, t in self._targets.items() if current.get(n) != t.address]:
            del self._targets[name]
        for name, address in current.items():
            if name not in self._targets:
                self._targets[name] = _Target(address)

    def _forget_all(self) -> None:
        if self._targets or self.pool.served is not None:
            self._targets.clear()
            self.pool.set_served_models(None)

    def _record(self, name: str, target: _Target, result: ReadResult) -> None:
        if result.outcome == "ok" and result.models is not None:
            m = result.models
            if m != target.models:
                log.info(
                    "event=engine_models_changed backend=%s bases=%s adapters=%d truncated=%s",
                    name, sorted(m.bases)[:8], len(m.adapters), m.truncated,
                )  # fmt: skip
            target.models = m
            if target.failing is not None:
                log.info("event=engine_models_recovered backend=%s after=%s", name, target.failing)
            target.failing = None
        elif target.failing != result.outcome:
            target.failing = result.outcome
            log.warning(
                "event=engine_models_failed backend=%s address=%s outcome=%s detail=%r keeping_last=%s",
                name, target.address, result.outcome, result.detail, target.models is not None,
            )  # fmt: skip

    def _publish(self) -> None:
        """The lists into the pool, as a new ``ServedModels`` only when one of them changed."""
        lists: Mapping[str, EndpointModels] = {n: t.models for n, t in self._targets.items() if t.models is not None}
        current = self.pool.served
        if current is not None and dict(current.by_endpoint) == lists:
            return
        served = ServedModels(lists) if lists else None
        if served is not None and served.conflicts != self._conflicts:
            self._conflicts = served.conflicts
            if served.conflicts:
                log.warning(
                    "event=engine_models_disagree models=%r rule='most endpoints win, a tie goes to the base model'",
                    sorted(served.conflicts)[:8],
                )
        self.pool.set_served_models(served)

    def status(self) -> dict[str, dict[str, Any]]:
        """Per endpoint: address, the current failure (None while ok), what it lists (counts)."""
        return {
            name: {
                "address": t.address,
                "failing": t.failing,
                "bases": None if t.models is None else sorted(t.models.bases)[:8],
                "adapters": None if t.models is None else len(t.models.adapters),
                "truncated": None if t.models is None else t.models.truncated,
            }
            for name, t in self._targets.items()
        }


__all__ = ["EngineModelPoller", "ModelsUnreadable", "ReadResult", "parse_models"]
