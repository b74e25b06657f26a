"""llm-d's endpoint-picker metric names, beside ours: the canonical ``llm_d_epp_*`` request, pool, scheduler and
in-flight families and the deprecated aliases operators still query (``inference_objective_*``, ``inference_pool_*``,
``inference_extension_*``), with llm-d's label sets and buckets (llm-d/llm-d-router ``pkg/epp/metrics``).

The request path books plain counts per label set (a dict lookup and a few additions per request, no
prometheus_client label lookup, no lock); the families, aliases included, are built at scrape time. Which names
are exported is ``metrics.compat`` (``picker.config.MetricsConfig``). Bounded: model and fairness label values
are capped at ``MAX_MODEL_LABELS`` / ``MAX_FAIRNESS_LABELS`` distinct values each (then ``other``, as llm-d
caps them), and the request series table at ``MAX_REQUEST_SERIES`` label sets.
See docs/llm-d-compat.md, "Metrics".
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from picker import __version__
from picker.config import Settings
from picker.ops.metrics import PlainHistogram

_mono = time.monotonic

OTHER = "other"  # the label value a capped label folds to (llm-d's overflow value)
MAX_MODEL_LABELS = 1000  # distinct model_name / target_model_name values (shared cap, as llm-d's), then "other"
MAX_FAIRNESS_LABELS = 1000  # distinct fairness_id values, then "other"
MAX_LABEL_CHARS = 256  # a longer client-sent label value is cut before it is counted
# (model, target model, fairness id, priority) label sets with series of their own; past it a new set is booked
# under (other, other, other, priority): the caps above alone would allow a million combinations
# A scrape renders about 15 KB of text per label set (eleven histograms and their aliases): 1,000 sets are about
# 15 MB and 2 s of one core, which is why the request families are rendered off the event loop
# (``LlmdCollector.render_requests``)
MAX_REQUEST_SERIES = 1_000
# more room for sets whose models are pinned (the model rewrites'): a flood of other models cannot fold them
PINNED_SERIES = 1_000
# llm-d's error codes (llm-d-router pkg/common/error): the picker's own answers by status, and an upstream answer
# that is not a 200
ERROR_CODES = {400: "BadRequest", 412: "PreconditionFailed", 429: "ResourceExhausted", 500: "Internal",
               503: "ServiceUnavailable"}  # fmt: skip
UNKNOWN_ERROR = "Unknown"
MODEL_SERVER_ERROR = "ModelServerError"
PRODUCER = "kv-epp-pool"  # the producer_name label of the in-flight families (llm-d: the producer plugin's name)

# llm-d's buckets (llm-d-router pkg/epp/metrics/llm_d_router_metrics.go and metrics.go)
LATENCY_BUCKETS = (
    0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2, 3, 4, 5, 6, 8, 10, 15, 20, 30, 45, 60, 120, 180,
    240, 300, 360, 480, 600, 900, 1200, 1800, 2700, 3600,
)  # fmt: skip
TTFT_BUCKETS = (0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2, 3, 4, 5, 6, 8, 10, 15, 20, 30, 45, 60,
                120)  # fmt: skip
TPOT_BUCKETS = (0.0005, 0.00205, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.125, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8,
                1, 2)  # fmt: skip
NTPOT_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
REQUEST_SIZE_BUCKETS = tuple(float(1 << i) for i in range(6, 31))  # 64 B .. 1 GiB
RESPONSE_SIZE_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32778, 65536)
INPUT_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32778, 65536, 131072, 262144,
                       524288, 1048576)  # fmt: skip
OUTPUT_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
SCHEDULER_BUCKETS = (0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1)

REQUEST_LABELS = ["model_name", "target_model_name", "fairness_id", "priority"]
MODEL_LABELS = ["model_name", "target_model_name"]
INFLIGHT_LABELS = ["endpoint_name", "namespace", "producer_name", "fairness_id", "priority"]


class BoundedLabel:
    """Caps the distinct values of one client-derived label: a value, once admitted, stays itself (paired
    increments and decrements of a gauge stay balanced); past ``cap`` a new value is ``other``. ``pin``: a value
    that is always itself and takes no slot (llm-d pins the model names of its InferenceModelRewrite rules)."""

    __slots__ = ("cap", "pinned", "seen")

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.seen: set[str] = set()  # bound: cap
        self.pinned: set[str] = set()  # bound: the configured names pinned

    def bound(self, value: str) -> str:
        if len(value) > MAX_LABEL_CHARS:
            value = value[:MAX_LABEL_CHARS]
        if value in self.seen or value in self.pinned or not value:
            return value
        if len(self.seen) >= self.cap:
            return OTHER
        self.seen.add(value)
        return value

    def pin(self, value: str) -> None:
        if value:
            self.pinned.add(value[:MAX_LABEL_CHARS])


Key = tuple[str, str, str, str]  # model_name, target_model_name, fairness_id, priority


class RequestSeries:
    """One label set's counts. The histograms are made at their first observation."""

    __slots__ = (
        "cached", "duration", "errors", "input", "ntpot", "output", "req_size", "resp_size", "running", "total",
        "tpot", "ttft",
    )  # fmt: skip

    def __init__(self) -> None:
        self.total = 0
        self.running = 0
        self.errors: dict[str, int] = {}  # bound: ERROR_CODES' values, UNKNOWN_ERROR, MODEL_SERVER_ERROR
        self.duration: PlainHistogram | None = None
        self.req_size: PlainHistogram | None = None
        self.resp_size: PlainHistogram | None = None
        self.input: PlainHistogram | None = None
        self.output: PlainHistogram | None = None
        self.cached: PlainHistogram | None = None
        self.ntpot: PlainHistogram | None = None
        self.tpot: PlainHistogram | None = None
        self.ttft: dict[str, PlainHistogram] = {}  # "true" / "false" (the streaming label)


