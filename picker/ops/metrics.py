"""Prometheus metrics, the seed's names. One registry per picker process (tests make their own).

Label values come only from fixed sets or the pool's backend names (configured or discovered; a backend that
leaves the pool loses its series, ``forget_backends``), so cardinality is bounded.
"""

from __future__ import annotations

import asyncio
import logging
import time
from bisect import bisect_left
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

SCORE_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
# 50 us (a bodyless pick) to 5 s (a large body uploaded slowly, a slow tokenizer): 1-2.5-5 steps, 16 buckets
ROUTE_BUCKETS = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
)  # fmt: skip
# The outcomes of continuum_picker_requests_total that answer a request, and "answered": another answer of the
# picker's own (a status outside STATUS_OUTCOMES; none today). "draining" is a gRPC error before any answer.
# "cache_hit": a response-cache hit answered by the picker (Tier 2); the picker's only 200 of its own (the cache
# stores 200 responses only), so the status names it as it names the picker's refusals.
# "not_cached": a 412 to ``Prefer: if-available`` (no eligible endpoint holds the prompt; docs/llm-d-compat.md).
ROUTE_OUTCOMES = (
    "routed", "cache_hit", "bad_request", "overloaded", "no_backend", "not_cached", "error", "answered",
)  # fmt: skip
STATUS_OUTCOMES = {
    200: "cache_hit", 400: "bad_request", 412: "not_cached", 429: "overloaded", 503: "no_backend", 500: "error",
}  # fmt: skip
_ROUTE_BUCKET_LABELS = (*map(str, ROUTE_BUCKETS), "+Inf")


class RouteSeconds:
    """``continuum_picker_route_seconds{outcome}``: the ext_proc routing latency as the picker sees it, from the
    request-headers message received to the routing answer sent (the destination and ``envoy.lb`` metadata, or
    the picker's own answer). With a request body (BUFFERED, FULL_DUPLEX_STREAMED) it includes the body's
    arrival: the pick needs the whole body.

    Plain counts (``observe`` is a bisect and two additions, no lock, no label lookup), exported at scrape time by
    ``RouteSecondsCollector``. Bounded: ``ROUTE_OUTCOMES`` x (16 buckets + Inf)."""

    __slots__ = ("counts", "sums")

    def __init__(self) -> None:
        self.counts = {o: [0] * (len(ROUTE_BUCKETS) + 1) for o in ROUTE_OUTCOMES}  # the last slot is +Inf
        self.sums = dict.fromkeys(ROUTE_OUTCOMES, 0.0)

    def observe(self, outcome: str, seconds: float) -> None:
        """One answer sent; ``outcome`` one of ``ROUTE_OUTCOMES``."""
        self.counts[outcome][bisect_left(ROUTE_BUCKETS, seconds)] += 1
        self.sums[outcome] += seconds

    def count(self, outcome: str) -> int:
        return sum(self.counts[outcome])


class RouteSecondsCollector(Collector):
    """``RouteSeconds`` as a histogram family: ``routed`` always, the other outcomes once they have a sample."""

    def __init__(self, hist: RouteSeconds) -> None:
        self.hist = hist

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(
            "continuum_picker_route_seconds",
            "ext_proc routing latency as the picker sees it: from the request headers message received to the "
            "routing answer sent (the destination, or the picker's own answer), by outcome (routed, cache_hit, "
            "bad_request, overloaded, no_backend, error); includes the request body's arrival when the pick needs "
            "the body",
            labels=["outcome"],
        )
        h = self.hist
        for outcome in ROUTE_OUTCOMES:
            counts = h.counts[outcome]
            if outcome != "routed" and not any(counts):
                continue
            buckets: list[tuple[str, float]] = []
            total = 0
            for bound, n in zip(_ROUTE_BUCKET_LABELS, counts, strict=True):
                total += n
                buckets.append((bound, total))
            family.add_metric([outcome], buckets, h.sums[outcome])
        yield family


