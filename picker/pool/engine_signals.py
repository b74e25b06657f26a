"""Engine signals: each pool endpoint's own ``/metrics``, scraped off the request path, in the pool snapshot.

Every ``pool.engine_metrics.interval_ms`` the scraper GETs ``http://<address><path>`` of every endpoint
of the pool (read afresh each round, so a reload's added and removed endpoints are followed), at most
``max_concurrency`` at once, each bounded by ``timeout_ms`` (connect, answer and body) and ``max_bytes``
(a longer body is refused as ``too_large``, never parsed). The body is Prometheus text format; the engine's
queue and KV-cache usage are read from it and handed to the pool (``Pool.set_engine_signals``), which puts
them in every snapshot as ``EndpointState.engine``:

=============  ==============================  ==========================  =============================
signal         vLLM (v1 engine)                SGLang                      across series
=============  ==============================  ==========================  =============================
``waiting``    ``vllm:num_requests_waiting``   ``sglang:num_queue_reqs``   sum
``running``    ``vllm:num_requests_running``   ``sglang:num_running_reqs`` sum
``kv_usage``   ``vllm:kv_cache_usage_perc``    ``sglang:token_usage``      mean
               (before 0.9: ``gpu_cache_...``)
=============  ==============================  ==========================  =============================

vLLM labels each series ``model_name`` and ``engine`` (one per data-parallel engine core behind the one
API server); SGLang ``model_name``, ``engine_type``, ``tp_rank``, ``pp_rank`` and, with data-parallel
attention, ``dp_rank``. Series that differ only in a *mirror* label (``tp_rank``, ``pp_rank``,
``moe_ep_rank``: the ranks of one scheduler, which all report that scheduler's queue when SGLang runs
with ``--enable-metrics-for-all-schedulers``; ``pid``: one value written by several API-server processes
in prometheus_client's multiprocess mode) are one scheduler: the largest is taken. The remaining series
(engines, dp ranks, models) are separate queues behind one address: their requests add up. KV usage is
their **mean**: data-parallel engines have equal KV pools, so the mean is the fraction of the endpoint's
whole KV memory in use, the same quantity a single engine reports; the max would call an endpoint full
when one rank is, though the engine's own DP balancer sends new work to the emptier ranks.

vLLM's ``kv_cache_usage_perc`` is a fraction (0..1) of the blocks held by running requests (cached blocks
no request holds count as free); SGLang's ``token_usage`` is the used fraction of its token pool.
Counts must be finite, >= 0 and at most 1e9; usage finite in 0..1 (else it is None). A body without a
valid waiting and running reading is ``unparsed``.

Staleness: a good scrape is kept (and republished each round with its ``age_s``) until it is
``stale_after_ms`` old, then withdrawn (``engine=None``) by a timer at that instant, whatever the round is
doing; a failed scrape does not withdraw earlier. Outcomes per scrape: ok, timeout, error (refused,
reset, a status other than 200), too_large, unparsed.

The parser is strict and bounded (``parse_exposition``): sample lines ``name{labels} value [timestamp]``,
``# HELP`` / ``# TYPE`` comments, escaped label values (``\\\\``, ``\\"``, ``\\n``), ``NaN`` and
``±Inf``. A line that does not parse is skipped and counted, never raised; every pattern is possessive, so
a hostile line costs one pass. In the scraper only the lines of the wanted families are examined (found with
``str.find``, one scan per family; the other families of a vLLM body, mostly histogram buckets, are never
split into lines); a body over ``THREAD_PARSE_BYTES`` is parsed in a worker thread so the event loop keeps
serving. Redirects are not followed; the request asks for the 0.0.4 text format, uncompressed.

Bounds: per endpoint of the pool one ``_Target`` (the last reading, its time, one timer handle), dropped
when the endpoint leaves the pool or changes address; ``MAX_WANTED_SERIES`` wanted series per body, more
are dropped and counted; lines longer than ``MAX_LINE_CHARS`` are skipped; a body of at most ``max_bytes``;
one shared HTTP session (connections: at most ``max_concurrency`` scrapes in flight).
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace

import aiohttp

from picker.config import EngineMetricsConfig
from picker.ops.metrics import PickerMetrics
from picker.pool.pool import Pool
from picker.routing.endpoints import Endpoint, EngineSignals

log = logging.getLogger("kv_epp.engine_signals")

# -- the text format -----------------------------------------------------------------------------------
MAX_LINE_CHARS = 64 * 1024  # a longer line is skipped unparsed
MAX_LABELS = 64  # per sample; more: the line is skipped
MAX_WANTED_SERIES = 4096  # wanted-family samples kept per body; more are counted as dropped
METRIC_TYPES = frozenset({"counter", "gauge", "histogram", "summary", "untyped"})

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*+"
_LABEL_NAME = r"[a-zA-Z_][a-zA-Z0-9_]*+"
_LABEL_VALUE = r'"(?:[^"\\\n]|\\[\\"n])*+"'  # the three escapes the format defines, nothing else
_LABEL = rf"{_LABEL_NAME}[ \t]*+=[ \t]*+{_LABEL_VALUE}"
_LABELS = rf"\{{[ \t]*+(?:{_LABEL}(?:[ \t]*+,[ \t]*+{_LABEL})*+[ \t]*+,?[ \t]*+)?\}}"
# Go's ParseFloat forms Prometheus writes: decimal, exponent, NaN, +Inf / -Inf (no hex, no underscores).
# Every quantifier is possessive: a hostile line costs one pass, never a backtracking search.
_VALUE = r"[+-]?(?:(?:[0-9]++(?:\.[0-9]*+)?|\.[0-9]++)(?:[eE][+-]?[0-9]++)?|Inf|inf|NaN|nan)"
_SAMPLE_RE = re.compile(
    rf"[ \t]*+({_NAME})(?:[ \t]*+({_LABELS}))?[ \t]++({_VALUE})(?:[ \t]++(-?[0-9]{{1,19}}))?[ \t]*+"
)
_LABEL_RE = re.compile(rf'({_LABEL_NAME})[ \t]*+=[ \t]*+"((?:[^"\\\n]|\\[\\"n])*+)"')
_COMMENT_RE = re.compile(rf"[ \t]*+#[ \t]++(HELP|TYPE)[ \t]++({_NAME})(?:[ \t]++(.*))?", re.S)
_HELP_OR_TYPE_RE = re.compile(r"[ \t]*+#[ \t]++(?:HELP|TYPE)(?:[ \t]|$)")
_UNESCAPE_RE = re.compile(r"\\([\\\"n])")
_UNESCAPED = {"\\": "\\", '"': '"', "n": "\n"}


@dataclass(slots=True, frozen=True)
class Sample:
    """One sample line: metric name, labels (sorted by name), value, optional timestamp (ms)."""

    name: str
    labels: tuple[tuple[str, str], ...]
    value: float
    timestamp_ms: int | None = None

    def label(self, key: str) -> str | None:
        for k, v in self.labels:
            if k == key:
                return v
        return None


@dataclass(slots=True)
class Exposition:
    """What ``parse_exposition`` read: samples (of the wanted families, or all), declared types, and counts
    of the lines examined, skipped (did not parse) and dropped (beyond the sample bound)."""

    samples: list[Sample] = field(default_factory=list)
    types: dict[str, str] = field(default_factory=dict)  # one per family declared (of the wanted ones)
    examined: int = 0
    skipped: int = 0
    dropped: int = 0

    def family(self, name: str) -> list[Sample]:
        return [s for s in self.samples if s.name == name]


def _unescape(value: str) -> str:
    return _UNESCAPE_RE.sub(lambda m: _UNESCAPED[m.group(1)], value) if "\\" in value else value


def parse_sample(line: str) -> Sample | None:
    """One sample line, strictly (None: not a valid sample line). Never raises."""
    if len(line) > MAX_LINE_CHARS:
        return None
    m = _SAMPLE_RE.fullmatch(line)
    if m is None:
        return None
    name, raw_labels, raw_value, raw_ts = m.groups()
    labels: tuple[tuple[str, str], ...] = ()
    if raw_labels:
        pairs = [(k, _unescape(v)) for k, v in _LABEL_RE.findall(raw_labels)]
        if len(pairs) > MAX_LABELS or len({k for k, _ in pairs}) != len(pairs):
            return None  # too many labels, or one label twice
        labels = tuple(sorted(pairs))
    value = float(raw_value)  # the regex admits only what float() reads
    return Sample(name, labels, value, int(raw_ts) if raw_ts is not None else None)


_LINE_PREFIX_RE = re.compile(r"[ \t]*+(?:#[ \t]++(?:HELP|TYPE)[ \t]++)?")
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_:")


def _wanted_lines(text: str, families: Iterable[str]) -> Iterator[str]:
    """The lines that start with a wanted family's name (a sample, or its HELP / TYPE comment), found with
    ``str.find`` (no per-line work for the other lines). Each line is visited at most once per family: after
    a hit the search resumes at the next line, so a line repeating a name many times costs one pass."""
    n = len(text)
    for family in families:
        pos = 0
        while (i := text.find(family, pos)) >= 0:
            start = text.rfind("\n", 0, i) + 1
            end = text.find("\n", i)
            end = n if end < 0 else end
            pos = end + 1
            after = i + len(family)
            if after < n and text[after] in _NAME_CHARS:
                continue  # a longer name that starts with this one
            if i - start > MAX_LINE_CHARS or _LINE_PREFIX_RE.fullmatch(text, start, i) is None:
                continue  # the name inside another line (a label value, another family's HELP text)
            yield text[start:end]


def _all_lines(text: str) -> Iterator[str]:
    start = 0
    n = len(text)
    while start < n:
        end = text.find("\n", start)
        if end < 0:
            end = n
        yield text[start:end]
        start = end + 1


def parse_exposition(
    text: str,
    families: frozenset[str] | None = None,
    max_samples: int = MAX_WANTED_SERIES,
) -> Exposition:
    """Parse Prometheus text format. ``families``: read only these metric families (the lines of the others
    are never examined); None: every line. Bounded: at most ``max_samples`` samples kept; once that many are
    kept, the remaining sample lines are counted in ``dropped`` without being parsed; lines longer than
    ``MAX_LINE_CHARS`` are skipped. Never raises on any text."""
    out = Exposition()
    if families is None:
        lines: Iterable[str] = _all_lines(text)
    else:
        lines = _wanted_lines(text, sorted(families))
    for raw in lines:
        line = raw[:-1] if raw.endswith("\r") else raw
        if not line or line.isspace():
            continue
        out.examined += 1
        if len(line) > MAX_LINE_CHARS:
            out.skipped += 1
            continue
        if line.lstrip(" \t").startswith("#"):
            c = _COMMENT_RE.fullmatch(line)
            if c is None:
                out.skipped += _HELP_OR_TYPE_RE.match(line) is not None  # any other comment is allowed
                continue
            kind, name, rest = c.groups()
            if kind == "TYPE":
                declared = (rest or "").strip(" \t")
                if declared not in METRIC_TYPES:
                    out.skipped += 1
                elif (families is None or name in families) and len(out.types) < max_samples:
                    out.types[name] = declared
            continue
        if len(out.samples) >= max_samples:
            out.dropped += 1
            continue
        sample = parse_sample(line)
        if sample is None:
            out.skipped += 1
        elif families is None or sample.name in families:
            out.samples.append(sample)
    return out


# -- reading an engine's signals -----------------------------------------------------------------------
VLLM_WAITING = "vllm:num_requests_waiting"
VLLM_RUNNING = "vllm:num_requests_running"
VLLM_KV_USAGE = "vllm:kv_cache_usage_perc"
VLLM_KV_USAGE_OLD = "vllm:gpu_cache_usage_perc"  # the name before vLLM 0.9 (deprecated, hidden since 0.10)
SGLANG_WAITING = "sglang:num_queue_reqs"
SGLANG_RUNNING = "sglang:num_running_reqs"
SGLANG_KV_USAGE = "sglang:token_usage"
# (waiting, running, kv usage names in order of preference), tried in this order
ENGINE_FAMILIES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    (VLLM_WAITING, VLLM_RUNNING, (VLLM_KV_USAGE, VLLM_KV_USAGE_OLD)),
    (SGLANG_WAITING, SGLANG_RUNNING, (SGLANG_KV_USAGE,)),
)
# vLLM's per-request prefill records (observed when a request finishes): their sums and counts teach the cost
# model the engine's prefill cost per computed token (``picker.pool.calibration.EnginePrefillFit``)
VLLM_PREFILL_COUNT = "vllm:request_prefill_time_seconds_count"
VLLM_PREFILL_SECONDS = "vllm:request_prefill_time_seconds_sum"
VLLM_PREFILL_TOKENS = "vllm:request_prefill_kv_computed_tokens_sum"
VLLM_PREFILL_TOKENS_COUNT = "vllm:request_prefill_kv_computed_tokens_count"
PREFILL_FAMILIES = (VLLM_PREFILL_COUNT, VLLM_PREFILL_SECONDS, VLLM_PREFILL_TOKENS, VLLM_PREFILL_TOKENS_COUNT)
WANTED_FAMILIES = frozenset((*(n for w, r, kv in ENGINE_FAMILIES for n in (w, r, *kv)), *PREFILL_FAMILIES))
# Labels that tell apart reports of ONE scheduler (see the module docstring): series differing only in these
# are the same queue seen twice; the largest is taken.
MIRROR_LABELS = frozenset({"tp_rank", "pp_rank", "moe_ep_rank", "pid"})
MAX_COUNT = 1e9


def _per_queue(samples: list[Sample]) -> list[float]:
    """One value per queue: series keyed by their labels without the mirror labels, the largest per key."""
    queues: dict[tuple[tuple[str, str], ...], float] = {}
    for s in samples:
        key = tuple(kv for kv in s.labels if kv[0] not in MIRROR_LABELS)
        prev = queues.get(key)
        queues[key] = s.value if prev is None or s.value > prev else prev
    return list(queues.values())


def _count(samples: list[Sample]) -> int | None:
    """Sum over queues of a request count; None when absent or any value is not a count."""
    if not samples or any(not (0.0 <= s.value <= MAX_COUNT) for s in samples):  # NaN fails the comparison too
        return None
    return round(sum(_per_queue(samples)))


def _usage(samples: list[Sample]) -> float | None:
    """Mean over queues of a 0..1 usage; None when absent or any value is outside 0..1 (NaN included)."""
    if not samples or any(not (0.0 <= s.value <= 1.0) for s in samples):
        return None
    values = _per_queue(samples)
    return math.fsum(values) / len(values)


def engine_signals(expo: Exposition) -> EngineSignals | None:
    """The engine's queue and KV usage from a parsed body (vLLM first, then SGLang); None: no valid reading."""
    by_name: dict[str, list[Sample]] = {}
    for s in expo.samples:
        by_name.setdefault(s.name, []).append(s)
    for waiting_name, running_name, usage_names in ENGINE_FAMILIES:
        waiting_samples, running_samples = by_name.get(waiting_name), by_name.get(running_name)
        if not waiting_samples and not running_samples:
            continue
        waiting = _count(waiting_samples or [])
        running = _count(running_samples or [])
        if waiting is None or running is None:
            return None  # the engine's names are there but not both valid: no reading
        usage = next((u for n in usage_names if (u := _usage(by_name.get(n, []))) is not None), None)
        return EngineSignals(waiting=waiting, running=running, kv_usage=usage)
    return None