@dataclass(slots=True)
class RequestRecord:
    """One routed request's state for llm-d's families, from the pick to the end of its response (``Exchange.llmd``).
    Times are monotonic seconds."""

    series: RequestSeries
    fairness_id: str
    priority: str
    arrived: float
    streaming: bool
    endpoint: str  # the pool endpoint holding its in-flight slot
    prefill_tokens: int = 0
    headers_at: float | None = None
    first_chunk_at: float | None = None
    ended_at: float | None = None
    response_bytes: int = 0
    body_seen: bool = False  # a response body chunk reached the picker (full mode, or a sampled response)
    done: bool = False


@dataclass(slots=True)
class PoolRow:
    """One pool endpoint as the pool families read it at scrape time."""

    name: str
    ready: bool
    waiting: int | None  # the engine's own queue (None: no fresh engine reading)
    running: int | None
    kv_usage: float | None


@dataclass(slots=True)
class _Scheduler:
    e2e: PlainHistogram = field(default_factory=lambda: PlainHistogram(SCHEDULER_BUCKETS))
    # (status, target model, endpoint name, port) -> attempts; bound: pool endpoints x capped models x 2 (a backend
    # that leaves the pool loses its series, ``LlmdMetrics.forget_backends``)
    attempts: dict[tuple[str, str, str, str], int] = field(default_factory=dict)
    plugins: dict[str, PlainHistogram] = field(default_factory=dict)  # strategy -> decide time; bound: the strategies


