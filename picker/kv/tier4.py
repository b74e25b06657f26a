"""Tier 4 assembled: the KV index, its feed consumers, the tokenizer source and the overlap scorer.

``Tier4.block_keys_for`` runs on the request path before the (synchronous) decision: it awaits the
request's token ids with a bounded timeout (``kv_cache_index.tokenizer.timeout_ms``) and turns them
into block keys with ``picker.shared.block_keys`` (the listener's function). Any failure gives None: the
request is routed by the strategy, never failed. The feed consumers and the TTL sweep run as
background tasks; the admin routes serve the seed's /admin/kv-index/* JSON.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Sequence

from aiohttp import web

from picker.config import KvCacheIndexConfig
from picker.kv.admin import KvDecisionCounters, kv_index_backends, kv_index_clear, kv_index_stats
from picker.kv.feed_consumer import KvFeedConsumers
from picker.kv.index import InMemoryKvIndex
from picker.kv.tokenizer_sources import TokenizerSource, make_tokenizer_source
from picker.ops.metrics import PickerMetrics
from picker.pool.pool import Pool
from picker.request.facts import RequestFacts
from picker.routing.endpoints import Endpoint, PoolView, StorageTier
from picker.routing.kv_scorer import KvOverlapScorer
from picker.shared.block_keys import request_block_keys

log = logging.getLogger("kv_epp.tier4")


class Tier4:
    """Everything Tier 4 needs, built from ``kv_cache_index`` (a restart-required section)."""

    def __init__(self, cfg: KvCacheIndexConfig, pool: Pool, metrics: PickerMetrics) -> None:
        self.cfg = cfg
        self.pool = pool
        self.metrics = metrics
        self.index = InMemoryKvIndex(cfg.max_entries, float(cfg.entry_ttl_seconds))
        self.consumers = KvFeedConsumers(cfg.event_sources, self.index, metrics)
        self.scorer = KvOverlapScorer(self.index, cfg.scoring, cfg.tokenizer.block_size)
        self._rotation = itertools.count()
        self.tokenizer: TokenizerSource = make_tokenizer_source(cfg.tokenizer, self._tokenizer_url)
        self.max_blocks = max(1, cfg.tokenizer.max_prefix_tokens // cfg.tokenizer.block_size)
        self.decisions = KvDecisionCounters()  # replaced by the router's counters in wire()

    def _tokenizer_url(self, model: str) -> str | None:
        """The configured tokenizer endpoint, else a healthy backend (rotating)."""
        if self.cfg.tokenizer.endpoint:
            return self.cfg.tokenizer.endpoint
        states = self.pool.view().states
        if not states:
            return None
        return "http://" + states[next(self._rotation) % len(states)].endpoint.address

    async def block_keys_for(self, facts: RequestFacts) -> Sequence[int] | None:
        """The request's block keys, or None when token ids are unavailable in time."""
        if facts.model is None or (facts.messages is None and facts.prompt is None):
            return None
        timeout = self.cfg.tokenizer.timeout_ms / 1000
        try:
            async with asyncio.timeout(timeout):
                ids = await self.tokenizer.token_ids(facts.model, messages=facts.messages, prompt=facts.prompt)
        except TimeoutError:
            self.metrics.child(self.metrics.kv_tokenize_failures, "timeout").inc()
            return None
        if ids is None:
            self.metrics.child(self.metrics.kv_tokenize_failures, "unavailable").inc()
            return None
        keys = request_block_keys(
            ids, self.cfg.tokenizer.block_size, facts.model, facts.lora_name, facts.cache_salt, self.max_blocks
        )
        await self.scorer.prepare(keys)
        return keys

    def score_with_tier(self, block_keys: Sequence[int], view: PoolView) -> tuple[Endpoint | None, float, StorageTier]:
        return self.scorer.score_with_tier(block_keys, view)

    # -- lifecycle --------------------------------------------------------------------------------
    async def run(self) -> None:
        """Background: start the feed consumers and keep them until cancelled."""
        self.consumers.start()
        try:
            await asyncio.Event().wait()
        finally:
            await self.consumers.stop()

    async def close(self) -> None:
        await self.tokenizer.close()

    # -- admin ------------------------------------------------------------------------------------
    def admin_routes(self) -> list[web.RouteDef]:
        async def stats(_: web.Request) -> web.Response:
            body = kv_index_stats(self.cfg, self.index, self.consumers.stats(), self.decisions)
            return web.json_response(body)

        async def backends(_: web.Request) -> web.Response:
            return web.json_response(kv_index_backends(self.cfg.enabled, self.index, self.consumers.stats()))

        async def clear(_: web.Request) -> web.Response:
            return web.json_response(kv_index_clear(self.index))

        return [
            web.get("/admin/kv-index/stats", stats),
            web.get("/admin/kv-index/backends", backends),
            web.post("/admin/kv-index/clear", clear),
        ]