@dataclass(slots=True, frozen=True)
class PrefillTotals:
    """An engine's cumulative prefill records: finished requests, their prefill seconds and computed tokens."""

    requests: float
    seconds: float
    tokens: float

    def since(self, earlier: PrefillTotals) -> PrefillTotals | None:
        """The requests recorded between ``earlier`` and this reading; None when a counter went back (a
        restarted engine: the caller starts over from this reading)."""
        d = PrefillTotals(
            self.requests - earlier.requests, self.seconds - earlier.seconds, self.tokens - earlier.tokens
        )
        return d if min(d.requests, d.seconds, d.tokens) >= 0.0 else None


def prefill_totals(expo: Exposition) -> PrefillTotals | None:
    """vLLM's prefill sums and counts, summed over its engines (mirror series once); None when any is absent
    or not a finite count, or the two histograms counted different requests (a reading taken mid-update)."""
    values: list[float] = []
    for name in PREFILL_FAMILIES:
        samples = expo.family(name)
        if not samples or any(not (0.0 <= s.value < 1e15) for s in samples):
            return None
        values.append(math.fsum(_per_queue(samples)))
    requests, seconds, tokens, token_requests = values
    return PrefillTotals(requests, seconds, tokens) if requests == token_requests else None


def read_signals(text: str) -> tuple[EngineSignals | None, Exposition]:
    """Parse a scraped body (only the wanted families) and read the engine's signals from it."""
    expo = parse_exposition(text, WANTED_FAMILIES)
    return engine_signals(expo), expo