class LlmdMetrics:
    """llm-d's request, scheduler, in-flight (and, with ``pool_rows``, pool) families, booked as plain counts and
    exported by ``LlmdCollector`` at scrape time. One per picker process."""

    def __init__(self) -> None:
        self.on = True  # metrics.compat is not "continuum": the request path books (set by ``configure``)
        self.compat = "both"
        self.pool_name = "kv-epp"
        self.namespace = ""
        self.models = BoundedLabel(MAX_MODEL_LABELS)
        self.fairness = BoundedLabel(MAX_FAIRNESS_LABELS)
        self.series: dict[Key, RequestSeries] = {}  # bound: MAX_REQUEST_SERIES (+ the overflow sets)
        self.scheduler = _Scheduler()
        # (endpoint, fairness id, priority) -> [requests, uncached prompt tokens] in flight; an entry leaves at 0;
        # bound: endpoints x capped fairness ids x priorities
        self.inflight: dict[tuple[str, str, str], list[int]] = {}
        # P/D decisions (docs/pd.md): (decision_type, model label) -> count; bound: 2 types x capped models
        self.disaggs: dict[tuple[str, str], int] = {}
        self.pool_rows: Callable[[], Iterable[PoolRow]] | None = None
        self.commit = os.environ.get("KV_EPP_COMMIT", "unknown")[:64]
        self.build_ref = os.environ.get("KV_EPP_BUILD_REF", __version__)[:64]

    def configure(self, settings: Settings) -> None:
        """Apply ``metrics`` (hot-reloadable), at start and at each reload: the pool label is the InferencePool's
        name unless ``metrics.pool_name`` says otherwise."""
        cfg = settings.metrics
        ref = settings.pool.inference_pool
        self.compat = cfg.compat
        self.on = cfg.compat != "continuum"
        self.pool_name = cfg.pool_name or (ref.name if ref is not None else "kv-epp")
        self.namespace = (ref.namespace if ref is not None else None) or ""

    def disagg(self, decision_type: str, model: str | None) -> None:
        """One P/D decision, under the model's label (``unknown`` without one, as llm-d labels it)."""
        k = (decision_type, self.models.bound(model) if model else "unknown")
        self.disaggs[k] = self.disaggs.get(k, 0) + 1

    def pin_models(self, names: Iterable[str]) -> None:
        """The model names of the model rewrites' rules (matched models and targets), replacing the last set: they
        keep labels of their own whatever the cap (bound: the rewrites' own bounds)."""
        self.models.pinned = {n[:MAX_LABEL_CHARS] for n in names if n}

    # -- the request path -----------------------------------------------------------------------------
    def _series(
        self, model: str | None, target: str | None, fairness_id: str, priority: str
    ) -> tuple[RequestSeries, Key]:
        """The label set's series (made at its first request) and its key (the labels as exported)."""
        raw = (model or "", target or "", fairness_id, priority)
        s = self.series.get(raw)
        if s is not None:  # the common case: every value was admitted before (an admitted value is its own label)
            return s, raw
        m = self.models.bound(raw[0])
        key = (m, self.models.bound(raw[1]) if target != model else m, self.fairness.bound(fairness_id), priority)
        s = self.series.get(key)
        if s is None:
            pinned = self.models.pinned
            room = MAX_REQUEST_SERIES + (PINNED_SERIES if key[0] in pinned and key[1] in pinned else 0)
            if len(self.series) >= room:
                key = (OTHER, OTHER, OTHER, priority)
                s = self.series.get(key)
            if s is None:
                s = self.series[key] = RequestSeries()
        return s, key

    def answered(
        self,
        model: str | None,
        fairness_id: str,
        priority: str,
        status: int,
        nbytes: int,
        arrived: float | None,
        unscheduled: bool = False,
    ) -> None:
        """The picker answered the request itself: a refusal (``request_error_total`` by llm-d's code; with
        ``unscheduled`` the decide stage found no eligible endpoint, a failed scheduling attempt), or a
        response-cache hit (200: counted as a request, its size and duration booked)."""
        s, key = self._series(model, model, fairness_id, priority)
        if status == 200:
            s.total += 1
            _observe(s, "req_size", REQUEST_SIZE_BUCKETS, nbytes)
            if arrived is not None:
                _observe(s, "duration", LATENCY_BUCKETS, max(0.0, _mono() - arrived))
            return
        code = ERROR_CODES.get(status, UNKNOWN_ERROR)
        s.errors[code] = s.errors.get(code, 0) + 1
        if unscheduled:
            self._attempt("failure", key[1], "", "")

    def external(self, model: str | None, fairness_id: str, priority: str, nbytes: int) -> None:
        """A request sent to an external backend (``type: gemini``): counted and its size booked; its response is
        not followed (no pool endpoint, no in-flight slot)."""
        s, _ = self._series(model, model, fairness_id, priority)
        s.total += 1
        _observe(s, "req_size", REQUEST_SIZE_BUCKETS, nbytes)

    def routed(
        self,
        model: str | None,
        target: str | None,
        fairness_id: str,
        priority: str,
        nbytes: int,
        arrived: float | None,
        streaming: bool,
        endpoint: str,
        address: str,
        prefill_tokens: int,
    ) -> RequestRecord:
        """A request sent to ``endpoint`` (a pool endpoint at ``address``): counted, its size booked, running and
        in flight there until ``ended``."""
        s, key = self._series(model, target, fairness_id, priority)
        s.total += 1
        s.running += 1
        h = s.req_size
        if h is None:
            h = s.req_size = PlainHistogram(REQUEST_SIZE_BUCKETS)
        h.observe(nbytes)
        fid = key[2]
        rec = RequestRecord(s, fid, priority, arrived if arrived is not None else _mono(), streaming, endpoint)
        rec.prefill_tokens = prefill_tokens
        k = (endpoint, fid, priority)
        row = self.inflight.get(k)
        if row is None:
            row = self.inflight[k] = [0, 0]
        row[0] += 1
        row[1] += prefill_tokens
        self._attempt("success", key[1], endpoint, address.rpartition(":")[2])
        return rec

    def _attempt(self, status: str, target: str, endpoint: str, port: str) -> None:
        """``target``: the target model as labelled (bounded)."""
        k = (status, target, endpoint, port)
        a = self.scheduler.attempts
        a[k] = a.get(k, 0) + 1

    def forget_backends(self, names: Iterable[str]) -> None:
        """Drop the scheduling-attempt series of backends that left the pool (a discovered pool's pods come and
        go: without this the table would grow with every pod ever seen). In-flight entries leave at their end."""
        gone = set(names)
        a = self.scheduler.attempts
        for k in [k for k in a if k[2] in gone]:
            del a[k]

    def scheduled(self, strategy: str | None, seconds: float) -> None:
        """One decide stage (the scheduling: scorers and the strategy over the pool's snapshot), by the strategy
        that decided (``none``: no eligible endpoint)."""
        if not self.on:
            return
        sch = self.scheduler
        sch.e2e.observe(seconds)
        name = strategy or "none"
        h = sch.plugins.get(name)
        if h is None:
            h = sch.plugins[name] = PlainHistogram(SCHEDULER_BUCKETS)
        h.observe(seconds)

    def response_headers(self, rec: RequestRecord, status: int | None) -> None:
        rec.headers_at = _mono()
        if status is not None and status != 200:  # llm-d: any upstream status but 200 is a model-server error
            e = rec.series.errors
            e[MODEL_SERVER_ERROR] = e.get(MODEL_SERVER_ERROR, 0) + 1

    def response_chunk(self, rec: RequestRecord, n: int) -> None:
        rec.body_seen = True
        if n and rec.first_chunk_at is None:
            rec.first_chunk_at = _mono()
        rec.response_bytes += n

    def ended(self, rec: RequestRecord, completed: bool) -> None:
        """The response ended (``completed``) or the stream closed first: no longer running; a completed
        response's duration, size (when its body passed through the picker) and time to first token."""
        if rec.done:
            return
        rec.done = True
        now = rec.ended_at = _mono()
        s = rec.series
        s.running -= 1
        k = (rec.endpoint, rec.fairness_id, rec.priority)
        row = self.inflight.get(k)
        if row is not None:
            row[0] -= 1
            row[1] -= rec.prefill_tokens
            if row[0] <= 0:
                del self.inflight[k]
        if not completed:
            return
        h = s.duration
        if h is None:
            h = s.duration = PlainHistogram(LATENCY_BUCKETS)
        h.observe(max(0.0, now - rec.arrived))
        if rec.body_seen:
            _observe(s, "resp_size", RESPONSE_SIZE_BUCKETS, rec.response_bytes)
        first = rec.first_chunk_at
        if first is None and not rec.streaming:
            first = rec.headers_at  # a non-streamed answer's headers come with the whole answer
        if first is not None:
            label = "true" if rec.streaming else "false"
            h = s.ttft.get(label)
            if h is None:
                h = s.ttft[label] = PlainHistogram(TTFT_BUCKETS)
            h.observe(max(0.0, first - rec.arrived))

    def usage(self, rec: RequestRecord, prompt: int, completion: int | None, cached: int | None) -> None:
        """The response's ``usage`` (its body reached the picker): token counts, normalized time per output token
        and, streamed, time per output token after the first."""
        s = rec.series
        if prompt > 0:
            _observe(s, "input", INPUT_TOKEN_BUCKETS, prompt)
        if cached is not None:
            _observe(s, "cached", INPUT_TOKEN_BUCKETS, cached)
        if completion is None or completion <= 0:
            return
        _observe(s, "output", OUTPUT_TOKEN_BUCKETS, completion)
        end = rec.ended_at if rec.ended_at is not None else _mono()
        _observe(s, "ntpot", NTPOT_BUCKETS, max(0.0, end - rec.arrived) / completion)
        first = rec.first_chunk_at
        if rec.streaming and first is not None and completion > 1 and end > first:
            _observe(s, "tpot", TPOT_BUCKETS, (end - first) / (completion - 1))