log = logging.getLogger("kv_epp.loop")
LOOP_LAG_INTERVAL_S = 0.1
LOOP_LAG_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class LoopLag:
    """A background task: sleep ``LOOP_LAG_INTERVAL_S``, observe how much later than asked the loop woke."""

    def __init__(self, metrics: PickerMetrics, interval_s: float = LOOP_LAG_INTERVAL_S) -> None:
        self.metrics = metrics
        self.interval_s = interval_s

    LOG_OVER_S = 0.25  # a lag above this is logged (at most once per LOG_EVERY_S), with the process's CPU time
    LOG_EVERY_S = 10.0

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        logged = -self.LOG_EVERY_S
        while True:
            t0, cpu0 = loop.time(), time.process_time()
            await asyncio.sleep(self.interval_s)
            t1 = loop.time()
            lag = max(0.0, t1 - t0 - self.interval_s)
            self.metrics.event_loop_lag.observe(lag)
            if lag > self.LOG_OVER_S and t1 - logged >= self.LOG_EVERY_S:
                logged = t1
                # cpu close to the lag: the picker's own work held the loop; far below it: the process waited for
                # a CPU (starved by its neighbours)
                log.warning("event=event_loop_lag lag_s=%.3f cpu_s=%.3f", lag, time.process_time() - cpu0)