# -- the scraper ---------------------------------------------------------------------------------------
# unanswered scrapes in a row (timed out, refused, reset) that make a suspicion (``Pool.suspect``): the active
# health prober then asks the replica's health route (``picker.pool.health_probe``)
SCRAPE_SUSPICION_AFTER = 2
CONFIG_POLL_S = 1.0  # while waiting for the next round (or disabled), a reload is seen within this
THREAD_PARSE_BYTES = 256 * 1024  # a larger body is parsed in a worker thread (the event loop keeps serving)
REQUEST_HEADERS = {"Accept": "text/plain;version=0.0.4", "Accept-Encoding": "identity", "User-Agent": "kv-epp"}


@dataclass(slots=True)
class ScrapeResult:
    """One scrape: ``outcome`` is ok, timeout, error, too_large or unparsed (the metric's label values)."""

    outcome: str
    signals: EngineSignals | None = None
    skipped: int = 0
    detail: str = ""
    at: float = 0.0  # when the body was read (clock of the scraper)
    prefill: PrefillTotals | None = None  # vLLM's cumulative prefill records, when it reports them
    answered: bool = False  # an HTTP answer came (an error status, a body too large): the replica is alive

    @property
    def unanswered(self) -> bool:
        """No answer at all (timed out, refused, reset): a hint that the replica hangs (``Pool.suspect``)."""
        return self.outcome == "timeout" or (self.outcome == "error" and not self.answered)