def _observe(s: RequestSeries, slot: str, bounds: tuple[float, ...], value: float) -> None:
    h: PlainHistogram | None = getattr(s, slot)
    if h is None:
        h = PlainHistogram(bounds)
        setattr(s, slot, h)
    h.observe(value)


# -- export ---------------------------------------------------------------------------------------------------
CANONICAL = "llm_d_epp_"
DISAGG_PLUGIN = "disagg-profile-handler"  # the llm-d plugin that counts P/D decisions (its plugin_name and type)
# (canonical name, deprecated alias, RequestSeries slot, help): the request histograms
_REQUEST_HISTOGRAMS = (
    ("request_duration_seconds", "inference_objective_request_duration_seconds", "duration",
     "End-to-end request latency in seconds: from the request headers at the picker to the response's end"),
    ("request_size_bytes", "inference_objective_request_sizes", "req_size", "Request body size in bytes"),
    ("response_size_bytes", "inference_objective_response_sizes", "resp_size",
     "Response body size in bytes (every body passes through the picker: Envoy response mode full)"),
    ("request_input_tokens", "inference_objective_input_tokens", "input",
     "Prompt tokens per request, from the response's usage (its body passed through the picker)"),
    ("request_output_tokens", "inference_objective_output_tokens", "output",
     "Output tokens per request, from the response's usage (its body passed through the picker)"),
    ("request_cached_tokens", "inference_objective_prompt_cached_tokens", "cached",
     "Prompt tokens the engine read from its cache, from the response's usage (prompt_tokens_details)"),
    ("request_ntpot_seconds", "inference_objective_normalized_time_per_output_token_seconds", "ntpot",
     "Normalized time per output token in seconds: the request's duration divided by its output tokens"),
    ("request_streaming_tpot_seconds", None, "tpot",
     "Time per output token in seconds of streamed responses: (end - first chunk) / (output tokens - 1)"),
)  # fmt: skip