class PickerMetrics:
    """Every metric the picker exports, created against one registry."""

    MAX_CHILDREN = 10_000  # cached labelled children; cleared when exceeded (label values are bounded anyway)
    MAX_DISCOVERY_EVENTS = 64  # distinct discovery event names counted; more count as "other"

    def child(self, metric: Any, *values: str) -> Any:
        """``metric.labels(*values)``, cached: the request path skips prometheus_client's label lookup."""
        key = (id(metric), values)
        c = self._children.get(key)
        if c is None:
            if len(self._children) >= self.MAX_CHILDREN:
                self._children.clear()
            c = self._children[key] = metric.labels(*values)
        return c

    def forget_backends(self, names: Iterable[str], keep_feed: Iterable[str] = ()) -> None:
        """Remove every series labelled with one of ``names`` (backends a reload took out of the pool),
        and their cached children, so /metrics stops exporting them. ``keep_feed``: backends whose KV feed
        consumer still runs (kv_cache_index is restart-required); their feed series stay true and stay."""
        gone = set(names)
        if not gone:
            return
        kept = set(keep_feed)
        feed_metrics = (self.kv_event_dropped, self.kv_consumer_connected, self.kv_feed_state, self.kv_self_check)
        feed = {id(m) for m in feed_metrics}
        for metric in self._per_backend():
            drop = gone - kept if id(metric) in feed else gone
            at = metric._labelnames.index("backend")
            for values in [v for v in list(metric._metrics) if v[at] in drop]:
                metric.remove(*values)
            for key in [k for k in self._children if k[0] == id(metric) and k[1][at] in drop]:
                del self._children[key]

    def discovery_event(self, event: str) -> None:
        """Count one event of the pool's discovery source (its ``count`` callback); names are the source's
        short fixed words, capped at ``MAX_DISCOVERY_EVENTS`` distinct ones all the same."""
        event = event[:64]
        if event not in self._discovery_events:
            if len(self._discovery_events) >= self.MAX_DISCOVERY_EVENTS:
                event = "other"
            self._discovery_events.add(event)
        self.child(self.discovery_events, event).inc()

    def _per_backend(self) -> list[Any]:
        """The labelled metrics that carry a ``backend`` label."""
        return [
            m
            for m in vars(self).values()
            if isinstance(m, Counter | Gauge | Histogram) and "backend" in getattr(m, "_labelnames", ())
        ]

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self._discovery_events: set[str] = set()  # bound: MAX_DISCOVERY_EVENTS (+ "other")
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        # Tier 1
        self.prefix_routing_backend_distribution = Gauge(
            "continuum_prefix_routing_backend_distribution",
            "In-flight requests per backend",
            ["backend"],
            registry=r,
        )
        # Tier 4
        self.kv_index_routing_decisions = Counter(
            "continuum_kv_index_routing_decisions",
            "Selections where the KV overlap scorer ran, by decision (kv_aware, fallback) and tier",
            ["decision", "tier"],
            registry=r,
        )
        self.event_loop_lag = Histogram(
            "continuum_picker_event_loop_lag_seconds",
            "How late the event loop ran a timer (every LOOP_LAG_INTERVAL_S): the time anything on the loop, the "
            "request path included, waits behind work that holds it",
            buckets=LOOP_LAG_BUCKETS,
            registry=r,
        )
        self.kv_index_overlap_score = Histogram(
            "continuum_kv_index_overlap_score",
            "Best composite score of kv_aware decisions",
            buckets=SCORE_BUCKETS,
            registry=r,
        )
        self.kv_event_dropped = Counter(
            "continuum_kv_event_dropped",
            "KV feed records dropped (malformed, oversized, unknown backend)",
            ["backend"],
            registry=r,
        )
        self.kv_consumer_connected = Gauge(
            "continuum_kv_consumer_connected",
            "1 while the picker's feed consumer for a backend is connected",
            ["backend"],
            registry=r,
        )
        self.kv_feed_state = Gauge(
            "continuum_kv_feed_state",
            "1 for the current state of a backend's KV feed (connecting, live, stale: no record while the "
            "backend served traffic, disconnected)",
            ["backend", "state"],
            registry=r,
        )
        self.kv_self_check = Gauge(
            "continuum_kv_self_check",
            "1 for the result of the start-up probe comparing the picker's block keys with the listener's "
            "(pending, ok, keys_differ, no_events, probe_failed, skipped)",
            ["backend", "result"],
            registry=r,
        )
        self.kv_model_unmatched = Counter(
            "continuum_kv_model_unmatched",
            "Tier 4 lookups for a model no listener source keys with (an alias or adapter missing from "
            "kv_cache_index.model_aliases / lora_adapters): these requests can never match",
            registry=r,
        )
        self.kv_index_entries = Gauge(
            "continuum_kv_index_entries", "(block, backend) entries in the KV index", registry=r
        )
        self.kv_tokenize_failures = Counter(
            "continuum_kv_tokenize_failures",
            "Requests routed without Tier 4 because token ids were unavailable",
            ["reason"],
            registry=r,
        )
        # Tier 4 tokenization cache (picker.kv.token_cache)
        self.kv_token_cache_lookups = Counter(
            "continuum_kv_token_cache_lookups",
            "Text prompts Tier 4 keyed, by result: exact (the whole prompt's ids were cached), prefix (a cached "
            "message or chunk prefix, no tokenizer call), miss (the tokenizer was called on the request path), "
            "prefix_after_failure (that call failed, a cached prefix was used)",
            ["result"],
            registry=r,
        )
        self.kv_token_cache_fills = Counter(
            "continuum_kv_token_cache_fills",
            "Background tokenizations filling the cache, by outcome (stored, dropped: the queue was full, failed, "
            "refused: the model's cached prefixes failed a check)",
            ["outcome"],
            registry=r,
        )
        self.kv_token_cache_checks = Counter(
            "continuum_kv_token_cache_checks",
            "Cached prefixes checked against a later, longer tokenization (confirmed, mismatch)",
            ["result"],
            registry=r,
        )
        self.kv_tokenize_calls = Counter(
            "continuum_kv_tokenize_calls",
            "Tokenizer calls by path (request: the request waited for it, background: a cache fill)",
            ["path"],
            registry=r,
        )
        self.kv_token_cache_bytes = Gauge(
            "continuum_kv_token_cache_bytes",
            "Bytes booked by the tokenization cache (bound: cache_max_bytes)",
            registry=r,
        )
        # ext_proc: the routing latency (observed by picker.extproc; plain counts, exported at scrape time)
        self.route_seconds = RouteSeconds()
        r.register(RouteSecondsCollector(self.route_seconds))
        # Request path: continuum_picker_requests/decisions/backend_responses/decision_seconds and
        # continuum_prefix_routing_requests are exported by picker.ops.recorder (plain counters, read at scrape)
        self.backend_healthy = Gauge(
            "continuum_picker_backend_healthy", "1 when the backend is eligible", ["backend"], registry=r
        )
        self.ttft_model = Gauge(
            "continuum_picker_ttft_model",
            "The cost model's fitted TTFT coefficients (base_ms, prefill_ms_per_token, queue_ms_per_request, "
            "decode_ms_per_seq), the mean uncached tokens of a request, the first bytes fitted (samples), the "
            "per-token prior the fit is pulled toward (prior_prefill_ms_per_token: the engines' measured prefill "
            "cost once engine_prefill_requests back it, else the configured one)",
            ["coefficient"],
            registry=r,
        )
        self.backend_ejections = Counter(
            "continuum_picker_backend_ejections",
            "Backends taken out of rotation by passive health, by reason (error_rate, consecutive_failures)",
            ["backend", "reason"],
            registry=r,
        )
        self.backend_readmissions = Counter(
            "continuum_picker_backend_readmissions",
            "Ejected backends put back in rotation (on probation) after their cooldown",
            ["backend"],
            registry=r,
        )
        self.config_reloads = Counter(
            "continuum_picker_config_reloads", "Config reloads by result", ["result"], registry=r
        )
        # who may hold a stream (issue 21): refused before the stream reaches admission or the pool
        self.extproc_refused_streams = Counter(
            "continuum_picker_extproc_refused_streams",
            "ext_proc streams refused before any work, by reason (unauthenticated: no or a wrong bearer token; "
            "peer_limit: over extproc.max_streams_per_peer open from one peer address)",
            ["reason"],
            registry=r,
        )
        # Tier 2 (issue 11): hit (answered by the picker), miss (eligible, routed), skip (not eligible, routed)
        self.response_cache_requests = Counter(
            "continuum_response_cache_requests",
            "Response-cache lookups by result: hit, miss (eligible, routed) and skip (not eligible: X-Cache BYPASS)",
            ["result"],
            registry=r,
        )
        # the pool and readiness (issue 10)
        self.discovery_events = Counter(
            "continuum_picker_discovery_events",
            "Events of the pool's discovery source (list, watch_event, bookmark, gone, error, resync, ...)",
            ["event"],
            registry=r,
        )
        self.pool_backends = Gauge("continuum_picker_pool_backends", "Backends in the pool", registry=r)
        self.pool_synced = Gauge(
            "continuum_picker_pool_synced",
            "1 once the pool is known: at once for a static pool, after the discovery's first complete list",
            registry=r,
        )
        self.ready = Gauge(
            "continuum_picker_ready",
            "1 while the picker is ready (started, not draining, no task crashed, pool synced, Tier 4 feeds caught "
            "up or stale): what /readyz and the gRPC readiness services say",
            registry=r,
        )
        self.background_task_failures = Counter(
            "continuum_picker_background_task_failures",
            "Background tasks that crashed, by task name (fixed set); the picker is not ready after one",
            ["task"],
            registry=r,
        )
        # Engine signals (picker.pool.engine_signals): each backend's own /metrics, scraped off the request path
        self.health_probes = Counter(
            "continuum_picker_health_probes",
            "Active health probes of a backend by outcome (ok: any answer below 500; timeout; error: refused or "
            "reset; status_5xx)",
            ["backend", "outcome"],
            registry=r,
        )
        self.health_suspicions = Counter(
            "continuum_picker_health_suspicions",
            "Hints that a backend may hang, each triggering a probe (client_abort: a client gave up before the "
            "first byte; scrape_unanswered: an engine-metrics scrape got no answer)",
            ["backend", "reason"],
            registry=r,
        )
        self.engine_scrapes = Counter(
            "continuum_engine_scrapes",
            "Scrapes of a backend's engine metrics by outcome (ok, timeout, error, too_large, unparsed)",
            ["backend", "outcome"],
            registry=r,
        )
        self.engine_scrape_skipped_lines = Counter(
            "continuum_engine_scrape_skipped_lines",
            "Lines of the wanted engine metric families that did not parse (skipped)",
            ["backend"],
            registry=r,
        )
        self.engine_requests_waiting = Gauge(
            "continuum_engine_requests_waiting",
            "Requests waiting in the backend's engine at its last good scrape (absent once stale)",
            ["backend"],
            registry=r,
        )
        self.engine_requests_running = Gauge(
            "continuum_engine_requests_running",
            "Requests running in the backend's engine at its last good scrape (absent once stale)",
            ["backend"],
            registry=r,
        )
        self.engine_kv_cache_usage = Gauge(
            "continuum_engine_kv_cache_usage",
            "Fraction (0..1) of the backend's KV cache in use at its last good scrape (absent once stale)",
            ["backend"],
            registry=r,
        )
        self.engine_scrape_age_seconds = Gauge(
            "continuum_engine_scrape_age_seconds",
            "Age of the backend's last good engine scrape, as of the scraper's last round",
            ["backend"],
            registry=r,
        )


class PlainHistogram:
    """A histogram as plain counts: ``observe`` is a bisect and two additions (the recorder's, the experiments'
    and llm-d's families, ``picker.ops.llmd``)."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last slot is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def add(self, other: PlainHistogram) -> None:
        """Fold ``other`` (same bounds) into this one: an alias family aggregated over dropped labels."""
        for i, n in enumerate(other.counts):
            self.counts[i] += n
        self.sum += other.sum

    def cumulative(self) -> list[tuple[str, float]]:
        """(le, cumulative count) per bucket, ``+Inf`` last; integer bounds labelled as floats (``64.0``)."""
        out: list[tuple[str, float]] = []
        total = 0
        for bound, n in zip((*(str(float(b)) for b in self.bounds), "+Inf"), self.counts, strict=True):
            total += n
            out.append((bound, total))
        return out