@dataclass(slots=True)
class _Target:
    """One endpoint's scrape state (bound: one per endpoint of the pool)."""

    address: str
    signals: EngineSignals | None = None  # the last good reading (age_s 0), kept until stale
    ok_at: float | None = None  # when it was read
    published: bool = False  # the pool holds it now
    failing: str | None = None  # the outcome of the current run of failures (logged once), None while ok
    stale_s: float = 0.0  # the deadline's age when last published
    prefill: PrefillTotals | None = None  # the last prefill totals read (differenced by the next scrape)
    unanswered: int = 0  # scrapes in a row with no answer at all (a hint that the replica hangs)
    expiry: asyncio.TimerHandle | None = None


async def _read_capped(content: aiohttp.StreamReader, limit: int) -> bytes | None:
    """The body, or None once it exceeds ``limit`` bytes (the rest is never read)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        chunk = await content.read(min(1 << 16, limit + 1 - size))
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)


class EngineSignalScraper:
    """Scrapes every endpoint of ``pool`` each interval and publishes what the engines report (see module).

    ``run`` is the supervised background task; it reads ``pool.cfg.engine_metrics`` (hot-reloadable) before
    every round and while it waits, so a reload that turns it off, on, or changes its timing applies within
    ``CONFIG_POLL_S``. ``close`` closes the HTTP session (an ``on_stop`` hook)."""

    def __init__(
        self,
        pool: Pool,
        metrics: PickerMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        config: Callable[[], EngineMetricsConfig] | None = None,
    ) -> None:
        self.pool = pool
        self.metrics = metrics
        self._clock = clock
        self._config = config or (lambda: pool.cfg.engine_metrics)
        self._targets: dict[str, _Target] = {}
        self._session: aiohttp.ClientSession | None = None

    # -- loop ---------------------------------------------------------------------------------------
    async def run(self) -> None:
        try:
            while True:
                cfg = self._config()
                if not cfg.enabled:
                    self._forget_all()
                    await self._close_session()
                    await asyncio.sleep(CONFIG_POLL_S)
                    continue
                started = self._clock()
                await self.scrape_round(cfg)
                while (cfg := self._config()).enabled:
                    wait = started + cfg.interval_ms / 1000 - self._clock()
                    if wait <= 0:
                        break
                    await asyncio.sleep(min(wait, CONFIG_POLL_S))
        finally:
            self._cancel_timers()
            await self._close_session()

    async def close(self) -> None:
        self._cancel_timers()
        await self._close_session()

    async def _close_session(self) -> None:
        session, self._session = self._session, None
        if session is not None and not session.closed:
            await session.close()

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30),
                timeout=aiohttp.ClientTimeout(total=None),
                trust_env=False,  # engines are scraped directly, never through an environment proxy
            )
        return self._session

    # -- one round ----------------------------------------------------------------------------------
    async def scrape_round(self, cfg: EngineMetricsConfig | None = None) -> dict[str, ScrapeResult]:
        """Scrape every endpoint of the pool once, concurrently (bounded); publish; return the results."""
        cfg = cfg or self._config()
        endpoints = self.pool.endpoints
        self._follow_pool()
        slots = asyncio.Semaphore(cfg.max_concurrency)
        results = await asyncio.gather(*(self._scrape(ep, cfg, slots) for ep in endpoints))
        self._follow_pool()  # a reload may have come during the round
        out: dict[str, ScrapeResult] = {}
        for ep, result in zip(endpoints, results, strict=True):
            target = self._targets.get(ep.name)
            if target is None or target.address != ep.address:
                continue  # left the pool (or moved) while it was scraped: its answer is not this endpoint's
            out[ep.name] = result
            self._record(ep.name, target, result)
        self._publish(cfg)
        return out

    async def _scrape(self, ep: Endpoint, cfg: EngineMetricsConfig, slots: asyncio.Semaphore) -> ScrapeResult:
        async with slots:
            try:
                async with asyncio.timeout(cfg.timeout_ms / 1000):
                    body = await self._fetch(f"http://{ep.address}{cfg.path}", cfg.max_bytes)
            except TimeoutError:
                return ScrapeResult("timeout", detail=f"no complete answer within {cfg.timeout_ms} ms")
            except (aiohttp.ClientError, OSError, ValueError) as exc:
                return ScrapeResult("error", detail=f"{type(exc).__name__}: {exc}"[:200])
            if isinstance(body, ScrapeResult):
                return body
            at = self._clock()
            text = body.decode("utf-8", errors="replace")
            if len(body) > THREAD_PARSE_BYTES:
                signals, expo = await asyncio.to_thread(read_signals, text)
            else:
                signals, expo = read_signals(text)
            if signals is None:
                return ScrapeResult(
                    "unparsed", skipped=expo.skipped, detail=f"no valid waiting/running ({len(body)} bytes)", at=at
                )
            return ScrapeResult("ok", signals, expo.skipped, at=at, prefill=prefill_totals(expo))

    async def _fetch(self, url: str, max_bytes: int) -> bytes | ScrapeResult:
        async with self._get_session().get(url, headers=REQUEST_HEADERS, allow_redirects=False) as resp:
            if resp.status != 200:
                return ScrapeResult("error", detail=f"HTTP {resp.status}", answered=True)
            if resp.content_length is not None and resp.content_length > max_bytes:
                return ScrapeResult(
                    "too_large", detail=f"Content-Length {resp.content_length} > {max_bytes}", answered=True
                )
            body = await _read_capped(resp.content, max_bytes)
            if body is None:
                return ScrapeResult("too_large", detail=f"body over {max_bytes} bytes", answered=True)
            return body

    # -- state --------------------------------------------------------------------------------------
    def _follow_pool(self) -> None:
        """Targets = the pool's endpoints now: new ones added, removed or re-addressed ones dropped."""
        current = {ep.name: ep.address for ep in self.pool.endpoints}
        for name in [n for n, t in self._targets.items() if current.get(n) != t.address]:
            self._drop(name)
        for name, address in current.items():
            if name not in self._targets:
                self._targets[name] = _Target(address)

    def _drop(self, name: str) -> None:
        target = self._targets.pop(name)
        if target.expiry is not None:
            target.expiry.cancel()
        if target.published:
            self.pool.set_engine_signals(name, None)  # no-op when the name left the pool
        self._clear_gauges(name, age_too=True)

    def _forget_all(self) -> None:
        for name in list(self._targets):
            self._drop(name)

    def _cancel_timers(self) -> None:
        for target in self._targets.values():
            if target.expiry is not None:
                target.expiry.cancel()
                target.expiry = None

    def _record(self, name: str, target: _Target, result: ScrapeResult) -> None:
        if self.metrics is not None:
            self.metrics.engine_scrapes.labels(name, result.outcome).inc()
            if result.skipped:
                self.metrics.engine_scrape_skipped_lines.labels(name).inc(result.skipped)
        target.unanswered = target.unanswered + 1 if result.unanswered else 0
        if target.unanswered and target.unanswered % SCRAPE_SUSPICION_AFTER == 0:  # a hung replica fails them all
            self.pool.suspect(name, "scrape_unanswered")
        if result.outcome == "ok":
            target.signals, target.ok_at = result.signals, result.at
            self._prefill(target, result.prefill)
            if target.failing is not None:
                log.info("event=engine_scrape_recovered backend=%s after=%s", name, target.failing)
            target.failing = None
        elif target.failing != result.outcome:
            target.failing = result.outcome
            log.warning(
                "event=engine_scrape_failed backend=%s address=%s outcome=%s detail=%r keeping_last=%s",
                name, target.address, result.outcome, result.detail, target.signals is not None,
            )  # fmt: skip

    def _prefill(self, target: _Target, totals: PrefillTotals | None) -> None:
        """The requests the engine finished since its last scrape teach the cost model its prefill cost."""
        before, target.prefill = target.prefill, totals
        if before is None or totals is None:
            return
        d = totals.since(before)
        if d is not None and d.requests >= 1.0:
            self.pool.calibrator.observe_engine_prefill(d.requests, d.seconds, d.tokens)

    def _publish(self, cfg: EngineMetricsConfig) -> None:
        """Every target's last good reading into the pool with its age, or withdrawn once stale."""
        now = self._clock()
        stale_s = cfg.stale_after_ms / 1000
        loop = asyncio.get_running_loop()
        for name, target in self._targets.items():
            if target.ok_at is None:
                continue
            age = max(0.0, now - target.ok_at)
            if self.metrics is not None:
                self.metrics.engine_scrape_age_seconds.labels(name).set(age)
            signals = target.signals
            if signals is None:
                continue  # withdrawn already
            if age >= stale_s:
                self._withdraw(name, target, age)
                continue
            self.pool.set_engine_signals(name, replace(signals, age_s=round(age, 3)))
            target.published = True
            target.stale_s = stale_s
            self._set_gauges(name, signals)
            if target.expiry is not None:
                target.expiry.cancel()
            target.expiry = loop.call_later(stale_s - age, self._expire, name, target)

    def _expire(self, name: str, target: _Target) -> None:
        """Timer: the reading reached its deadline with no newer one (a newer one re-arms the timer). The age
        is checked on the scraper's clock; a timer that fires early re-arms for the rest."""
        target.expiry = None
        if self._targets.get(name) is not target or target.ok_at is None or target.signals is None:
            return
        age = max(0.0, self._clock() - target.ok_at)
        if age >= target.stale_s:
            self._withdraw(name, target, age)
        else:
            target.expiry = asyncio.get_running_loop().call_later(target.stale_s - age, self._expire, name, target)

    def _withdraw(self, name: str, target: _Target, age: float) -> None:
        log.info("event=engine_signals_withdrawn backend=%s age_s=%.3f reason=stale", name, age)
        if target.expiry is not None:
            target.expiry.cancel()
            target.expiry = None
        target.signals = None
        target.published = False
        self.pool.set_engine_signals(name, None)
        self._clear_gauges(name, age_too=False)
        if self.metrics is not None:
            self.metrics.engine_scrape_age_seconds.labels(name).set(age)

    # -- gauges -------------------------------------------------------------------------------------
    def _set_gauges(self, name: str, signals: EngineSignals) -> None:
        m = self.metrics
        if m is None:
            return
        m.engine_requests_waiting.labels(name).set(signals.waiting)
        m.engine_requests_running.labels(name).set(signals.running)
        if signals.kv_usage is None:
            m.engine_kv_cache_usage.remove(name)
        else:
            m.engine_kv_cache_usage.labels(name).set(signals.kv_usage)

    def _clear_gauges(self, name: str, age_too: bool) -> None:
        m = self.metrics
        if m is None:
            return
        gauges = [m.engine_requests_waiting, m.engine_requests_running, m.engine_kv_cache_usage]
        for gauge in gauges + ([m.engine_scrape_age_seconds] if age_too else []):
            gauge.remove(name)

    def status(self) -> dict[str, dict[str, object]]:
        """Per endpoint: address, the current failure (None while ok), the last good reading's age (s)."""
        now = self._clock()
        return {
            name: {
                "address": t.address,
                "failing": t.failing,
                "published": t.published,
                "age_s": None if t.ok_at is None else round(now - t.ok_at, 3),
            }
            for name, t in self._targets.items()
        }


__all__ = [
    "ENGINE_FAMILIES",
    "EngineSignalScraper",
    "Exposition",
    "Sample",
    "ScrapeResult",
    "engine_signals",
    "parse_exposition",
    "parse_sample",
    "prefill_totals",
    "read_signals",
]