class LlmdCollector(Collector):
    """``LlmdMetrics`` as metric families, built at scrape time: the canonical ``llm_d_epp_*`` families and their
    deprecated aliases; nothing in ``continuum`` mode.

    The request families are most of a scrape's work (about 2 ms per label set). The picker's ``/metrics`` renders
    them in a worker thread: it collects the registry with ``deferred`` set (the pool, scheduler and in-flight
    families, which read the pool's state, on the event loop), then ``render_requests`` off it. The request
    series are only ever added to (their counts are ints the loop replaces), and the thread iterates copies of
    the dicts, so a scrape may see a request half booked, never a broken one."""

    def __init__(self, m: LlmdMetrics) -> None:
        self.m = m
        self.deferred = False  # set by the caller that renders the request families itself (render_requests)

    def collect(self) -> Iterator[Metric]:
        m = self.m
        if not m.on:
            return
        if not self.deferred:
            yield from self._requests(list(m.series.items()))
        yield from self._pool()
        yield from self._scheduler()
        yield from self._inflight()

    def request_series(self) -> list[tuple[Key, RequestSeries]] | None:
        """On the event loop: the request series to render (None: llm-d's names are off)."""
        return list(self.m.series.items()) if self.m.on else None

    def render_requests(self, series: list[tuple[Key, RequestSeries]]) -> bytes:
        """The request families of ``series`` in Prometheus' text format (safe in a worker thread)."""
        return generate_latest(_Families(self._requests(series)))

    def _requests(self, series: list[tuple[Key, RequestSeries]]) -> Iterator[Metric]:
        total = CounterMetricFamily(CANONICAL + "request", "Requests sent upstream (and response-cache hits)",
                                    labels=REQUEST_LABELS)  # fmt: skip
        old_total = CounterMetricFamily(
            "inference_objective_request",
            "[Deprecated: use llm_d_epp_request_total] Requests by model",
            labels=[*MODEL_LABELS, "priority"],
        )
        errors = CounterMetricFamily(CANONICAL + "request_error", "Request errors by llm-d's error code",
                                     labels=[*REQUEST_LABELS, "error_code"])  # fmt: skip
        old_errors = CounterMetricFamily(
            "inference_objective_request_error",
            "[Deprecated: use llm_d_epp_request_error_total] Request errors",
            labels=[*MODEL_LABELS, "error_code"],
        )
        running = GaugeMetricFamily(CANONICAL + "request_running", "Requests sent upstream whose response has not "
                                    "ended", labels=REQUEST_LABELS)  # fmt: skip
        old_running = GaugeMetricFamily(
            "inference_objective_running_requests",
            "[Deprecated: use llm_d_epp_request_running] Running requests",
            labels=["model_name"],
        )
        old_t: dict[tuple[str, ...], int] = {}
        old_e: dict[tuple[str, ...], int] = {}
        old_r: dict[str, int] = {}
        for key, s in series:
            total.add_metric(list(key), s.total)
            old_t[(key[0], key[1], key[3])] = old_t.get((key[0], key[1], key[3]), 0) + s.total
            for code, n in list(s.errors.items()):
                errors.add_metric([*key, code], n)
                old_e[(key[0], key[1], code)] = old_e.get((key[0], key[1], code), 0) + n
            running.add_metric(list(key), s.running)
            old_r[key[0]] = old_r.get(key[0], 0) + s.running
        for k, n in old_t.items():
            old_total.add_metric(list(k), n)
        for k, n in old_e.items():
            old_errors.add_metric(list(k), n)
        for model, n in old_r.items():
            old_running.add_metric([model], n)
        yield from (total, errors, running, old_total, old_errors, old_running)
        for name, alias, slot, doc in _REQUEST_HISTOGRAMS:
            fam = HistogramMetricFamily(CANONICAL + name, doc, labels=REQUEST_LABELS)
            merged: dict[tuple[str, str], PlainHistogram] = {}
            for key, s in series:
                h: PlainHistogram | None = getattr(s, slot)
                if h is None:
                    continue
                fam.add_metric(list(key), h.cumulative(), h.sum)
                mk = (key[0], key[1])
                acc = merged.get(mk)
                if acc is None:
                    acc = merged[mk] = PlainHistogram(h.bounds)
                acc.add(h)
            yield fam
            if alias is not None:
                old = HistogramMetricFamily(alias, f"[Deprecated: use {CANONICAL}{name}] {doc}", labels=MODEL_LABELS)
                for mk, acc in merged.items():
                    old.add_metric(list(mk), acc.cumulative(), acc.sum)
                yield old
        ttft = HistogramMetricFamily(
            CANONICAL + "request_ttft_seconds",
            "Time to first token in seconds: from the request headers at the picker to the first response body chunk "
            "(Envoy response mode full, or a sampled response); a non-streamed response's headers when its body does "
            "not pass through the picker (they come with the whole answer)",
            labels=[*REQUEST_LABELS, "streaming"],
        )
        for key, s in series:
            for label, h in list(s.ttft.items()):
                ttft.add_metric([*key, label], h.cumulative(), h.sum)
        yield ttft

    def _pool(self) -> Iterator[Metric]:
        m = self.m
        if m.pool_rows is None:
            return
        rows = list(m.pool_rows())
        name = m.pool_name
        read = [r for r in rows if r.waiting is not None]
        kv = [r.kv_usage for r in rows if r.kv_usage is not None]
        ready = sum(1 for r in rows if r.ready)
        gauges: list[tuple[str, str, str, float | None]] = [
            ("average_kv_cache_utilization", "inference_pool_average_kv_cache_utilization",
             "Mean KV-cache utilization (0..1) of the pool's endpoints, from their engines' own /metrics",
             sum(kv) / len(kv) if kv else None),
            ("average_queue_size", "inference_pool_average_queue_size",
             "Mean number of requests waiting in the pool's engines' queues, from their own /metrics",
             sum(r.waiting or 0 for r in read) / len(read) if read else None),
            ("average_running_requests", "inference_pool_average_running_requests",
             "Mean number of requests running in the pool's engines, from their own /metrics",
             sum(r.running or 0 for r in read) / len(read) if read else None),
            ("ready_endpoints", "inference_pool_ready_pods", "Endpoints of the pool the picker may route to",
             float(ready)),
        ]  # fmt: skip
        for canonical, alias, doc, value in gauges:
            for fname, help_ in (
                (CANONICAL + canonical, doc),
                (alias, f"[Deprecated: use {CANONICAL}{canonical}] {doc}"),
            ):
                g = GaugeMetricFamily(fname, help_, labels=["name"])
                if value is not None:
                    g.add_metric([name], value)
                yield g
        doc = "Requests waiting in each endpoint's engine queue, from its own /metrics"
        per = GaugeMetricFamily(CANONICAL + "per_endpoint_queue_size", doc, labels=["name", "model_server_endpoint"])
        old = GaugeMetricFamily("inference_pool_per_pod_queue_size", doc, labels=["name", "model_server_pod"])
        for r in read:
            per.add_metric([name, r.name], float(r.waiting or 0))
            old.add_metric([name, r.name], float(r.waiting or 0))
        yield per
        yield old

    def _scheduler(self) -> Iterator[Metric]:
        m = self.m
        sch = m.scheduler
        e2e_doc = "The decide stage's time in seconds: Tier 4's scorer, session affinity and the strategy"
        for fname in (
            CANONICAL + "scheduler_e2e_duration_seconds",
            "inference_extension_scheduler_e2e_duration_seconds",
        ):
            yield HistogramMetricFamily(fname, e2e_doc, buckets=sch.e2e.cumulative(), sum_value=sch.e2e.sum)
        attempts = CounterMetricFamily(
            CANONICAL + "scheduler_attempts",
            "Scheduling attempts by status (success: an endpoint picked)",
            labels=["status", "target_model_name", "endpoint_name", "namespace", "port"],
        )
        old = CounterMetricFamily(
            "inference_extension_scheduler_attempts",
            "[Deprecated: use llm_d_epp_scheduler_attempts_total]",
            labels=["status", "target_model_name", "pod_name", "namespace", "port"],
        )
        for (status, target, endpoint, port), n in list(sch.attempts.items()):
            values = [status, target, endpoint, m.namespace if endpoint else "", port]
            attempts.add_metric(values, n)
            old.add_metric(values, n)
        yield attempts
        yield old
        doc = ("The request path's stages as llm-d's plugins: extension_point decide, plugin_type and plugin_name the "
               "strategy (or scorer) that decided")  # fmt: skip
        for fname in (CANONICAL + "plugin_duration_seconds", "inference_extension_plugin_duration_seconds"):
            fam = HistogramMetricFamily(fname, doc, labels=["extension_point", "plugin_type", "plugin_name"])
            for strategy, h in list(sch.plugins.items()):
                fam.add_metric(["decide", strategy, strategy], h.cumulative(), h.sum)
            yield fam
        disagg = CounterMetricFamily(
            CANONICAL + "disagg_decision",
            "P/D disaggregation decisions by decision_type (decode-only, prefill-decode)",
            labels=["plugin_name", "plugin_type", "model_name", "decision_type"],
        )
        old_disagg = CounterMetricFamily(
            "llm_d_inference_scheduler_disagg_decision",
            "[Deprecated: use llm_d_epp_disagg_decision_total] P/D disaggregation decisions",
            labels=["model_name", "decision_type"],
        )
        for (dtype, model), n in list(m.disaggs.items()):
            disagg.add_metric([DISAGG_PLUGIN, DISAGG_PLUGIN, model, dtype], n)
            old_disagg.add_metric([model, dtype], n)
        yield disagg
        yield old_disagg
        for fname in (CANONICAL + "info", "inference_extension_info"):
            info = GaugeMetricFamily(fname, "kv-epp's build (KV_EPP_COMMIT, KV_EPP_BUILD_REF)", labels=["commit",
                                     "build_ref"])  # fmt: skip
            info.add_metric([m.commit, m.build_ref], 1.0)
            yield info

    def _inflight(self) -> Iterator[Metric]:
        m = self.m
        reqs = GaugeMetricFamily(CANONICAL + "inflight_requests", "Requests in flight on each endpoint (this picker's)",
                                 labels=INFLIGHT_LABELS)  # fmt: skip
        toks = GaugeMetricFamily(
            CANONICAL + "inflight_tokens",
            "Uncached prompt tokens in flight on each endpoint, as the decision estimated them (this picker's)",
            labels=INFLIGHT_LABELS,
        )
        for (endpoint, fid, prio), (n, t) in list(m.inflight.items()):
            values = [endpoint, m.namespace, PRODUCER, fid, prio]
            reqs.add_metric(values, n)
            toks.add_metric(values, t)
        yield reqs
        yield toks


