"""Tier 4's inputs, assembled: the KV index, its feed consumers, the tokenizer source and the tokenization cache;
``Tier4.lookup`` is the prepare stage's Tier 4 step (the path's ``HoldsSource``), and the feeds follow the pool.
See docs/picker.md, "Tier 4's inputs".
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import time
from collections.abc import Callable, Collection, Iterable, Sequence

import aiohttp

from picker.config import KvCacheIndexConfig, RedisConfig
from picker.facts import RequestFacts
from picker.kv.checks import FeedChecks, FeedWatch, probe_keys, run_self_check
from picker.kv.feed_consumers import KvFeedConsumers
from picker.kv.index import InMemoryKvIndex
from picker.kv.redis_index import RedisKvIndex
from picker.kv.redis_layout import index_key_prefix
from picker.kv.stage import KvLookup
from picker.kv.token_cache import CachedTokenizer
from picker.kv.tokenizer_sources import TokenizerSource, make_tokenizer_source
from picker.ops.metrics import PickerMetrics
from picker.pool.pool import Pool
from picker.redis_pool import shared_redis
from picker.routing.endpoints import BackendHold
from picker.routing.served_models import resolve_model
from picker.shared.block_keys import chain_block_keys, root_key

log = logging.getLogger("kv_epp.tier4")

MAX_UNMATCHED_MODELS = 32
# more backends than this leaving (or readdressed) at once: the recent-placement guesses are cleared in one pass
# (they are short-lived guesses) instead of one pass over them per backend
BULK_FORGET = 8


class Tier4:
    """Everything Tier 4 needs, built from ``kv_cache_index`` (a restart-required section)."""

    def __init__(
        self, cfg: KvCacheIndexConfig, pool: Pool, metrics: PickerMetrics, redis: RedisConfig | None = None
    ) -> None:
        self.cfg = cfg
        self.pool = pool
        self.metrics = metrics
        # backend redis: on the caller's ``response_cache.redis`` (the pool the response cache shares); a caller
        # that passes none gets the in-memory index (what the config warning says until the app passes it)
        self.index: InMemoryKvIndex = (
            make_redis_index(cfg, redis)
            if cfg.backend == "redis" and redis is not None
            else InMemoryKvIndex(cfg.max_entries, float(cfg.entry_ttl_seconds))
        )
        self.consumers = KvFeedConsumers(
            cfg.event_sources, self.index, metrics, key_block_size=cfg.tokenizer.block_size
        )
        self.static_feeds = frozenset(s.backend_name for s in cfg.event_sources)  # never follow the pool
        self.on_change: Callable[[], None] | None = None  # a feed's readiness may have changed (the app's hook)
        self.consumers.on_change = self._feed_changed
        # the models the listener's sources key with (their hellos), refreshed by the check loop; a request
        # whose model resolves to none of them can never match
        self.known_models: frozenset[str] = frozenset()
        self.unmatched_models: dict[str, int] = {}  # bound: MAX_UNMATCHED_MODELS names, for /readyz detail
        self._rotation = itertools.count()
        self.tokenizer: TokenizerSource = make_tokenizer_source(cfg.tokenizer, self._tokenizer_url)
        tok = cfg.tokenizer
        self.max_blocks = max(1, tok.max_prefix_tokens // tok.block_size)
        counters = {
            "lookups": metrics.kv_token_cache_lookups,
            "fills": metrics.kv_token_cache_fills,
            "checks": metrics.kv_token_cache_checks,
            "round_trips": metrics.kv_tokenize_calls,
        }
        self.tokens = CachedTokenizer(
            max_bytes=tok.cache_max_bytes,
            block_size=tok.block_size,
            max_tokens=self.max_blocks * tok.block_size,
            min_fraction=tok.cache_min_fraction,
            trust_after=tok.cache_trust_after,
            queue_size=tok.fill_queue_size,
            queue_max_bytes=tok.fill_queue_max_bytes,
            fill_timeout_s=tok.timeout_cap_ms / 1000,
            on_count=lambda what, label: metrics.child(counters[what], label).inc(),
        )
        metrics.kv_token_cache_bytes.set_function(lambda: self.tokens.cache.bytes)
        self.watch = FeedWatch()  # a response observer of the request path: responses served per backend
        self.checks = FeedChecks(
            cfg.checks,
            [s.backend_name for s in cfg.event_sources],
            self.watch,
            metrics.kv_feed_state,
            metrics.kv_self_check,
        )
        self.checks.on_change = self._feed_changed
        self.check_interval_s = 1.0
        self._probed: set[str] = set()  # backends whose self-check ran or runs (bound: the feeds)
        self._probes: dict[str, asyncio.Task[str]] = {}  # running self-checks by backend

    # -- the feeds follow the pool ---------------------------------------------------------------------
    def _feed_changed(self, _backend: str) -> None:
        if self.on_change is not None:
            self.on_change()

    def follow_pool(self, added: Collection[str], gone: Collection[str], readdressed: Collection[str]) -> None:
        """Apply a change of the backends to follow (every backend of the snapshot, ready or not; not the routing
        pool's) to the feeds and the index in one synchronous step (docs/picker.md, "Tier 4's inputs"). Static
        ``event_sources`` keep their consumers; their backends' entries are still dropped when the name moved to
        another address (another engine: the feed resubscribes for a snapshot)."""
        template = self.cfg.event_source_template
        watcher = self.index.watcher
        bulk = watcher is not None and len(gone) + len(readdressed) > BULK_FORGET
        if bulk:
            self.index.watcher = None  # one pass below, not one per backend
        try:
            for name in gone:
                if name in self.static_feeds:
                    continue
                self.consumers.retire(name)
                self._forget_checks(name)
                self.index.forget_backend(name)
            for name in readdressed:
                if name not in self.consumers.consumers:
                    self.index.forget_backend(name)  # no feed: nothing will refill it
                    continue
                self.index.void_backend(name)
                self.consumers.consumers[name].interrupt()
                self._forget_checks(name)
                self.checks.add(name)
            if template is not None:
                for name in added:
                    if name not in self.consumers.consumers:
                        self.consumers.add(template.for_backend(name))
                        self.checks.add(name)
        finally:
            self.index.watcher = watcher
        if bulk and watcher is not None:
            watcher.dropped(frozenset(gone) | frozenset(readdressed))
        self.metrics.kv_index_entries.set(self.index.entry_count)

    def _forget_checks(self, name: str) -> None:
        self.checks.remove(name)
        self._probed.discard(name)
        probe = self._probes.pop(name, None)
        if probe is not None:
            probe.cancel()

    def feed_readiness(self, live: Iterable[str], now: float | None = None) -> tuple[dict[str, str], float | None]:
        """Per live backend (the routing pool's: an unready backend's feed never holds readiness back) with a
        feed: ``caught_up`` (connected, its initial snapshot or resume applied), ``stale`` (readiness no longer
        waits for it: the checks' stale mark, no catch-up within ``checks.ready_grace_seconds`` of its arrival, or
        a feed lost after it had caught up) or ``connecting`` (readiness waits). Also the earliest time
        (monotonic) a ``connecting`` one turns ``stale`` by the grace, or None."""
        t = time.monotonic() if now is None else now
        grace = self.cfg.checks.ready_grace_seconds
        consumers, state = self.consumers.consumers, self.checks.state
        out: dict[str, str] = {}
        due: float | None = None
        for name in live:
            c = consumers.get(name)
            if c is None:
                continue
            st = c.stats
            if st.caught_up:
                out[name] = "caught_up"
            elif st.ever_caught_up or state.get(name) == "stale" or t - c.added_at >= grace:
                out[name] = "stale"
            else:
                out[name] = "connecting"
                at = c.added_at + grace
                due = at if due is None or at < due else due
        return out, due

    def page_tokens(self, backend: str) -> int | None:
        """The page size of ``backend``'s engine, from its feed's puts (None: no put seen yet)."""
        consumer = self.consumers.consumers.get(backend)
        return consumer.stats.page_tokens if consumer is not None else None

    def resolve_model(self, model: str, lora_name: str | None, base_hint: str | None = None) -> tuple[str, str | None]:
        """A request's model → (the model the listener keys with, LoRA adapter): an adapter named as the
        model resolves to its base (the engines' ``/v1/models`` where they list it, else ``lora_adapters``, else
        ``base_hint``: the base model a gateway named in X-Gateway-Base-Model-Name), then an alias to its model
        (``model_aliases``). The hint never overrides what the engines or the map say, and it only shapes this
        request's own keys (a wrong one finds nothing cached)."""
        if lora_name is None:
            model, lora_name = resolve_model(model, self.pool.served, self.cfg.lora_adapters, base_hint)
        return self.cfg.model_aliases.get(model, model), lora_name

    def _tokenizer_url(self, model: str) -> str | None:
        """The configured tokenizer endpoint, else a healthy backend (rotating)."""
        if self.cfg.tokenizer.endpoint:
            return self.cfg.tokenizer.endpoint
        states = self.pool.view().states
        if not states:
            return None
        return "http://" + states[next(self._rotation) % len(states)].endpoint.address

    def timeout_s(self, body_bytes: int) -> float:
        """How long a request may wait for the tokenizer: ``timeout_ms + timeout_ms_per_kib × body KiB``,
        capped at ``timeout_cap_ms`` (a 220 KB prompt takes ~50 ms to tokenize on the simulator)."""
        tok = self.cfg.tokenizer
        return min(tok.timeout_cap_ms, tok.timeout_ms + tok.timeout_ms_per_kib * body_bytes / 1024) / 1000

    async def lookup(self, facts: RequestFacts) -> KvLookup:
        """Backend → the part of the request's prefix it holds, with the prompt's token count and block keys; a
        lookup that holds nothing when token ids are unavailable."""
        if facts.model is None:
            return KvLookup()
        ids: Sequence[int] | None = facts.prompt_token_ids  # token ids given: no tokenizer round trip
        if ids is None and facts.messages is None and facts.prompt is None:
            return KvLookup()
        try:
            model, lora = self.resolve_model(facts.model, facts.lora_name, facts.base_model)
            if self.known_models and model not in self.known_models:
                self._unmatched(model)
            root = root_key(model, lora, facts.cache_salt)
            if ids is not None:
                keys: Sequence[int] = chain_block_keys(ids, self.cfg.tokenizer.block_size, root, self.max_blocks)
                n, exact = len(ids), True
            else:
                got = await self.tokens.resolve(
                    self.tokenizer.token_ids,
                    facts.model,
                    facts.messages,
                    facts.prompt,
                    root,
                    self.timeout_s(facts.body_bytes),
                )
                if got is None:
                    self._failed("unavailable")
                    return KvLookup()
                keys, n, exact = got.keys, got.prompt_tokens, got.exact
            holds = dict(self._routed(await self.index.holds(keys))) if keys else {}  # its own: placements add to it
            evicting = self.index.evicting(self.cfg.scoring.cost.eviction_window_seconds)
            return KvLookup(holds, n, exact, keys, evicting)
        except TimeoutError:
            self._failed("timeout")
        except Exception as exc:  # never fail the request because of Tier 4
            log.warning("event=block_keys_failed error=%r", exc)
            self._failed("error")
        return KvLookup()

    def _routed(self, holds: dict[str, BackendHold]) -> dict[str, BackendHold]:
        """Without the holds of backends on standby (discovered, not Ready): their entries are kept for when they
        are back, never offered to a decision (nor counted as what the index says is available). Other names
        pass (a decision only ever picks pool members)."""
        standby = self.pool.standby_names
        if not standby:
            return holds
        return {name: h for name, h in holds.items() if name not in standby}

    def _unmatched(self, model: str) -> None:
        self.metrics.kv_model_unmatched.inc()
        n = self.unmatched_models.get(model)
        if n is None:
            if len(self.unmatched_models) >= MAX_UNMATCHED_MODELS:
                return
            log.warning(
                "event=kv_model_unmatched model=%r listener_models=%r hint='add it to kv_cache_index.model_aliases "
                "or lora_adapters, or fix the listener source model'",
                model[:128],
                sorted(self.known_models)[:8],
            )
        self.unmatched_models[model] = (n or 0) + 1

    def unmatched_report(self) -> dict[str, int]:
        """``/readyz`` detail: request models that resolve to no listener source's model (count each)."""
        return {m[:128]: n for m, n in list(self.unmatched_models.items())[:8]}

    def _failed(self, reason: str) -> None:
        self.metrics.child(self.metrics.kv_tokenize_failures, reason).inc()

    # -- lifecycle --------------------------------------------------------------------------------
    async def run(self) -> None:
        """Background (supervised): the feed consumers, the index sweep and the truth checks."""
        async with asyncio.TaskGroup() as group:
            group.create_task(self.consumers.run(), name="kv-feeds")
            group.create_task(self._check_loop(), name="kv-checks")
            group.create_task(self.run_fills(), name="kv-token-fills")
            if isinstance(self.index, RedisKvIndex):
                group.create_task(self.index.run(), name="kv-redis-writer")

    async def run_fills(self) -> None:
        """Background: the tokenization cache's fill workers (``fill_workers``), until cancelled."""
        await self.tokens.run_fills(lambda: self.tokenizer, self.cfg.tokenizer.fill_workers)

    async def _check_loop(self) -> None:
        """Every second: judge each feed (stale while traffic flows?); once a feed is connected, probe
        its backend once (the self-check). Errors are logged, never raised: checks only report."""
        probed, probes = self._probed, self._probes
        timeout = aiohttp.ClientTimeout(total=self.cfg.checks.self_check_timeout_seconds)
        async with contextlib.AsyncExitStack() as stack:
            session = await stack.enter_async_context(aiohttp.ClientSession(timeout=timeout))
            stack.callback(lambda: [t.cancel() for t in probes.values()])  # no probe outlives the loop or session
            while True:
                self.known_models = frozenset(
                    c.stats.source_model for c in self.consumers.consumers.values() if c.stats.source_model
                )
                for name, consumer in self.consumers.consumers.items():
                    st = consumer.stats
                    self.checks.judge(name, st.connected, st.events_received)
                    if st.last_close_reason == "key_block_size_mismatch" and name not in probed:
                        probed.add(name)
                        self.checks.set_self_check(
                            name,
                            "keys_differ",
                            f"the listener keys blocks of {st.key_block_size} tokens, the picker of "
                            f"{self.cfg.tokenizer.block_size} (kv_cache_index.tokenizer.block_size): feed refused",
                        )
                    routed = self.pool.endpoint(name) is not None  # an unready backend is probed once it is back
                    if self.cfg.checks.self_check and st.connected and name not in probed and routed:
                        probed.add(name)
                        task = asyncio.create_task(self._self_check(name, session), name=f"kv-self-check-{name}")
                        probes[name] = task
                        task.add_done_callback(functools.partial(self._probe_done, name))
                await asyncio.sleep(self.check_interval_s)

    def _probe_done(self, name: str, task: asyncio.Task[str]) -> None:
        if self._probes.get(name) is task:
            del self._probes[name]

    async def _self_check(self, backend: str, session: aiohttp.ClientSession) -> str:
        consumer = self.consumers.consumers.get(backend)
        endpoint = self.pool.endpoint(backend)
        if endpoint is None or consumer is None:
            self.checks.set_self_check(backend, "skipped", "the backend is not in the pool")
            return "skipped"
        model = self.cfg.checks.self_check_model or getattr(consumer.stats, "source_model", None)

        async def tokenize(m: str, messages: list[dict[str, str]]) -> Sequence[int] | None:
            return await self.tokenizer.token_ids(m, messages=messages, prompt=None)

        try:
            return await run_self_check(
                self.checks,
                backend,
                endpoint.address,
                model,
                tokenize,
                probe_keys(self.cfg.tokenizer.block_size, self.max_blocks),
                self.index.lookup,
                lambda: consumer.stats.events_received,
                session,
                lambda: consumer.stats.page_tokens,
                self.cfg.tokenizer.block_size,
            )
        except Exception as exc:  # a check never takes Tier 4 down
            log.warning("event=kv_self_check_error backend=%s error=%r", backend, exc)
            self.checks.set_self_check(backend, "probe_failed", f"internal error: {type(exc).__name__}")
            return "probe_failed"

    async def close(self) -> None:
        await self.tokenizer.close()
        if isinstance(self.index, RedisKvIndex):
            await self.index.aclose()  # what is queued, bounded by the command timeout (the pool is the app's)


def make_redis_index(cfg: KvCacheIndexConfig, redis: RedisConfig) -> RedisKvIndex:
    """``backend: redis``: the index on ``response_cache.redis``'s server (key prefix ``cr:kvidx:``; on a cluster
    ``cr:kvidx:{kvidx}:``, one slot), on the process's one pool (``picker.redis_pool``, shared with the response
    cache and closed by the app)."""
    return RedisKvIndex(
        shared_redis(redis),
        cfg.max_entries,
        float(cfg.entry_ttl_seconds),
        key_prefix=index_key_prefix(redis.mode),  # one hash-tagged slot on a cluster
        command_timeout_s=redis.command_timeout_ms / 1000,
        retry_interval_s=redis.health_check_interval_seconds,
    )