def pool_rows_from(snapshot: Callable[[], Iterable[Mapping[str, object]]]) -> Callable[[], list[PoolRow]]:
    """``PoolRow``s from the pool's health snapshot (``Pool.health_snapshot``: one mapping per endpoint)."""

    def rows() -> list[PoolRow]:
        out = []
        for e in snapshot():
            eng = e.get("engine")
            w = r = None
            kv = None
            if isinstance(eng, Mapping):
                w, r, kv = eng.get("waiting"), eng.get("running"), eng.get("kv_usage")
            out.append(
                PoolRow(
                    str(e.get("backend")),
                    bool(e.get("healthy")),
                    int(w) if isinstance(w, int) else None,
                    int(r) if isinstance(r, int) else None,
                    float(kv) if isinstance(kv, int | float) else None,
                )
            )
        return out

    return rows


class WithoutPrefix:
    """A registry's families less those whose name starts with ``prefix`` (``metrics.compat: llm-d`` drops
    ``continuum_*``): what ``generate_latest`` is given instead of the registry."""

    def __init__(self, registry: Collector, prefix: str) -> None:
        self.registry = registry
        self.prefix = prefix

    def collect(self) -> Iterator[Metric]:
        for metric in self.registry.collect():
            if not metric.name.startswith(self.prefix):
                yield metric


def exported(registry: Collector, compat: str) -> Collector:
    """What ``/metrics`` serves under ``metrics.compat``."""
    return WithoutPrefix(registry, "continuum_") if compat == "llm-d" else registry


class _Families:
    """Already-built families, as ``generate_latest`` reads a registry."""

    def __init__(self, families: Iterator[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return self._families
